"""``asyncrl serve-engine``: a rollout engine served over the part of vLLM's HTTP API that
``engine: remote`` (``asyncrl/engine/remote.py``) uses, so one client drives a ``vllm serve``
fleet and a fleet of these alike (a CPU fleet, CI, a machine without vLLM).

Routes, each vLLM's verb and shape (``vllm serve`` exposes the control ones with
``VLLM_SERVER_DEV_MODE=1``):

- ``GET /health``, ``GET /v1/models`` (with ``max_model_len``, as vLLM's model card has it);
- ``POST /tokenize``; ``POST /v1/completions`` with ``prompt_logprobs`` (scoring token ids: a
  distillation teacher's call) or with ``prompt`` as token ids, ``stop_token_ids``, ``seed``,
  ``logprobs`` and ``return_tokens_as_token_ids`` (tokens come back as ``token_id:<id>``),
  streamed (``stream: true``) or not;
- ``POST /pause?mode=abort|keep|wait``, ``POST /resume``, ``GET /is_paused``;
- ``POST /update_weight_version`` ``{"new_version": "7"}`` and ``GET /weight_info``: the
  version label vLLM stamps its outputs with;
- ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": P}}``:
  load the safetensors file (or every one in the directory) at ``P`` in place, the
  checkpoint-format reload; ``POST /reset_prefix_cache`` (the engine drops its prefix cache
  with every load by itself);
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: a PEFT adapter directory, listed in
  ``GET /v1/models`` with its ``parent``, and served to requests whose ``model`` names it.
  vLLM keeps many adapters beside the base; this engine holds one set of weights, so the
  adapter loaded last is merged into it (its own ``AdapterUpdate`` path,
  ``asyncrl/engine/adapters.py``, from the base every time) and the one a request may
  name: a request naming another (or the base while an adapter is merged) is refused
  (400) rather than served other weights. Unloading the merged adapter restores the base.

One extension, where vLLM's HTTP API has no field: each completion's last choice carries
``"completion": {"token_ids", "logprobs", "weight_versions"}``, the engine's own record with
the version that sampled each token. Streamed chunks before it carry the new token ids as
the engine samples them (``logprobs.tokens``) without logprobs: the engine hands those out
only with the finished completion.

Like the gateway it is bound to loopback unless ``engine_server.api_key`` (or
``allow_unauthenticated``) is set: whoever reaches it can pause the engine and load weights.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file

from asyncrl.algorithms import token_logprobs
from asyncrl.config import Config, ConfigError, EngineServerConfig
from asyncrl.config.engine_kinds import ENGINE_KINDS, EngineKind, engine_kind
from asyncrl.engine.protocol import (
    AdapterUpdate,
    EngineClosedError,
    FullWeights,
    LayerAdapter,
    PromptTooLongError,
    RolloutEngine,
)
from asyncrl.engine.remote_wire import read_peft_adapter
from asyncrl.json_api import Refused, error_response, listen, read_body, read_json
from asyncrl.policy import resolve_model_path
from asyncrl.rollout.gateway.access import is_loopback
from asyncrl.types import Completion, SamplingParams

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TOKEN_PREFIX = "token_id:"
"""vLLM's spelling of a token under ``return_tokens_as_token_ids``."""


class CompletionRequest(BaseModel):
    """The fields of vLLM's ``/v1/completions`` this server honours; others are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    """The base model's name or a loaded LoRA adapter's (``/v1/load_lora_adapter``)."""
    prompt: list[int] | list[list[int]] = Field(min_length=1)
    """Token ids; a list of them only to score (``prompt_logprobs``)."""
    prompt_logprobs: int | None = Field(None, ge=0, le=0)
    """vLLM's: the logprob of every prompt token after the first (0: the prompt's own token only).
    Here a scoring request, what a distillation teacher is asked (``asyncrl/frozen/teacher.py``):
    nothing is generated (``max_tokens`` is not honoured)."""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1  # vLLM: -1 (or 0) = off
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    n: int = Field(1, ge=1, le=1)


def check_exposure(settings: EngineServerConfig) -> None:
    """Raise ``ConfigError`` for a server other machines could reach with no key."""
    if is_loopback(settings.host) or settings.api_key is not None or settings.allow_unauthenticated:
        return
    raise ConfigError(f"engine_server.host={settings.host!r} is reachable from other machines and "
                      "engine_server.api_key is not set: anyone reaching it could pause the engine and load weights "
                      "into it. Set engine_server.api_key (clients send 'Authorization: Bearer <key>'; remote.api_key "
                      "for asyncrl's), or engine_server.allow_unauthenticated=true to serve it open")


class EngineServer:
    """``engine`` behind vLLM's HTTP verbs. Start with :meth:`start`, stop with :meth:`stop`."""

    def __init__(self, engine: RolloutEngine, *, model_name: str, settings: EngineServerConfig,
                 tokenizer: Any = None, kind: EngineKind = ENGINE_KINDS["torch"],
                 base_path: Path | None = None) -> None:
        """``kind``: the engine's row of the kinds table (whether it scores prompts);
        ``base_path``: the model directory it was started on, whose weights ``reload_weights``
        with no path loads again (vLLM's reload from disk)."""
        self.engine, self.model_name, self.settings, self.tokenizer = engine, model_name, settings, tokenizer
        self.kind, self.base_path = kind, base_path
        self.max_model_len = engine.max_context
        self.paused = False
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        self.merged: tuple[str, AdapterUpdate] | None = None  # the adapter merged into the engine now
        self._adapter_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    async def start(self, host: str | None = None, port: int | None = None) -> str:
        settings = self.settings
        check_exposure(settings)
        app = web.Application(middlewares=[self._errors_and_key()], client_max_size=1 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/is_paused", self._is_paused)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_post("/collective_rpc", self._collective_rpc)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_lora_adapter)
        # a client that hangs up (its deadline passed) cancels its handler, so work it no longer
        # waits for (a teacher's scoring queued behind others) leaves the engine's queue
        self._runner, self.base_url = await listen(app, settings.host if host is None else host,
                                                   settings.port if port is None else port,
                                                   handler_cancellation=True)
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _errors_and_key(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        key = None if self.settings.api_key is None else self.settings.api_key.encode()

        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            if key is not None and request.path != "/health":
                scheme, _, token = request.headers.get("Authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
                    return error_response(Refused(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                                       "(engine_server.api_key)"))
            try:
                return await handler(request)
            except Refused as exc:
                return error_response(exc)
            except EngineClosedError as exc:
                return error_response(Refused(503, f"the engine is closed: {exc}"))
            except web.HTTPException as exc:  # aiohttp's own 404/405, in the same shape as ours
                if exc.status < 400:
                    raise
                return error_response(Refused(exc.status, f"{request.method} {request.path}: {exc.reason}"))

        return middleware

    # ------------------------------------------------------------------ routes
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        root = str(self.base_path) if self.base_path is not None else self.model_name
        card = {"id": self.model_name, "object": "model", "owned_by": "asyncrl", "root": root,
                "max_model_len": self.max_model_len}
        adapters = [{"id": name, "object": "model", "owned_by": "asyncrl", "root": path, "parent": self.model_name}
                    for name, path in self.adapters.items()]
        return web.json_response({"object": "list", "data": [card, *adapters]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request, CompletionRequest)
        self._check_model(body.model)
        if body.prompt_logprobs is not None:
            return web.json_response(await self._score(body.prompt))
        if not isinstance(body.prompt[0], int):
            raise Refused(400, "a list of prompts is served only with prompt_logprobs (scoring); send one "
                               "prompt of token ids per request to generate", "prompt")
        sampling = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=max(body.top_k, 0), stop_token_ids=tuple(body.stop_token_ids), seed=body.seed)
        if not body.stream:
            completion = await self._generate(body.prompt, sampling, None)
            return web.json_response(self._reply(completion, final=True))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunks: asyncio.Queue[list[int] | None] = asyncio.Queue()
        task = asyncio.ensure_future(self._generate(body.prompt, sampling, chunks.put_nowait))
        task.add_done_callback(lambda _: chunks.put_nowait(None))
        try:
            while (tokens := await chunks.get()) is not None:
                await _send(response, {"choices": [{"index": 0, "text": "", "finish_reason": None,
                                                    "logprobs": {"tokens": [f"{TOKEN_PREFIX}{t}" for t in tokens]}}]})
            try:
                completion = task.result()
            except Refused as exc:
                await _send(response, {"error": {"message": str(exc), "code": exc.status}})
            else:
                await _send(response, self._reply(completion, final=False))
            await response.write(b"data: [DONE]\n\n")
        finally:
            task.cancel()  # the client hung up: its request leaves the engine
        return response

    async def _score(self, prompt: list[int] | list[list[int]]) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs`` shape, per sequence: ``None`` then ``{token_id: {"logprob"}}``
        for each later token, from the served weights at temperature 1 (on the engine's thread,
        between two decode steps)."""
        sequences = [prompt] if isinstance(prompt[0], int) else prompt
        if not self.kind.scores_prompts:
            raise Refused(400, f"engine={self.kind.name} does not score prompts (prompt_logprobs): serve a kind "
                               "that does (engine=torch)", "prompt")
        model, call = self.engine.model, self.engine.call_between_steps  # a kind that scores exposes both
        for ids in sequences:
            if self.max_model_len and len(ids) > self.max_model_len:
                raise Refused(400, f"a sequence of {len(ids)} tokens is longer than the model's context "
                                   f"({self.max_model_len})", "prompt")

        def score() -> list[list[float]]:
            out = []
            device = next(model.parameters()).device
            with torch.inference_mode():
                for ids in sequences:
                    x = torch.tensor([ids], device=device)
                    out.append(token_logprobs(model(input_ids=x).logits[0, :-1], x[0, 1:]).tolist())  # (L-1,)
            return out

        scored = await call(score)
        choices = [{"index": i, "text": "", "finish_reason": "length",
                    "prompt_logprobs": [None, *({str(t): {"logprob": lp, "rank": None}}
                                                for t, lp in zip(ids[1:], lps))]}
                   for i, (ids, lps) in enumerate(zip(sequences, scored))]
        return {"id": f"cmpl-score-{time.monotonic_ns():x}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices}

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize`` ``{"prompt", "add_special_tokens"}`` → ``{"tokens", "count"}``: what a
        distillation run asks a teacher to check the two tokenizers agree."""
        if self.tokenizer is None:
            raise Refused(404, "this server has no tokenizer to tokenize with")
        body = await read_json(request)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise Refused(400, "prompt: expected a string", "prompt")
        tokens = self.tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", True)))
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})

    async def _generate(self, prompt: list[int], sampling: SamplingParams,
                        on_tokens: Callable[[list[int]], None] | None) -> Completion:
        try:
            if on_tokens is None:
                return await self.engine.generate(prompt, sampling)
            return await self.engine.generate(prompt, sampling, on_tokens=on_tokens)  # type: ignore[call-arg]
        except PromptTooLongError as exc:
            raise Refused(400, str(exc), "prompt") from None

    def _reply(self, completion: Completion, *, final: bool) -> dict[str, Any]:
        """A completion in vLLM's shape, with our ``completion`` record on the choice.
        ``final``: the whole reply (non-streamed) rather than the stream's last chunk, whose
        tokens were sent already."""
        tokens = completion.token_ids if final else []
        choice = {"index": 0, "text": "", "finish_reason": completion.finish_reason,
                  "logprobs": {"tokens": [f"{TOKEN_PREFIX}{t}" for t in tokens],
                               "token_logprobs": list(completion.logprobs) if final else [], "top_logprobs": None,
                               "text_offset": []},
                  "completion": {"token_ids": list(completion.token_ids), "logprobs": list(completion.logprobs),
                                 "weight_versions": [str(v) for v in completion.versions]}}
        return {"id": f"cmpl-{id(completion):x}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": {"completion_tokens": len(completion.token_ids)}}

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")  # vLLM's default
        if mode not in ("abort", "keep", "wait"):
            raise Refused(400, f"mode must be abort, keep or wait, got {mode!r}", "mode")
        await self.engine.pause(mode)  # type: ignore[arg-type]
        self.paused = True
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_body(request, _NewVersion)
        try:
            version = int(body.new_version)
        except ValueError:
            raise Refused(400, f"new_version must be an integer (asyncrl's policy version), got {body.new_version!r}",
                          "new_version") from None
        await self.engine.update_weights(FullWeights({}), version)  # no tensor: the label alone
        return web.json_response({"success": True, "new_version": body.new_version})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.version)})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = await read_body(request, _Rpc)
        if body.method != "reload_weights":
            raise Refused(400, f"this server runs only collective_rpc method 'reload_weights', got {body.method!r}",
                          "method")
        path = body.kwargs.get("weights_path")
        if path is None and self.base_path is not None:  # vLLM's reload from disk: the model it started on
            path = str(self.base_path)
        if not isinstance(path, str):
            raise Refused(400, "reload_weights needs kwargs.weights_path: a safetensors file or a directory of them "
                               "(this server was started on no model directory to reload from)",
                          "kwargs.weights_path")
        weights = await asyncio.to_thread(_read_weights, Path(path))
        try:
            await self.engine.update_weights(FullWeights(weights), self.engine.version)
        except KeyError as exc:
            raise Refused(400, f"{path}: {exc.args[0]}", "kwargs.weights_path") from None
        return web.json_response({"results": [None]})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.Response(status=200)  # every weight load drops it already

    def _check_model(self, model: str | None) -> None:
        """``model`` names what the engine holds now: the merged adapter, or the base when
        none is (an absent ``model`` is the base too, as the frozen models' client sends)."""
        merged = self.merged[0] if self.merged is not None else None
        if model == merged or (merged is None and model in (None, self.model_name)):
            return
        if model not in self.adapters and model not in (None, self.model_name):
            raise Refused(404, f"The model `{model}` does not exist.", "model")
        raise Refused(400, f"this server holds one set of weights, now {merged or 'the base ' + self.model_name}: "
                           f"it cannot serve {model or 'the base'} beside it (load that adapter, or unload "
                           f"{merged})", "model")

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/load_lora_adapter``: the adapter read and merged into the engine
        (from the base; layers of the adapter merged before and not in this one go back to
        the base). Answers vLLM's text."""
        body = await read_body(request, _LoadLora)
        if body.lora_name == self.model_name:
            raise Refused(400, f"The lora adapter '{body.lora_name}' conflicts with a served base model.", "lora_name")
        if body.lora_name in self.adapters and not body.load_inplace:
            raise Refused(400, f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load "
                               "the adapter in place, set 'load_inplace' to True.", "lora_name")
        try:
            adapter = await asyncio.to_thread(read_peft_adapter, Path(body.lora_path))
        except ValueError as exc:
            raise Refused(400, str(exc), "lora_path") from None
        async with self._adapter_lock:
            await self._merge(adapter)
            self.merged = (body.lora_name, adapter)
            self.adapters[body.lora_name] = body.lora_path
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await read_body(request, _UnloadLora)
        if body.lora_name not in self.adapters:
            raise Refused(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
        async with self._adapter_lock:
            if self.merged is not None and self.merged[0] == body.lora_name:
                await self._merge(None)
                self.merged = None
            del self.adapters[body.lora_name]
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _merge(self, adapter: AdapterUpdate | None) -> None:
        """``adapter`` merged into the engine (``None``: none), the layers of the adapter
        merged until now that it does not cover sent with a zero B: W_base + 0, the base."""
        layers = dict(adapter.layers) if adapter is not None else {}
        if self.merged is not None:
            for name, layer in self.merged[1].layers.items():
                if name not in layers:
                    layers[name] = LayerAdapter(layer.a, layer.b.new_zeros(layer.b.shape), 0.0, layer.transposed)
        if not layers:
            return
        update = AdapterUpdate(layers, rank=adapter.rank if adapter else 1, alpha=adapter.alpha if adapter else 1.0)
        try:
            await self.engine.update_weights(update, self.engine.version)
        except KeyError as exc:
            raise Refused(400, f"the adapter does not fit {self.model_name}: {exc.args[0]}", "lora_path") from None
        except TypeError as exc:
            raise Refused(400, f"this engine takes no LoRA adapters: {exc}", "lora_path") from None


class _NewVersion(BaseModel):
    new_version: str


class _LoadLora(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class _UnloadLora(BaseModel):
    lora_name: str = Field(min_length=1)


class _Rpc(BaseModel):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise Refused(400, f"no safetensors file at {path} (this server must see the path the trainer wrote: a "
                           "local disk on the same machine, or a shared mount)", "kwargs.weights_path")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())


def serve_engine(cfg: Config, *, on_ready: Callable[[str], None] | None = None) -> None:
    """Until Ctrl-C or SIGTERM: build the configured engine (``engine: torch``, or ``vllm``)
    on ``model.path`` and serve it at ``engine_server.host:port``."""
    from asyncrl.rollout.worker import RolloutWorker

    kind = engine_kind(cfg.engine)
    if not kind.servable:
        raise ConfigError(f"asyncrl serve-engine serves an engine of its own: one of "
                          f"{', '.join(k.name for k in ENGINE_KINDS.values() if k.servable)}, not engine={kind.name} "
                          f"({kind.summary}: that is the trainer's side)")
    check_exposure(cfg.engine_server)  # before the model loads

    async def main() -> None:
        worker = RolloutWorker(cfg, seed=cfg.seed, num_threads=cfg.rollout.num_threads)
        await worker.start()
        engine = await worker.ready_engine()
        server = EngineServer(engine, model_name=cfg.model.path, settings=cfg.engine_server, tokenizer=worker.tokenizer,
                              kind=kind, base_path=resolve_model_path(cfg.model.path))
        stop = asyncio.Event()
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        try:
            try:
                url = await server.start()
            except OSError as exc:
                raise ConfigError(f"engine_server.host/port {cfg.engine_server.host}:{cfg.engine_server.port}: "
                                  f"{exc}") from None
            key = "; 'Authorization: Bearer <engine_server.api_key>' required" if cfg.engine_server.api_key else ""
            print(f"asyncrl serve-engine: {cfg.model.path} ({cfg.engine} engine, version {engine.version}) at {url} "
                  f"(vLLM's HTTP API; engine=remote \"remote.urls=[{url}]\"{key}); Ctrl-C stops",
                  file=sys.stderr, flush=True)
            if on_ready is not None:
                on_ready(url)
            await stop.wait()
        finally:
            await server.stop()
            await worker.shutdown()

    asyncio.run(main())

