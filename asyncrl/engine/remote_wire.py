"""What crosses the wire between ``engine: remote``'s client (``asyncrl/engine/remote.py``) and
its servers: a server as the client knows it, the two ways a call fails (a server lost, a
refusal), the fleet's counts, vLLM's spelling of a token, the weights file a server loads,
a LoRA adapter as the PEFT directory vLLM's LoRA loader (and ``serve-engine``) reads, and
one streamed completion (its body built by a pure function, its stream read back)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import torch
from safetensors.torch import load_file, save_file

from asyncrl.config import ConfigError, RemoteConfig
from asyncrl.engine.protocol import AdapterUpdate, LayerAdapter
from asyncrl.engine.vllm_engine import VLLMStats
from asyncrl.types import FinishReason, SamplingParams

TOKEN_PREFIX = "token_id:"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class ServerLost(Exception):
    """A server stopped answering; ``tokens``/``logprobs``: what the request had received;
    ``refused``: nothing accepted the connection (nothing listening at the address)."""

    def __init__(self, reason: str, tokens: list[int] | None = None, logprobs: list[float] | None = None,
                 versions: list[int] | None = None, *, refused: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.tokens, self.logprobs, self.refused = reason, tokens or [], logprobs or [], refused
        self.versions = versions or []


class ServersUnusable(ConfigError):
    """A server at ``remote.urls`` that this trainer cannot use as given — nothing listening
    there, or another model — found at connect: a usage error (exit 2), one line naming it."""


class ControlError(RuntimeError):
    """A control call that failed on a server that is up (a refusal, not a lost server)."""


VLLM_SERVE_OWNER = "vllm"
"""``owned_by`` on ``vllm serve``'s model cards: which server program a URL runs (``asyncrl
serve-engine`` says ``asyncrl``), not an engine kind."""


@dataclass(eq=False)
class Server:
    url: str
    model: str = ""
    root: str | None = None  # where it loaded its model from (its model card's ``root``)
    owner: str = ""  # its model card's ``owned_by``: ``vllm`` for vllm serve, ``asyncrl`` for serve-engine
    max_model_len: int = 0
    version: int | None = None  # the label this client last set there (None: unknown)
    serving: int | None = None  # the version its tokens come from now: ``version`` from the moment it is resumed
    replicas: int | None = None  # data-parallel engines behind its one URL (None: not asked yet)
    adapter: str | None = None  # the LoRA adapter this client loaded there: what its requests name
    usable: bool = False
    lost_reason: str | None = None
    revivable: bool = True  # False: never used again once lost (outside an NCCL group formed without it)
    in_flight: int = 0
    requests: int = 0
    health_check: asyncio.Future[str | None] | None = None  # the /health check in flight (Fleet.suspect)


class RemoteStats(VLLMStats):
    """What the trainer reads (``busy_s``: wall time with a request in flight and the client
    not paused, as for vLLM in-process; the servers' own step times stay with them), and
    the fleet's counts."""

    def __init__(self) -> None:
        super().__init__()
        self.received = 0  # token ids that came over the wire, those without logprobs (yet) included
        self.servers_lost = 0
        self.lost: dict[str, int] = {}  # each server lost so far (its URL) and how many times
        self.reissued_requests = 0  # requests sent again to another server after theirs was lost
        self.reissued_tokens = 0  # tokens carried over to another server instead of sampled again
        self.suspected = 0  # failed requests whose server then answered /health: sent again, not lost


def _write_atomically(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """``directory/model.safetensors``, written beside it and renamed into place: a server
    never reads half a file, and a checkpoint-format loader sees one complete file."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".model.safetensors.tmp{os.getpid()}"
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / "model.safetensors")


PEFT_PREFIX = "base_model.model."
"""peft's prefix of a ``PeftModel``'s state-dict keys, which its saved adapters keep."""


def write_peft_adapter(update: AdapterUpdate, directory: Path) -> None:
    """``update`` as the directory ``peft``'s ``save_pretrained`` writes (what vLLM's
    ``/v1/load_lora_adapter`` and ``serve-engine`` read): ``adapter_model.safetensors`` with
    ``base_model.model.<layer>.lora_A.weight`` (r × in) and ``.lora_B.weight`` (out × r) per
    targeted layer, and ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
    ``fan_in_fan_out``). A loader scales by ``lora_alpha / r``: a layer whose own scale is
    another (none of the learner's) has the ratio folded into its B. Written under a
    temporary name and renamed into place: a server never reads half an adapter."""
    if not update.layers:
        raise ValueError("an AdapterUpdate with no layer: nothing to write")
    scale = update.alpha / update.rank
    transposed = {layer.transposed for layer in update.layers.values()}
    if len(transposed) > 1:
        raise ValueError("an AdapterUpdate mixes transposed (Conv1D) and plain layers, which one PEFT "
                         "adapter_config.json (fan_in_fan_out) cannot say")
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in update.layers.items():
        if not name.endswith(".weight"):
            raise ValueError(f"an AdapterUpdate layer is named by its base weight (<module>.weight), got {name!r}")
        module = PEFT_PREFIX + name[:-len(".weight")]
        b = layer.b if math.isclose(layer.scale, scale, rel_tol=1e-12) else layer.b * (layer.scale / scale)
        tensors[f"{module}.lora_A.weight"] = layer.a.detach().cpu().contiguous()
        tensors[f"{module}.lora_B.weight"] = b.detach().cpu().contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": update.rank, "lora_alpha": update.alpha,
              "target_modules": sorted({name[:-len(".weight")].rsplit(".", 1)[-1] for name in update.layers}),
              "fan_in_fan_out": transposed.pop(), "bias": "none", "lora_dropout": 0.0, "use_rslora": False,
              "use_dora": False, "base_model_name_or_path": None, "inference_mode": True}
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(directory, ignore_errors=True)  # a version written again (a resumed run)
    os.replace(tmp, directory)


def read_peft_adapter(directory: Path) -> AdapterUpdate:
    """The :class:`AdapterUpdate` of a PEFT adapter directory (the inverse of
    :func:`write_peft_adapter`; any LoRA adapter ``peft`` saved without rsLoRA, DoRA or
    per-module ranks). ``ValueError`` naming what is missing or not understood."""
    config_file, tensor_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not tensor_file.is_file():
        raise ValueError(f"{directory} is not a PEFT adapter directory (adapter_config.json and "
                         "adapter_model.safetensors); the server must see the path the trainer wrote")
    config = json.loads(config_file.read_text())
    unsupported = [k for k in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern") if config.get(k)]
    if unsupported or "r" not in config or "lora_alpha" not in config:
        raise ValueError(f"{config_file}: needs r and lora_alpha, and no {unsupported or 'rsLoRA/DoRA/patterns'}")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    tensors = load_file(tensor_file)
    layers = {}
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[:-len(".lora_A.weight")]
        b_key = f"{module}.lora_B.weight"
        if b_key not in tensors:
            raise ValueError(f"{tensor_file}: {key} has no {b_key}")
        name = (module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module) + ".weight"
        layers[name] = LayerAdapter(tensors[key], tensors[b_key], alpha / rank, bool(config.get("fan_in_fan_out")))
    if not layers:
        raise ValueError(f"{tensor_file} holds no lora_A/lora_B weights")
    return AdapterUpdate(layers, rank=rank, alpha=alpha)


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_PREFIX):
        raise ControlError(f"a completion token {token!r} is not 'token_id:<id>': the server ignored "
                           "return_tokens_as_token_ids")
    return int(token[len(TOKEN_PREFIX):])


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:300]
    return str(error)[:300]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


KEEPALIVE_S = 2.0
"""How long a pooled connection may idle before it is dropped rather than reused: under
the servers' own keep-alive timeouts (vLLM's HTTP server closes an idle connection after
5 s), so a request is not written on a connection the server is closing."""

NEVER_ARRIVED = (aiohttp.ClientConnectionError, ConnectionError)
"""What a request fails with when it never reached its server: the connection it was
written on was reset or closed (``ServerDisconnectedError``, ``ClientOSError``: "Can not
write request body"), or a new one was refused. A read timeout (``ServerTimeoutError``) is
not one: the server had the request and said nothing."""


class Wire:
    """The HTTP sessions that reach the servers: ``pooled`` reuses connections (idle at most
    ``KEEPALIVE_S``; no cap on their number: a pause must never queue behind the streams it
    is meant to stop), ``fresh`` opens a new one per request."""

    def __init__(self, headers: dict[str, str]) -> None:
        timeout = aiohttp.ClientTimeout(total=None)
        self.pooled = aiohttp.ClientSession(headers=headers, timeout=timeout, connector=aiohttp.TCPConnector(
            limit=0, keepalive_timeout=KEEPALIVE_S))
        self.fresh = aiohttp.ClientSession(headers=headers, timeout=timeout, connector=aiohttp.TCPConnector(
            limit=0, force_close=True))
        self.resent = 0  # requests sent again on a fresh connection

    async def request(self, method: str, url: str, **kwargs: Any) -> aiohttp.ClientResponse:
        """``method url`` on a pooled connection; a request that never reached the server
        (``NEVER_ARRIVED``) is sent once more on a fresh connection. A server that is really
        gone fails that one too, and only then is it suspected (``Fleet.suspect``)."""
        try:
            return await self.pooled.request(method, url, **kwargs)
        except NEVER_ARRIVED as exc:
            if isinstance(exc, aiohttp.ServerTimeoutError):
                raise
        self.resent += 1
        return await self.fresh.request(method, url, **kwargs)

    async def close(self) -> None:
        await self.pooled.close()
        await self.fresh.close()


def completion_body(server: Server, prompt: list[int], sampling: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """The request body of one completion: token ids in, token ids and the sampled token's
    logprob out (``return_tokens_as_token_ids``, ``logprobs=0``), EOS left to the stop ids the
    caller gives, the request's own seed; the LoRA adapter loaded there named as the model."""
    body: dict[str, Any] = {
        "model": server.adapter or server.model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": True, "skip_special_tokens": False,
        "logprobs": 0, "return_tokens_as_token_ids": True, "stream": True, "n": 1}
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body


async def stream_completion(wire: Wire, server: Server, prompt: list[int],
                            sampling: SamplingParams, max_tokens: int, *, settings: RemoteConfig, stats: RemoteStats,
                            label: Callable[[], int]) -> tuple[list[int], list[float], list[int], FinishReason]:
    """One streamed ``POST /v1/completions`` to ``server``. Returns the tokens, their
    logprobs, their versions and the finish reason; raises ``ServerLost`` with what arrived
    (tokens without their logprobs yet are not kept: they may be sampled again elsewhere).

    Versions: ``serve-engine``'s own record says each token's; from a server that says none
    (``vllm serve``) a token carries ``label()`` as it arrives — the version the server was
    resumed on (``Server.serving``). A request that reached a paused server waits in its queue
    and runs after the resume on the new weights: labelled at the send, its tokens once
    carried the old version."""
    body = completion_body(server, prompt, sampling, max_tokens)
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    finish: str | None = None
    record: dict[str, Any] | None = None
    server.in_flight += 1
    server.requests += 1
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.control_timeout_s,
                                    sock_read=settings.request_timeout_s)
    try:
        async with await wire.request("POST", f"{server.url}/v1/completions", json=body,
                                      timeout=timeout) as response:
            if response.status != 200:
                message = _error_message(await response.text())
                if response.status >= 500:
                    raise ServerLost(f"POST /v1/completions answered {response.status}: {message}")
                if response.status == 404 and server.adapter is not None:  # restarted: it lost the adapter
                    raise ServerLost(f"POST /v1/completions does not know adapter {server.adapter} ({message})")
                raise ControlError(f"engine server {server.url}: POST /v1/completions refused "
                                   f"({response.status}): {message}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerLost(f"the stream ended in an error: {_error_message(json.dumps(chunk))}")
                for choice in chunk.get("choices") or []:
                    lp = choice.get("logprobs") or {}
                    new = [_token_id(t) for t in lp.get("tokens") or []]
                    stats.received += len(new)
                    values = lp.get("token_logprobs")
                    if values and len(values) == len(new):  # tokens without logprobs may be sampled again
                        tokens += new
                        logprobs += [float(v) for v in values]
                        versions += [label()] * len(new)
                    if choice.get("completion") is not None:
                        record = choice["completion"]
                    if choice.get("finish_reason") is not None:
                        finish = choice["finish_reason"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
        raise ServerLost(f"POST /v1/completions: {_describe(exc)}", tokens, logprobs, versions) from None
    except ServerLost as exc:
        raise ServerLost(exc.reason, tokens, logprobs, versions) from None
    finally:
        server.in_flight -= 1
    if finish is None:
        raise ServerLost("POST /v1/completions: the stream ended without a finish reason", tokens, logprobs,
                         versions)
    if finish not in _FINISH:
        raise ControlError(f"engine server {server.url}: a completion ended with finish reason {finish!r}")
    if record is not None:  # serve-engine's own record: its logprobs and the version of each token
        tokens, logprobs = list(record["token_ids"]), [float(v) for v in record["logprobs"]]
        versions = [int(v) for v in record["weight_versions"]]
    if len(logprobs) != len(tokens):
        raise ControlError(f"engine server {server.url}: {len(logprobs)} logprobs for {len(tokens)} tokens")
    return tokens, logprobs, versions, _FINISH[finish]
