"""``engine: remote``: the rollout engine contract kept over HTTP, against a fleet of servers
the user started (``asyncrl serve-engine``, or ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``),
all behind this one client.

Verb by verb (vLLM's HTTP API; ``asyncrl/rollout/engine_server.py`` serves the same):

* ``generate``: ``POST /v1/completions`` with ``prompt`` as token ids, ``stream``,
  ``logprobs=0``, ``return_tokens_as_token_ids``, ``stop_token_ids``, ``ignore_eos``, the
  request's ``seed``; ``max_tokens`` capped by the context each server reports
  (``GET /v1/models``: ``max_model_len``). The logprob contract (log softmax(logits / T)) is
  vLLM's ``--logprobs-mode processed_logprobs``, so top-k/top-p are refused, as with
  ``engine: vllm``.
* ``pause(mode)``: the client stops sending and ``POST /pause?mode=…`` goes to every server;
  ``resume``: ``POST /resume`` to every server, then the client sends again.
  ``abort`` hands the partial tokens back (finish reason ``abort``; the caller resumes them).
  ``keep`` is an abort the client resumes by itself after ``resume`` (prompt + tokens so far,
  the same seed): a sequence held over a weight update recomputes its KV cache on the new
  weights, as vLLM's own keep does when the update resets its prefix cache, and every HTTP
  request then runs on one version. ``wait`` drains on the servers (``mode=wait``).
* ``update_weights`` (every server paused: the client pauses them itself if the caller did
  not), one of three ways:

  - :class:`FullWeights`, ``remote.weight_transfer=files``: written once as safetensors to
    ``remote.weights_dir``; each server loads them with ``POST /collective_rpc``
    ``reload_weights(weights_path=…)``, drops its prefix cache (``POST /reset_prefix_cache``)
    and takes the new label (``POST /update_weight_version``);
  - :class:`FullWeights`, ``remote.weight_transfer=nccl``: vLLM's native weight transfer.
    Once, ``POST /init_weight_transfer_engine`` on every server with its rank offset in one
    NCCL group with this trainer (``asyncrl/engine/remote_nccl.py``); per sync
    ``POST /start_weight_update``, ``POST /update_weights`` (names, dtypes, shapes) while the
    trainer broadcasts the tensors, ``POST /finish_weight_update`` with the version,
    ``POST /reset_prefix_cache``; at shutdown ``POST /shutdown_weight_transfer_engine``. A
    server lost on the way breaks the group: the update fails naming it (and one that comes
    back is not used again: it is outside the group);
  - :class:`AdapterUpdate` (LoRA adapters alone): written once as a PEFT adapter directory
    ``remote.weights_dir/lora-v<version>``; each server ``POST /v1/load_lora_adapter``
    ``{"lora_name": "lora-v<version>", "lora_path": …}``, then
    ``POST /v1/unload_lora_adapter`` the previous one, then the label; from then on its
    requests name the adapter as their ``model``. ``vllm serve`` needs ``--enable-lora``
    (``--max-lora-rank`` ≥ the rank) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
* versions: a token's version is the weights that sampled it. ``serve-engine`` returns each
  token's version with the completion (its ``completion.weight_versions``); from a server
  that returns none (``vllm serve``) a request's tokens carry the version the client set on
  that server before sending it: versions change only while every server is paused, and a
  pause ends every request it finds running (abort and keep), or lets it finish (wait).

The fleet: a group's samples share a prompt, and requests with the same prompt go to the
same server (its prefix cache) while it is up; others to the server with the fewest
requests in flight. A server that fails (connection lost, ``503``, nothing received for
``remote.request_timeout_s``) is named on stderr, left out, and its requests are re-issued on
the others from the tokens received with their logprobs; its ``/health`` is polled and, when
it answers again, it gets the current weights and version and is used again. With no server
left, requests raise ``EngineClosedError`` naming each one and why it was lost (the run
stops, exit 1). Every control call has a deadline (``remote.control_timeout_s``; a weight
load ``remote.weight_load_timeout_s``) and a failure says which server, which call, and how
long it waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import torch

from asyncrl.config import RemoteConfig
from asyncrl.engine.protocol import (
    AdapterUpdate,
    EngineClosedError,
    PauseMode,
    PromptTooLongError,
    TokenSink,
    WeightUpdate,
    as_update,
)
from asyncrl.engine.remote_nccl import WeightBroadcast, free_port, local_address, update_info
from asyncrl.engine.remote_wire import (
    _FINISH,
    ControlError,
    RemoteStats,
    Server,
    ServerLost,
    _describe,
    _error_message,
    _token_id,
    _write_atomically,
    write_peft_adapter,
)
from asyncrl.threads import settle_threadsafe
from asyncrl.types import Completion, FinishReason, SamplingParams

ADAPTER_PREFIX = "lora-v"
"""The names this client gives the LoRA adapters it loads (``lora-v<version>``)."""
AFFINITY_SIZE = 4096
"""Prompts whose server the client remembers (their samples share its prefix cache)."""


class RemoteEngine:
    """``StreamingEngine`` over the servers at ``settings.urls``. Build it with
    ``await RemoteEngine.connect(settings, version=…)``. ``broadcast``: what moves the
    tensors with ``remote.weight_transfer=nccl`` (default: vLLM's own helpers, built at the
    first such update; a test passes another)."""

    def __init__(self, settings: RemoteConfig, *, version: int = 0,
                 broadcast: WeightBroadcast | None = None) -> None:
        if not settings.urls:
            raise ValueError("engine=remote needs remote.urls: the base URLs of the servers (http://host:port)")
        self.settings = settings
        self.servers = [Server(url.rstrip("/")) for url in settings.urls]
        self._version = version
        self._session: aiohttp.ClientSession | None = None
        self._open = asyncio.Event()  # set: requests may be sent
        self._open.set()
        self._pauses = 0  # pauses so far; _modes[k]: the mode of the k-th
        self._modes: dict[int, PauseMode] = {}
        self._paused = False
        self._control = asyncio.Lock()  # pause, resume, update and a revival, one at a time
        self._affinity: OrderedDict[tuple[int, ...], Server] = OrderedDict()
        self._in_flight = 0
        self._own_dir = settings.weights_dir is None
        self._weights_dir = Path(settings.weights_dir or tempfile.mkdtemp(prefix="asyncrl-weights-"))
        self._weights_file: Path | None = None  # the latest weights' directory: what a revived server loads
        self._adapter: tuple[str, Path] | None = None  # the latest LoRA adapter's name and directory
        self._broadcast = broadcast
        self._nccl_group: list[Server] | None = None  # the servers in the NCCL group, once it is formed
        self._watch: asyncio.Task[None] | None = None
        self._closed = False
        self.stats = RemoteStats()

    @classmethod
    async def connect(cls, settings: RemoteConfig, *, version: int = 0,
                      broadcast: WeightBroadcast | None = None) -> RemoteEngine:
        """Wait (up to ``remote.control_timeout_s``) for every server to answer ``/health``,
        read its model card, unload the adapters a previous trainer left (``lora-v<n>``: the
        trainer sends its own), label it ``version`` and resume it (a trainer that died
        during a sync leaves its servers paused)."""
        engine = cls(settings, version=version, broadcast=broadcast)
        try:
            await engine._start()
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    async def _start(self) -> None:
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        # no cap on connections: a pause must never queue behind the streams it is meant to stop
        self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                              connector=aiohttp.TCPConnector(limit=0))
        self._weights_dir.mkdir(parents=True, exist_ok=True)

        async def ready(server: Server) -> None:
            deadline = time.monotonic() + self.settings.control_timeout_s
            while True:
                try:
                    await self._call(server, "GET", "/health", timeout=min(5.0, self.settings.control_timeout_s))
                    break
                except ServerLost as exc:
                    if time.monotonic() > deadline:
                        raise EngineClosedError(
                            f"engine server {server.url} did not answer GET /health within "
                            f"{self.settings.control_timeout_s:g} s (remote.control_timeout_s): {exc.reason}. Start "
                            "it first (asyncrl serve-engine CONFIG, or vllm serve), then the trainer") from None
                    await asyncio.sleep(0.5)
            for name in sorted(await self._read_card(server)):  # a previous trainer's adapters: the base again
                if re.fullmatch(rf"{ADAPTER_PREFIX}\d+", name):
                    await self._call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, missing_ok=True)
            await self._call(server, "POST", "/update_weight_version", {"new_version": str(self._version)})
            await self._call(server, "POST", "/resume")  # a trainer that died mid-sync may have left it paused
            server.version, server.usable = self._version, True

        await asyncio.gather(*[ready(s) for s in self.servers])
        self._watch = asyncio.create_task(self._watch_lost(), name="asyncrl-remote-health")

    async def _read_card(self, server: Server) -> set[str]:
        """The base model's name and context; returns the LoRA adapters loaded there (the
        cards with a ``parent``, as vLLM lists them)."""
        cards = (await self._call(server, "GET", "/v1/models"))["data"]
        card = next((c for c in cards if not c.get("parent")), cards[0])
        server.model = card["id"]
        server.max_model_len = int(card.get("max_model_len") or 0)
        if server.max_model_len < 1:
            raise ControlError(f"engine server {server.url}: GET /v1/models gives no max_model_len for {server.model}")
        return {c["id"] for c in cards if c.get("parent")}

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def queue_state(self) -> None:
        """Its queue is the engine's own (``RolloutEngine.queue_state``)."""
        return None

    @property
    def max_context(self) -> int:
        """The smallest context of the servers: a request must fit wherever it is re-issued."""
        return min((s.max_model_len for s in self.servers if s.max_model_len), default=0)

    max_model_len = max_context  # the name this client had (vLLM's word for it)

    def fleet(self) -> dict[str, float | str]:
        """The fleet as this client sees it now, for a step's row (``remote/*``): servers up,
        losses so far and the servers lost (``lost_servers``: each URL, with ``×n`` when lost
        more than once), requests re-issued on another server and the tokens they carried."""
        return {"servers_up": sum(s.usable for s in self.servers), "servers_lost_total": self.stats.servers_lost,
                "reissued_requests_total": self.stats.reissued_requests,
                "reissued_tokens_total": self.stats.reissued_tokens,
                "lost_servers": ", ".join(url + (f" ×{n}" if n > 1 else "") for url, n in self.stats.lost.items())}

    # ----------------------------------------------------------------- generate
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       on_tokens: TokenSink | None = None) -> Completion:
        """``on_tokens`` gets tokens once their logprobs are in (a server's tokens without
        them may be sampled again elsewhere): from ``vllm serve`` as they stream, from
        ``serve-engine`` with each finished request."""
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if sampling.top_k or sampling.top_p < 1:
            raise ValueError("engine=remote cannot report logprobs before top-k/top-p truncation (vLLM renormalises "
                             "over the kept tokens); use top_k=0, top_p=1")
        context = self.max_context
        if len(prompt_ids) >= context:
            raise PromptTooLongError(len(prompt_ids), context)
        budget = min(sampling.max_tokens, context - len(prompt_ids))
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        key = tuple(prompt_ids)
        self._in_flight += 1
        self._update_busy()
        try:
            while True:
                await self._open.wait()
                server = self._pick(key)
                started_in = self._pauses  # a pause after this one is what aborts this request
                sent_version = server.version if server.version is not None else self._version
                try:
                    new, new_logprobs, new_versions, finish = await self._complete(
                        server, prompt_ids + tokens, sampling, budget - len(tokens))
                    asked = self._modes.get(started_in + 1)  # the pause that ended it, if one did
                    if finish == "abort" and asked is None:  # no pause of ours: the server is going down
                        raise ServerLost("it aborted a request no pause asked to abort (shutting down?)",
                                         new, new_logprobs)
                except ServerLost as lost:
                    self._lose(server, lost.reason)
                    tokens += lost.tokens
                    logprobs += lost.logprobs
                    versions += [sent_version] * len(lost.tokens)
                    if on_tokens is not None and lost.tokens:
                        on_tokens(list(lost.tokens))
                    if len(tokens) >= budget:
                        return Completion(tokens, logprobs, versions, "length")
                    self.stats.reissued_requests += 1  # sent again, carrying every token received so far
                    self.stats.reissued_tokens += len(tokens)
                    continue
                tokens += new
                logprobs += new_logprobs
                versions += new_versions if new_versions is not None else [sent_version] * len(new)
                self.stats.tokens += len(new)
                if on_tokens is not None and new:
                    on_tokens(list(new))
                if finish == "abort" and asked == "keep" and len(tokens) < budget:
                    continue  # held: sent again once the client resumes
                return Completion(tokens, logprobs, versions, finish)
        finally:
            self._in_flight -= 1
            self._update_busy()

    async def probe_each(self, prompts: list[list[int]],
                         sampling: SamplingParams) -> list[tuple[str, list[Completion]]]:
        """Each usable server's completions of ``prompts`` (one request each, sent to that
        server alone, naming its adapter as rollouts do): the delivery check's probe
        (``asyncrl/weight_sync/delivery.py``), per server. Versions are the ones the
        server stamps, or the label set there. A server lost meanwhile is left out, as for
        rollouts (it gets the current weights before it is used again)."""
        await self._open.wait()

        async def one(server: Server) -> tuple[str, list[Completion]] | None:
            done = []
            for prompt in prompts:
                sent_version = server.version if server.version is not None else self._version
                try:
                    budget = min(sampling.max_tokens, server.max_model_len - len(prompt))
                    tokens, logprobs, versions, finish = await self._complete(server, list(prompt), sampling,
                                                                              max(budget, 1))
                except ServerLost as exc:
                    self._lose(server, f"during the delivery probe: {exc.reason}")
                    return None
                done.append(Completion(tokens, logprobs, versions or [sent_version] * len(tokens), finish))
            return f"engine server {server.url}", done

        probed = await asyncio.gather(*[one(s) for s in self.servers if s.usable])
        return [p for p in probed if p is not None]

    def _pick(self, key: tuple[int, ...]) -> Server:
        usable = [s for s in self.servers if s.usable]
        if not usable:
            raise EngineClosedError("no engine server is left: " + "; ".join(
                f"{s.url} ({s.lost_reason or 'not connected'})" for s in self.servers)
                + ". Restart them (asyncrl serve-engine CONFIG, or vllm serve) and resume the run")
        server = self._affinity.get(key)
        if server is None or not server.usable:
            server = min(usable, key=lambda s: s.in_flight)
            self._affinity[key] = server
            if len(self._affinity) > AFFINITY_SIZE:
                self._affinity.popitem(last=False)
        else:
            self._affinity.move_to_end(key)
        return server

    async def _complete(self, server: Server, prompt: list[int], sampling: SamplingParams,
                        max_tokens: int) -> tuple[list[int], list[float], list[int] | None, FinishReason]:
        """One streamed request. Returns the tokens, their logprobs, their versions where the
        server gives them, and the finish reason; raises ``ServerLost`` with what arrived."""
        body: dict[str, Any] = {
            "model": server.adapter or server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": True, "skip_special_tokens": False,
            "logprobs": 0, "return_tokens_as_token_ids": True, "stream": True, "n": 1}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        tokens: list[int] = []
        logprobs: list[float] = []
        finish: str | None = None
        record: dict[str, Any] | None = None
        server.in_flight += 1
        server.requests += 1
        session = self._live()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.control_timeout_s,
                                        sock_read=self.settings.request_timeout_s)
        try:
            async with session.post(f"{server.url}/v1/completions", json=body, timeout=timeout) as response:
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
                        self.stats.received += len(new)
                        values = lp.get("token_logprobs")
                        if values and len(values) == len(new):  # tokens without logprobs may be sampled again
                            tokens += new
                            logprobs += [float(v) for v in values]
                        if choice.get("completion") is not None:
                            record = choice["completion"]
                        if choice.get("finish_reason") is not None:
                            finish = choice["finish_reason"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise ServerLost(f"POST /v1/completions: {_describe(exc)}", tokens, logprobs) from None
        except ServerLost as exc:
            raise ServerLost(exc.reason, tokens, logprobs) from None
        finally:
            server.in_flight -= 1
        if finish is None:
            raise ServerLost("POST /v1/completions: the stream ended without a finish reason", tokens, logprobs)
        if finish not in _FINISH:
            raise ControlError(f"engine server {server.url}: a completion ended with finish reason {finish!r}")
        versions = None
        if record is not None:  # serve-engine's own record: its logprobs and the version of each token
            tokens, logprobs = list(record["token_ids"]), [float(v) for v in record["logprobs"]]
            versions = [int(v) for v in record["weight_versions"]]
        if len(logprobs) != len(tokens):
            raise ControlError(f"engine server {server.url}: {len(logprobs)} logprobs for {len(tokens)} tokens")
        return tokens, logprobs, versions, _FINISH[finish]

    # ---------------------------------------------------------- control plane
    async def pause(self, mode: PauseMode = "keep") -> int | None:
        """Stop sending, then pause every server (``keep`` and ``abort``: ``mode=abort``
        there; ``wait``: ``mode=wait``, which returns once their requests finished).
        How many sequences an abort ended is the servers' to know: None."""
        async with self._control:
            self._pauses += 1
            self._modes[self._pauses] = mode
            self._paused = True
            self._open.clear()
            self._update_busy()
            query = "wait" if mode == "wait" else "abort"
            timeout = self.settings.request_timeout_s if mode == "wait" else self.settings.control_timeout_s
            await self._fan_out("POST", f"/pause?mode={query}", timeout=timeout)
        return None

    async def resume(self) -> None:
        async with self._control:
            await self._fan_out("POST", "/resume")
            self._paused = False
            self._open.set()
            self._update_busy()

    async def update_weights(self, update: WeightUpdate | Mapping[str, torch.Tensor], version: int) -> None:
        """Deliver ``update`` to every server while all are paused (paused here, ``keep``,
        unless the caller paused them) and label it ``version``: full weights through files
        or NCCL (``remote.weight_transfer``), LoRA adapters alone through vLLM's LoRA loading.
        What is written is written before the pause: a shorter stall. A run sends one kind."""
        update = as_update(update)
        if isinstance(update, AdapterUpdate):
            path = self._weights_dir / f"{ADAPTER_PREFIX}{version}"
            await asyncio.to_thread(write_peft_adapter, update, path)
            deliver = self._adapter_update(f"{ADAPTER_PREFIX}{version}", path, version)
        elif self.settings.weight_transfer == "nccl":
            tensors = [(name, t.detach()) for name, t in update.tensors.items()]
            deliver = self._nccl_update(tensors, version)
        else:
            path = self._weights_dir / f"v{version}"  # a directory: vLLM's reload_weights loads a checkpoint dir
            tensors_cpu = {name: t.detach().cpu().contiguous() for name, t in update.tensors.items()}
            await asyncio.to_thread(_write_atomically, tensors_cpu, path)
            deliver = self._files_update(path, version)
        paused_here = not self._paused
        try:
            if paused_here:
                await self.pause("keep")
            async with self._control:
                await deliver
                self._version = version
                self._affinity.clear()  # prefix caches were dropped with the old weights
        finally:
            deliver.close()  # never awaited when the pause failed
            if paused_here:
                await self.resume()

    async def _files_update(self, path: Path, version: int) -> None:
        await asyncio.gather(*[self._load(s, path, version) for s in self.servers if s.usable])
        old, self._weights_file = self._weights_file, path
        if old is not None and old != path:
            shutil.rmtree(old, ignore_errors=True)

    async def _load(self, server: Server, path: Path, version: int) -> None:
        """``reload_weights`` from ``path``, the prefix cache dropped, the label set; a server
        lost on the way is left out (it reloads when it comes back)."""
        try:
            await self._call(server, "POST", "/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
                             timeout=self.settings.weight_load_timeout_s, knob="remote.weight_load_timeout_s")
            await self._call(server, "POST", "/reset_prefix_cache", missing_ok=True)
            await self._call(server, "POST", "/update_weight_version", {"new_version": str(version)})
            server.version = version
        except ServerLost as exc:
            self._lose(server, exc.reason)

    async def _adapter_update(self, name: str, path: Path, version: int) -> None:
        await asyncio.gather(*[self._load_adapter(s, name, path, version) for s in self.servers if s.usable])
        old, self._adapter = self._adapter, (name, path)
        if old is not None and old[1] != path:
            shutil.rmtree(old[1], ignore_errors=True)

    async def _load_adapter(self, server: Server, name: str, path: Path, version: int,
                            loaded: set[str] | None = None) -> None:
        """``POST /v1/load_lora_adapter`` (unless ``loaded`` holds it already), the previous
        adapter unloaded, the label set; from then on the server's requests name ``name``.
        A refusal (any status but 503: vLLM answers a failed load with 500) is a
        ``ControlError``; a server lost on the way is left out (it loads when it comes back)."""
        try:
            if loaded is None or name not in loaded:
                await self._call(server, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                                 timeout=self.settings.weight_load_timeout_s, knob="remote.weight_load_timeout_s",
                                 refused_5xx=True)
            old = server.adapter
            server.adapter = name
            if old is not None and old != name and (loaded is None or old in loaded):
                await self._call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": old}, missing_ok=True)
            await self._call(server, "POST", "/update_weight_version", {"new_version": str(version)})
            server.version = version
        except ServerLost as exc:
            if not self._lose(server, exc.reason):  # a revival's: the caller's to handle
                raise

    async def _nccl_update(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """vLLM's weight transfer: start, receive while the trainer broadcasts, finish with
        the label, then the prefix cache dropped. Every server of the group must take part:
        any failure names the server and the call and fails the update."""
        group = await self._nccl_join()
        limit, knob = self.settings.weight_load_timeout_s, "remote.weight_load_timeout_s"
        await self._on_group(group, "POST", "/start_weight_update")
        receive = [self._nccl_call(s, "POST", "/update_weights", {"update_info": update_info(tensors)})
                   for s in group]
        await _all(*receive, self._on_thread(self._broadcaster().send, tensors, what="the trainer's NCCL broadcast",
                                             limit=limit, knob=knob))
        await self._on_group(group, "POST", "/finish_weight_update", {"weight_version": str(version)})
        for server in group:
            await self._nccl_call(server, "POST", "/reset_prefix_cache", missing_ok=True)
            server.version = version

    async def _nccl_join(self) -> list[Server]:
        """Once: the NCCL group of this trainer (rank 0) and every usable server's workers,
        each server at its rank offset (``GET /get_world_size``: its TP × PP × DP)."""
        if self._nccl_group is not None:
            return self._nccl_group
        group = [s for s in self.servers if s.usable]
        sizes = [int((await self._nccl_call(s, "GET", "/get_world_size"))["world_size"]) for s in group]
        address = self.settings.nccl_address or local_address(group[0].url)
        port = self.settings.nccl_port or free_port(address)
        world = 1 + sum(sizes)
        broadcast = self._broadcaster()
        offsets = [1 + sum(sizes[:i]) for i in range(len(group))]
        inits = [self._nccl_call(s, "POST", "/init_weight_transfer_engine",
                                 {"init_info": {"master_address": address, "master_port": port, "rank_offset": offset,
                                                "world_size": world, **broadcast.wire()}})
                 for s, offset in zip(group, offsets)]
        await _all(*inits, self._on_thread(broadcast.join, address, port, world,
                                           what=f"the trainer joining the NCCL group at {address}:{port}",
                                           limit=self.settings.weight_load_timeout_s,
                                           knob="remote.weight_load_timeout_s"))
        self._nccl_group = group
        return group

    def _broadcaster(self) -> WeightBroadcast:
        if self._broadcast is None:
            from asyncrl.engine.remote_nccl import VLLMBroadcast

            self._broadcast = VLLMBroadcast()
        return self._broadcast

    async def _on_group(self, group: list[Server], method: str, path: str, body: dict[str, Any] | None = None) -> None:
        await _all(*[self._nccl_call(s, method, path, body) for s in group])

    async def _nccl_call(self, server: Server, method: str, path: str, body: dict[str, Any] | None = None, *,
                         missing_ok: bool = False) -> Any:
        """A call of the NCCL choreography under ``remote.weight_load_timeout_s``; a lost
        server fails the update (the group cannot go on without its ranks)."""
        try:
            return await self._call(server, method, path, body, timeout=self.settings.weight_load_timeout_s,
                                    knob="remote.weight_load_timeout_s", missing_ok=missing_ok, refused_5xx=True)
        except ServerLost as exc:
            self._lose(server, exc.reason)
            server.revivable = False
            raise ControlError(f"engine server {server.url}: {exc.reason}, during NCCL weight transfer "
                               "(remote.weight_transfer=nccl): the transfer group needs every server it was formed "
                               "with; restart the servers and the run, or use remote.weight_transfer=files") from None

    async def _on_thread(self, fn: Any, *args: Any, what: str, limit: float, knob: str) -> Any:
        """``fn(*args)`` on a daemon thread of its own under ``limit``: a collective whose
        peers never come blocks it for good, and an abandoned daemon never holds the exit."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the caller
                result, error = None, exc
            settle_threadsafe(loop, future, result, error)

        threading.Thread(target=run, name="asyncrl-nccl", daemon=True).start()
        try:
            async with asyncio.timeout(limit):
                return await future
        except TimeoutError:
            raise ControlError(f"{what} did not finish within {limit:g} s ({knob})") from None
        except ControlError:
            raise
        except Exception as exc:
            raise ControlError(f"{what} failed: {_describe(exc)}") from exc

    async def _fan_out(self, method: str, path: str, timeout: float | None = None) -> None:
        async def one(server: Server) -> None:
            try:
                await self._call(server, method, path, timeout=timeout)
            except ServerLost as exc:
                self._lose(server, exc.reason)

        await asyncio.gather(*[one(s) for s in self.servers if s.usable])

    async def _call(self, server: Server, method: str, path: str, body: dict[str, Any] | None = None, *,
                    timeout: float | None = None, knob: str = "remote.control_timeout_s",
                    missing_ok: bool = False, refused_5xx: bool = False) -> Any:
        """One control call under its deadline; ``ServerLost`` when the server does not
        answer (in time), ``ControlError`` when it refuses (``refused_5xx``: a 5xx but 503
        too, for calls whose failure vLLM reports as 500). Returns the JSON answer, or its
        text where it is not JSON (vLLM's LoRA routes)."""
        limit = self.settings.control_timeout_s if timeout is None else timeout
        start = time.monotonic()
        try:
            async with asyncio.timeout(limit):
                async with self._live().request(method, f"{server.url}{path}", json=body) as response:
                    text = await response.text()
        except TimeoutError:
            raise ServerLost(f"{method} {path} did not answer within {limit:g} s ({knob})") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise ServerLost(f"{method} {path} after {time.monotonic() - start:.1f} s: {_describe(exc)}") from None
        if response.status == 404 and missing_ok:
            return None
        if response.status >= 500 and not (refused_5xx and response.status != 503):
            raise ServerLost(f"{method} {path} answered {response.status}: {_error_message(text)}")
        if response.status != 200:
            hint = (" (vllm serve needs VLLM_SERVER_DEV_MODE=1 for its RL routes)" if response.status == 404
                    else "")
            raise ControlError(f"engine server {server.url}: {method} {path} refused ({response.status}): "
                               f"{_error_message(text)}{hint}")
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text

    def _lose(self, server: Server, reason: str) -> bool:
        """Leave ``server`` out (said once per loss); True when it was in until now."""
        if not server.usable:
            return False
        server.usable, server.lost_reason = False, reason
        self.stats.servers_lost += 1
        self.stats.lost[server.url] = self.stats.lost.get(server.url, 0) + 1
        left = [s.url for s in self.servers if s.usable]
        print(f"asyncrl: engine server {server.url} lost ({reason}); its requests go to "
              + (", ".join(left) if left else "no other: none is left"), file=sys.stderr, flush=True)
        return True

    async def _watch_lost(self) -> None:
        """Poll lost servers' ``/health``; one that answers is brought to the current
        weights and version (and pause state) and used again."""
        while not self._closed:
            await asyncio.sleep(self.settings.health_interval_s)
            for server in [s for s in self.servers if not s.usable and s.revivable]:
                try:
                    await self._call(server, "GET", "/health", timeout=min(5.0, self.settings.control_timeout_s))
                except ServerLost:
                    continue  # still down
                try:
                    async with self._control:
                        await self._revive(server)
                except ServerLost:
                    continue
                except Exception as exc:  # it answers but cannot be brought back: said, tried again later
                    print(f"asyncrl: engine server {server.url} answers /health but could not be brought back: "
                          f"{_describe(exc)}", file=sys.stderr, flush=True)

    async def _revive(self, server: Server) -> None:
        if self._nccl_group is not None:  # outside the group: it could never be sent weights again
            server.revivable = False
            raise ControlError("it is outside the NCCL weight-transfer group formed at the first sync "
                               "(remote.weight_transfer=nccl), so it would serve stale weights: not used again")
        await self._call(server, "POST", "/pause?mode=abort")
        loaded = await self._read_card(server)
        info = await self._call(server, "GET", "/weight_info", missing_ok=True)
        served = info.get("weight_version") if isinstance(info, dict) else None
        if self._adapter is not None:  # a restarted server has no adapter: the current one loaded again
            await self._load_adapter(server, *self._adapter, self._version, loaded=loaded)
        elif served != str(self._version):
            if self._weights_file is not None:
                await self._call(server, "POST", "/collective_rpc",
                                 {"method": "reload_weights", "kwargs": {"weights_path": str(self._weights_file)}},
                                 timeout=self.settings.weight_load_timeout_s, knob="remote.weight_load_timeout_s")
                await self._call(server, "POST", "/reset_prefix_cache", missing_ok=True)
            await self._call(server, "POST", "/update_weight_version", {"new_version": str(self._version)})
        if not self._paused:
            await self._call(server, "POST", "/resume")
        server.version, server.usable, server.lost_reason = self._version, True, None
        print(f"asyncrl: engine server {server.url} is back, on version {self._version}; used again",
              file=sys.stderr, flush=True)

    async def shutdown(self) -> None:
        """Closes this client (the servers are the user's: they keep running; an NCCL group's
        servers are told to leave it, ``POST /shutdown_weight_transfer_engine``, so a later
        trainer can form its own)."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._nccl_group is not None and self._session is not None:
            async def leave(server: Server) -> None:
                with contextlib.suppress(ServerLost, ControlError):
                    await self._call(server, "POST", "/shutdown_weight_transfer_engine", missing_ok=True)

            await asyncio.gather(*[leave(s) for s in self._nccl_group if s.usable])
            self._nccl_group = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._broadcast is not None:
            self._broadcast.close()
        if self._own_dir:
            shutil.rmtree(self._weights_dir, ignore_errors=True)

    def _live(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineClosedError("the remote engine client is shut down")
        return self._session

    def _update_busy(self) -> None:
        self.stats.set_busy(self._in_flight > 0 and not self._paused)


async def _all(*calls: Any) -> None:
    """Await ``calls`` together; the first to fail cancels the others (a broken NCCL group
    leaves them waiting on peers) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
