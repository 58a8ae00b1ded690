"""``asyncrl serve-tinker``: the Tinker API over HTTP, so that Tinker's own SDK,
``tinker.ServiceClient(base_url=URL, api_key=KEY)``, trains and samples on asyncrl.

The routes are the SDK's (``/api/v1/...``, each read from the SDK's ``resources/`` and
``lib/``); their bodies are read into the SDK's own request types (``wire.py``) and served by
:class:`~asyncrl.tinker.service.TinkerService`. A call that returns a future answers at once
with its request id; the work runs behind it (``futures.py``).

What the server tells the SDK at ``/api/v1/client/config`` (flags the SDK reads from the
server): plain API keys (no JWT exchange), httpx's own transport, a ``forward_backward``'s
chunks sent one after the other (so calls arrive in sequence order, ``service.py``),
uncompressed bodies, per-request polling, and chunks of at most one request's token budget
(``fwdbwd_max_chunk_bytes_count``: the SDK splits a large call into requests that each hold
the training thread for one micro-batch, so other clients' calls run between them). Its
dynamic config turns ``sample_cancel_enabled`` on: a sample the SDK abandons is cancelled
(``cancel_future``), as is what a closed session (``sessions/<id>/finish``) or one that stopped
heartbeating (``service.SESSION_EXPIRY_S``) left unfinished.

Refusals: a body the SDK's types refuse, a name this server does not serve, a request the
door refuses (token ids, lengths, shapes, optimizer bounds, the token budget: checked before
anything is queued on a shared thread), a checkpoint that is not (or no longer) here are 400 /
404 in ``json_api``'s error shape (the SDK raises ``BadRequestError`` / ``NotFoundError`` with
it); what fails while a future runs fails that future (``RequestFailedError``, category
``user``).

Like the gateway it binds to loopback unless ``tinker.api_key`` is set; the SDK sends the key
as ``X-API-Key``.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.util
import signal
import sys
import threading
from collections import Counter
from datetime import datetime, timedelta, timezone
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from tinker import types

from asyncrl.config import Config, ConfigError, TinkerConfig
from asyncrl.json_api import Refused, error_response, listen, read_json, validate
from asyncrl.rollout.gateway.access import is_loopback
from asyncrl.tinker.answers import HEADER, Answer, Answers
from asyncrl.tinker.futures import NotFound, UserError, failed, try_again
from asyncrl.tinker.sampling import SampleCall
from asyncrl.tinker.service import TinkerService
from asyncrl.tinker.training import TinkerLora
from asyncrl.tinker.wire import WireError, decode_forward_backward

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HEALTH = "/api/v1/healthz"
FILES = "/files"
"""Where an external checkpoint's files are downloaded: ``/files/<its token>/<file>``, no key."""
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}


REAP_S = 10.0
"""How often the sessions whose client went away are looked for (``service.SESSION_EXPIRY_S``)."""
STOP_S = 2.0
"""How long a stopping server waits for the replies under way (polls answer at once then: every
unfinished request was cut)."""
CUT = ("the server stopped (Ctrl-C or SIGTERM) before this request finished: it was cut. Training clients "
       "live in the server's memory; continue from your last save_state on the restarted server "
       "(create_training_client_from_state_with_optimizer)")

ANSWERED_ONCE = frozenset(f"/api/v1/{route}" for route in (
    "create_session", "create_model", "forward_backward", "optim_step", "save_weights", "save_weights_for_sampler",
    "save_weights_external", "load_weights", "create_sampling_session", "asample"))
"""The routes that start work or make something: a retry of one (its idempotency key) gets the
first answer back and runs nothing (``answers.py``)."""

REFUSALS: dict[type[Exception], int | None] = {Refused: None, UserError: 400, WireError: 400, NotFound: 404}
"""What a route may raise, and the HTTP status it becomes (``None``: its own)."""


def check_exposure(settings: TinkerConfig) -> None:
    """Raise ``ConfigError`` for a server other machines could reach with no key."""
    if is_loopback(settings.host) or settings.api_key is not None:
        return
    raise ConfigError(f"tinker.host={settings.host!r} is reachable from other machines and tinker.api_key is not "
                      "set: anyone reaching it could train and sample. Set tinker.api_key (a key starting with 'tml-': "
                      "the SDK refuses others; clients pass it as ServiceClient(api_key=...))")


def _fixed(payload: Any) -> Handler:
    """A route that answers ``payload`` whatever it is sent (the SDK's bookkeeping calls)."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(payload)

    return answer


async def _answer(handler: Handler, request: web.Request) -> Answer:
    response = await handler(request)
    assert isinstance(response, web.Response) and isinstance(response.body, bytes), "a route answers a body"
    return response.status, response.content_type, response.body


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    return validate(await read_json(request), model)


def _metadata(user_metadata: dict[str, Any] | None) -> dict[str, str] | None:
    """A create's ``user_metadata`` as the SDK's ``TrainingRun`` reads it back (string values)."""
    if user_metadata is None:
        return None
    if not all(isinstance(value, str) for value in user_metadata.values()):
        raise UserError("user_metadata: its values must be strings (types.TrainingRun reads dict[str, str]); "
                        "json.dumps the others")
    return dict(user_metadata)


def _count(request: web.Request, name: str, default: int) -> int:
    """A query parameter that counts (``limit``, ``offset``): a whole number from 0."""
    text = request.query.get(name, str(default))
    if not text.isdigit():
        raise UserError(f"{name}={text!r}: a whole number from 0 is needed")
    return int(text)


class TinkerServer:
    """:class:`TinkerService` behind the SDK's routes. :meth:`start`, then :meth:`stop`."""

    def __init__(self, service: TinkerService, settings: TinkerConfig) -> None:
        self.service, self.settings = service, settings
        self.answers = Answers(service.checkpoint_dir)
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.base_url: str | None = None

    async def start(self) -> str:
        check_exposure(self.settings)
        app = web.Application(middlewares=[self._errors_and_key()], client_max_size=256 << 20)
        get, post = app.router.add_get, app.router.add_post
        get(HEALTH, _fixed({"status": "ok"}))
        get("/api/v1/get_server_capabilities", self._capabilities)
        post("/api/v1/client/config", self._client_config)
        post("/api/v1/client/dynamic_config", _fixed({"sample_cancel_enabled": True}))  # abandoned samples: cancel
        post("/api/v1/create_session", self._create_session)
        post("/api/v1/session_heartbeat", self._heartbeat)
        post("/api/v1/sessions/{session_id}/finish", self._finish_session)
        post("/api/v1/telemetry", _fixed({"status": "accepted"}))
        post("/api/v1/cancel_future", self._cancel_future)
        post("/api/v1/create_model", self._create_model)
        post("/api/v1/get_info", self._get_info)
        post("/api/v1/forward_backward", self._forward_backward)
        post("/api/v1/optim_step", self._optim_step)
        post("/api/v1/save_weights", self._save_weights)
        post("/api/v1/save_weights_for_sampler", self._save_for_sampler)
        post("/api/v1/save_weights_external", self._save_external)
        post("/api/v1/load_weights", self._load_weights)
        post("/api/v1/create_sampling_session", self._create_sampling_session)
        post("/api/v1/asample", self._asample)
        post("/api/v1/retrieve_future", self._retrieve_future)
        post("/api/v1/weights_info", self._weights_info)
        get("/api/v1/samplers/{sampler_id}", self._get_sampler)
        get("/api/v1/training_runs", self._training_runs)
        get("/api/v1/training_runs/{run_id}", self._training_run)
        get("/api/v1/training_runs/{run_id}/checkpoints", self._list_checkpoints)
        get("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:.+}/external_weights_urls",
            self._external_urls)
        get(FILES + "/{token}/{relative:.+}", self._external_file)  # the URLs above: the token is the key
        app.router.add_delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:.+}", self._delete_checkpoint)
        self._runner, self.base_url = await listen(app, self.settings.host, self.settings.port,
                                                   shutdown_timeout=STOP_S)
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return self.base_url

    async def _reap(self) -> None:
        """Every :data:`REAP_S`: the requests of sessions whose client went away, cancelled."""
        while True:
            await asyncio.sleep(REAP_S)
            self.service.reap()

    async def stop(self) -> None:
        """Every unfinished request cut (its poll answers so, and the list goes to stderr), then
        the routes closed within :data:`STOP_S`. The service's shutdown then ends the training
        call running at its next module (``TinkerService.shutdown``)."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self._reaper is not None:
            self._reaper.cancel()
        cut = self.service.futures.cut(CUT)
        if cut:
            kinds = Counter(request_id.split("-", 1)[0] for request_id in cut)
            print(f"asyncrl serve-tinker: stopping; cut {len(cut)} unfinished requests "
                  f"({', '.join(f'{n} {kind}' for kind, n in sorted(kinds.items()))}): {', '.join(cut)}",
                  file=sys.stderr, flush=True)
        await runner.cleanup()

    def _errors_and_key(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        """The key first (all but the health check), then each refusal as its status (:data:`REFUSALS`)."""
        key = None if self.settings.api_key is None else self.settings.api_key.encode()
        wrong_key = Refused(401, "missing or wrong API key: pass ServiceClient(api_key=...) with tinker.api_key")

        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            sent = request.headers.get("X-API-Key", "").encode()
            keyless = request.path == HEALTH or request.path.startswith(FILES + "/")
            if key is not None and not keyless and not hmac.compare_digest(sent, key):
                return error_response(wrong_key)
            try:
                once = request.headers.get(HEADER) if request.path in ANSWERED_ONCE else None
                if once is None:
                    return await handler(request)
                status, content_type, body = await self.answers.once(once, lambda: _answer(handler, request))
                return web.Response(status=status, content_type=content_type, body=body)
            except web.HTTPException as exc:  # aiohttp's own 404 / 405, in the same shape
                if exc.status < 400:
                    raise
                return error_response(Refused(exc.status, f"{request.method} {request.path}: {exc.reason}"))
            except tuple(REFUSALS) as exc:
                status = REFUSALS[type(exc)]
                return error_response(exc if status is None else Refused(status, str(exc)))

        return middleware

    # ------------------------------------------------------------------ routes
    async def _capabilities(self, request: web.Request) -> web.Response:
        models = [{"model_name": base.name, "max_context_length": base.sampler.engine.max_positions,
                   "trainable": True, "sampleable": True} for base in self.service.bases.values()]
        return web.json_response({"supported_models": models})

    async def _client_config(self, request: web.Request) -> web.Response:
        return web.json_response({**CLIENT_CONFIG, "fwdbwd_max_chunk_bytes_count": self.service.chunk_bytes()})

    async def _heartbeat(self, request: web.Request) -> web.Response:
        self.service.heartbeat((await _body(request, types.SessionHeartbeatRequest)).session_id)
        return web.json_response({"type": "session_heartbeat"})

    async def _finish_session(self, request: web.Request) -> web.Response:
        self.service.finish_session(request.match_info["session_id"])
        return web.json_response(None)

    async def _cancel_future(self, request: web.Request) -> web.Response:
        """The SDK's cancel of a sample it abandoned (a timeout, a local cancel): its work stops."""
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
            raise UserError("cancel_future needs {\"request_id\": ...}")
        self.service.futures.cancel(body["request_id"], "cancelled by its client (cancel_future)")
        return web.json_response({})

    async def _create_session(self, request: web.Request) -> web.Response:
        await _body(request, types.CreateSessionRequest)
        return web.json_response({"type": "create_session", "session_id": self.service.create_session()})

    async def _create_model(self, request: web.Request) -> web.Response:
        body = await _body(request, types.CreateModelRequest)
        if body.optimizer_config.type != "adamw":
            raise UserError(f"optimizer {body.optimizer_config.type!r} is not served; this server trains with adamw")
        lora = body.lora_config or types.LoraConfig(rank=32)
        tinker_lora = TinkerLora(lora.rank, lora.seed, lora.train_mlp, lora.train_attn, lora.train_unembed)
        return web.json_response(self.service.create_model(body.session_id, body.model_seq_id, body.base_model,
                                                           tinker_lora, _metadata(body.user_metadata)))

    async def _get_info(self, request: web.Request) -> web.Response:
        body = await _body(request, types.GetInfoRequest)
        return web.json_response(self.service.get_info(body.model_id))

    async def _forward_backward(self, request: web.Request) -> web.Response:
        if request.headers.get("Content-Encoding", "identity") != "identity":
            raise UserError("compressed forward_backward bodies are not served (the client config says so)")
        return web.json_response(self.service.forward_backward(decode_forward_backward(await request.read())))

    async def _optim_step(self, request: web.Request) -> web.Response:
        body = await _body(request, types.OptimStepRequest)
        if not isinstance(body.optim_params, types.AdamParams):
            raise UserError(f"optimizer {getattr(body.optim_params, 'type', '?')!r} is not served; send AdamParams")
        return web.json_response(self.service.optim_step(body.model_id, body.seq_id, body.optim_params.model_dump()))

    async def _save_weights(self, request: web.Request) -> web.Response:
        body = await _body(request, types.SaveWeightsRequest)
        return web.json_response(self.service.save_state(body.model_id, body.seq_id, body.path))

    async def _save_for_sampler(self, request: web.Request) -> web.Response:
        body = await _body(request, types.SaveWeightsForSamplerRequest)
        return web.json_response(self.service.save_for_sampler(body.model_id, body.seq_id, body.path,
                                                               body.sampling_session_seq_id))

    async def _save_external(self, request: web.Request) -> web.Response:
        body = await _body(request, types.SaveWeightsExternalRequest)
        if body.age_encryption_recipients:
            raise UserError("age_encryption_recipients is not served: the files stay on this server's disk")
        return web.json_response(self.service.save_external(body.model_id, body.seq_id, body.path))

    async def _external_urls(self, request: web.Request) -> web.Response:
        """Download URLs, one a file, on this server (the hosted service signs bucket URLs;
        here the checkpoint's random token is the signature, valid until it is deleted)."""
        token, files = self.service.external_files(request.match_info["run_id"], request.match_info["checkpoint_id"])
        base = str(request.url.origin())
        expires = datetime.now(timezone.utc) + timedelta(days=3650)
        return web.json_response({"urls": {f: f"{base}{FILES}/{token}/{f}" for f in files},
                                  "expires": expires.isoformat()})

    async def _external_file(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(self.service.external_file(request.match_info["token"],
                                                           request.match_info["relative"]))

    async def _load_weights(self, request: web.Request) -> web.Response:
        body = await _body(request, types.LoadWeightsRequest)
        if body.model_id is None and (body.session_id is None or body.model_seq_id is None):
            raise UserError("load_weights needs model_id, or session_id with model_seq_id")
        return web.json_response(self.service.load_state(body.path, body.optimizer, model_id=body.model_id,
                                                         seq_id=body.seq_id, session_id=body.session_id,
                                                         model_seq_id=body.model_seq_id,
                                                         user_metadata=_metadata(body.user_metadata)))

    async def _create_sampling_session(self, request: web.Request) -> web.Response:
        body = await _body(request, types.CreateSamplingSessionRequest)
        sampler_id = self.service.create_sampler(body.session_id, body.sampling_session_seq_id, body.model_path,
                                                 body.base_model)
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})

    async def _asample(self, request: web.Request) -> web.Response:
        body = await _body(request, types.SampleRequest)
        if body.sampling_session_id is None:
            raise UserError("asample needs a sampling_session_id (create a sampling client first)")
        if body.topk_prompt_logprobs or body.topk_sample_logprobs or body.prompt_alt_tokens_k \
                or body.target_prompt_logprobs is not None or body.prompt_logprobs_last_n is not None:
            raise UserError("top-k logprobs, target_prompt_logprobs, prompt_alt_tokens_k and prompt_logprobs_last_n "
                            "are not served; this server returns sampled and prompt logprobs")
        params = body.sampling_params
        try:
            prompt = body.prompt.to_ints()
        except ValueError:  # an image or audio chunk: the SDK's own message names its type only
            raise UserError("prompt: only token chunks are served (this server runs text models)") from None
        call = SampleCall(prompt, body.num_samples, params.max_tokens, params.temperature,
                          params.top_p, params.top_k, params.seed, params.stop, bool(body.prompt_logprobs))
        return web.json_response(self.service.sample(body.sampling_session_id, call))

    async def _retrieve_future(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request, types.FutureRetrieveRequest)
        if not self.service.futures.known(body.request_id):
            raise NotFound(self.service.futures.unknown(body.request_id))
        outcome = await self.service.futures.retrieve(body.request_id)
        if outcome is None:
            return web.json_response(try_again(body.request_id))
        if outcome.error is not None:
            return web.json_response(failed(outcome))
        if isinstance(outcome.body, bytes):
            return web.Response(body=outcome.body, content_type=outcome.content_type)
        return web.json_response(outcome.body)

    async def _weights_info(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("tinker_path"), str):
            raise UserError("weights_info needs {\"tinker_path\": ...}")
        return web.json_response(self.service.weights_info(body["tinker_path"]))

    async def _get_sampler(self, request: web.Request) -> web.Response:
        sampler_id = request.match_info["sampler_id"]
        sampler = self.service.get_sampler(sampler_id)
        return web.json_response({"sampler_id": sampler_id, "base_model": sampler.base,
                                  "model_path": sampler.model_path})

    async def _training_run(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.records.training_run(request.match_info["run_id"],
                                                                   self.service.checkpoints))

    async def _training_runs(self, request: web.Request) -> web.Response:
        """Every run created on this server's checkpoint directory (``project_id``: no projects here, ignored)."""
        limit, offset = (_count(request, name, default) for name, default in (("limit", 20), ("offset", 0)))
        return web.json_response(self.service.records.training_runs(self.service.checkpoints, limit, offset))

    async def _list_checkpoints(self, request: web.Request) -> web.Response:
        return web.json_response({"checkpoints": self.service.list_checkpoints(request.match_info["run_id"])})

    async def _delete_checkpoint(self, request: web.Request) -> web.Response:
        self.service.delete_checkpoint(request.match_info["run_id"], request.match_info["checkpoint_id"])
        return web.json_response(None)


def build_service(cfg: Config) -> TinkerService:
    """The served models loaded (``model.path``, then ``tinker.models``) and the service over
    them; exit 2 (``ConfigError``) for what cannot be served, before the weights load where it can tell."""
    from asyncrl.policy import load_policy, resolve_model_path

    if importlib.util.find_spec("peft") is None:  # training clients are LoRA adapters
        raise ConfigError("asyncrl serve-tinker trains LoRA adapters and needs peft: pip install 'asyncrl[lora]'")
    default = cfg.tinker.base_model or cfg.model.path
    if default in cfg.tinker.models:
        raise ConfigError(f"tinker.models names {default!r}, the name of model.path's base (tinker.base_model); "
                          "give the other base models other names")
    paths = {default: cfg.model.path, **cfg.tinker.models}
    models = []
    for name, path in paths.items():
        # absolute: it is the tokenizer_id clients load, from whatever directory they run in
        model_dir = resolve_model_path(path).resolve()
        model, tokenizer = load_policy(cfg.model.model_copy(update={"path": path}))
        models.append((name, model_dir, model.requires_grad_(False), tokenizer))
    checkpoints = Path(cfg.tinker.checkpoint_dir or Path(cfg.output_dir) / "tinker")
    return TinkerService(models, checkpoint_dir=checkpoints, max_rank=cfg.tinker.max_lora_rank, seed=cfg.seed,
                         recompute=cfg.tinker.recompute_layers,
                         activation_budget=cfg.tinker.activation_budget_mib << 20,
                         micro_rows=cfg.optim.micro_batch_size, micro_tokens=cfg.optim.micro_batch_tokens,
                         rollout=cfg.rollout, engine_dtype=cfg.engine_dtype)


def serve_tinker(cfg: Config, *, on_ready: Callable[[str], None] | None = None) -> None:
    """Until Ctrl-C or SIGTERM: serve the Tinker API over ``model.path`` at ``tinker.host:port``.
    Prints the URL (stdout; a line for people on stderr)."""
    check_exposure(cfg.tinker)  # before the model loads
    asyncio.run(_serve(cfg, on_ready))


async def _serve(cfg: Config, on_ready: Callable[[str], None] | None) -> None:
    service = build_service(cfg)
    server = TinkerServer(service, cfg.tinker)
    stopped = asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stopped.set)
    try:
        try:
            url = await server.start()
        except OSError as exc:
            raise ConfigError(f"tinker.host/port {cfg.tinker.host}:{cfg.tinker.port}: {exc}") from None
        print(f"asyncrl serve-tinker: {', '.join(service.bases)} at {url}: tinker.ServiceClient(base_url={url!r}, "
              "api_key='tml-...'); Ctrl-C stops", file=sys.stderr, flush=True)
        print(url, flush=True)
        if on_ready is not None:
            on_ready(url)
        await stopped.wait()
    finally:
        await server.stop()
        await service.shutdown()
