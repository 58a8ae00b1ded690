"""``asyncrl serve``: the gateway standalone over ``model.path``, for trying an agent by
hand. Nothing is recorded or trained; requests sample as they ask. It listens with the
training gateway's checks (``gateway/access.py``): the key, the body limit, no open port
beyond loopback.

It sits beside ``eval_command.py`` (``asyncrl eval``), not in ``gateway/``: like eval it is
a run assembled from the pre-flight and a rollout worker, which are above the gateway."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

from asyncrl.rollout.client import stop_token_ids
from asyncrl.config import Config, ConfigError
from asyncrl.rollout.gateway.access import check_exposure
from asyncrl.rollout.gateway.server import Gateway
from asyncrl.rollout.gateway.tool_calls import check_format_name, resolve_format
from asyncrl.orchestrator.announce import template_notes
from asyncrl.orchestrator.preflight import preflight
from asyncrl.rollout.worker import RolloutWorker


def serve(cfg: Config) -> None:
    """Until Ctrl-C or SIGTERM; on a thread other than the main one (an application, a
    notebook), until the process ends, as signals belong to the main thread."""
    check_format_name(cfg.gateway.tool_parser)  # before the model loads, like the exposure
    check_exposure(cfg.gateway.host, cfg.gateway)  # before the model loads (start checks again)
    checked = preflight(cfg, "eval")
    tool_format = resolve_format(cfg.gateway.tool_parser, checked.tokenizer)

    async def main() -> None:
        worker = RolloutWorker(cfg, model=checked.model, tokenizer=checked.tokenizer, seed=cfg.seed)
        await worker.start()
        sampling = worker.sampling
        gateway = Gateway(checked.tokenizer, tool_format, model_name=cfg.model.path, engine=worker.engine,
                          sampling=sampling, settings=cfg.gateway)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():  # only there may Python own signals
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        try:
            url = await gateway.start(cfg.gateway.host, cfg.gateway.port)
            key = "; 'Authorization: Bearer <gateway.api_key>' required" if cfg.gateway.api_key else ""
            notes = template_notes(checked.tokenizer, templated=True, tool_format=tool_format)
            print(f"asyncrl serve: {cfg.model.path} at {url}/v1 (OpenAI API; stop tokens "
                  f"{list(stop_token_ids(checked.tokenizer))}{key}); Ctrl-C stops"
                  + "".join(f"\n  {note}" for note in notes), file=sys.stderr, flush=True)
            await stop.wait()
        except OSError as exc:  # the port is taken, or the host is not ours
            raise ConfigError(f"gateway.host/gateway.port {cfg.gateway.host}:{cfg.gateway.port}: {exc}") from None
        finally:
            await gateway.stop()
            await worker.shutdown()

    asyncio.run(main())
