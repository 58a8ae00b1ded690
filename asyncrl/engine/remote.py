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
requests in flight. A request that never reached its server (a reset, a keep-alive connection
the server closed, a refused connect) is sent once more on a fresh connection
(``remote_wire.Wire``); a stream our own pause cut (vLLM ends it with no finish reason) is a
paused request. A request that fails otherwise (connection lost, ``503``, nothing received
for ``remote.request_timeout_s``) makes its server a suspect: lost only when its ``/health``
fails too (or it answers but one request failed there ``FAILURES_LIMIT`` times), then named
on stderr and left out; the request is sent again from the tokens received with their
logprobs. A lost server's ``/health`` is polled and, when it answers again, it gets the
current weights and version and is used again. With no server
left, requests raise ``EngineClosedError`` naming each one and why it was lost (the run
stops, exit 1). Every control call has a deadline (``remote.control_timeout_s``; a weight
load ``remote.weight_load_timeout_s``) and a failure says which server, which call, and how
long it waited.

Where each concern lives: this module is the engine contract (generate, pause, resume,
update, versions); ``remote_fleet.py`` the servers, routing, control calls and losses;
``remote_weights.py`` how weights reach the servers; ``remote_wire.py`` the requests'
wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

import torch

from asyncrl.config import RemoteConfig
from asyncrl.engine.protocol import EngineClosedError, PauseMode, PromptTooLongError, TokenSink, WeightUpdate, as_update
from asyncrl.engine.remote_fleet import Fleet
from asyncrl.engine.remote_nccl import WeightBroadcast
from asyncrl.engine.remote_weights import ADAPTER_PREFIX, FleetWeights
from asyncrl.engine.remote_wire import (VLLM_SERVE_OWNER, ControlError, RemoteStats, Server, ServerLost,
                                        ServersUnusable, stream_completion)
from asyncrl.model_untie import model_path_ties_head
from asyncrl.types import Completion, FinishReason, SamplingParams
from asyncrl.config.engine_kinds import ENGINE_KINDS, EngineKind

__all__ = ["ADAPTER_PREFIX", "ControlError", "EngineClosedError", "RemoteEngine", "ServerLost", "ServersUnusable"]

FAILURES_LIMIT = 3
"""Failures of one request on a server that still answers ``/health`` before that server is
lost anyway: it answers, but does not serve."""
TOKENIZER_PROBES = ("The quick brown fox jumps over 13 lazy dogs.", "def f(x):\n    return x**2  # é",
                    "2+3=5")
"""Texts a server must tokenize as the trainer does (``/tokenize``) to be used."""
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts that are this machine."""


class RemoteEngine:
    """``StreamingEngine`` over the servers at ``settings.urls``. Build it with
    ``await RemoteEngine.connect(settings, version=…)``. ``broadcast``: what moves the
    tensors with ``remote.weight_transfer=nccl`` (``remote_weights.FleetWeights``)."""

    kind: ClassVar[EngineKind] = ENGINE_KINDS["remote"]  # what it can do: the kinds table's row

    def __init__(self, settings: RemoteConfig, *, version: int = 0, broadcast: WeightBroadcast | None = None,
                 fresh: bool = False, tokenizer: Any = None, model_path: str = "", key: str = "remote.urls") -> None:
        self.settings, self._fresh, self._tokenizer, self._model_path = settings, fresh, tokenizer, model_path
        self.stats = RemoteStats()
        self._fleet = Fleet(settings, self.stats, key=key)
        self.weights = FleetWeights(self._fleet, settings, broadcast)
        self._version = version
        self._open = asyncio.Event()  # set: requests may be sent
        self._open.set()
        self._pauses = 0  # pauses so far; _modes[k]: the mode of the k-th
        self._modes: dict[int, PauseMode] = {}
        self._paused = False
        self._control = asyncio.Lock()  # pause, resume, update and a revival, one at a time
        self._in_flight = 0
        self._watch: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def connect(cls, settings: RemoteConfig, *, version: int = 0, broadcast: WeightBroadcast | None = None,
                      fresh: bool = False, tokenizer: Any = None, model_path: str = "",
                      key: str = "remote.urls") -> RemoteEngine:
        """Wait (up to ``remote.control_timeout_s``) for every server to answer ``/health``
        (nothing listening: ``ServersUnusable``, exit 2, within seconds), read its model card,
        check it tokenizes as ``tokenizer`` does (another model: ``ServersUnusable`` naming
        both), unload the adapters a previous trainer left (``lora-v<n>``: the trainer sends
        its own), label it ``version`` and resume it (a trainer that died during a sync
        leaves its servers paused). ``fresh``: a run from ``model_path``'s own weights, which
        no update will replace before the first sample — a server whose label says it serves
        another version (a previous run's) reloads its model's own weights first. ``key``: the
        config key that lists these servers, as the refusals name it (``eval.urls`` for
        evaluation's own)."""
        engine = cls(settings, version=version, broadcast=broadcast, fresh=fresh, tokenizer=tokenizer,
                     model_path=model_path, key=key)
        try:
            await engine._start()
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    async def _start(self) -> None:
        self._fleet.open()
        self.weights.weights_dir.mkdir(parents=True, exist_ok=True)

        async def ready(server: Server) -> None:
            await self._fleet.wait_healthy(server)
            adapters = await self._fleet.read_card(server)
            self._refuse_tied_head_on_cpu(server)
            if self._tokenizer is not None:
                await self._check_tokenizer(server)
            for name in sorted(adapters):  # a previous trainer's adapters: the base again
                if re.fullmatch(rf"{ADAPTER_PREFIX}\d+", name):
                    await self._call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, missing_ok=True)
            if self._fresh:
                await self._serve_base(server)
            await self._call(server, "POST", "/update_weight_version", {"new_version": str(self._version)})
            server.version = server.serving = self._version
            await self._call(server, "POST", "/resume")  # a trainer that died mid-sync may have left it paused
            server.usable = True

        await asyncio.gather(*[ready(s) for s in self.servers])
        self._watch = asyncio.create_task(self._fleet.watch_lost(self._revive, lambda: self._closed),
                                          name="asyncrl-remote-health")

    def _refuse_tied_head_on_cpu(self, server: Server) -> None:
        """``vllm serve`` on this machine, which has no CUDA device (so vLLM's CPU build),
        and a model whose LM head is tied to its embeddings: that build computes the head
        from a packed copy a reload over HTTP does not refresh, so every sync would leave
        the servers on the old head (docs/vllm.md). Refused at connect, naming the head and
        the copy to serve instead (``asyncrl models untie``). A server elsewhere may be a
        GPU's, which has no packed copy: there the delivery check names the head if it fails."""
        on_this_cpu = (urlsplit(server.url).hostname or "") in LOOPBACK and not torch.cuda.is_available()
        if server.owner != VLLM_SERVE_OWNER or not on_this_cpu or not model_path_ties_head(self._model_path):
            return
        raise ServersUnusable(
            f"{self._fleet.key}: engine server {server.url} is vLLM's CPU build (vllm serve on this machine, which has "
            f"no CUDA device) and model.path {self._model_path!r} ties its LM head to its input embeddings "
            "(tie_word_embeddings): that build keeps a packed copy of a tied head that a reload over HTTP does not "
            "refresh, so the servers would sample from the old head after every sync. Untie it once, `asyncrl models "
            f"untie {self._model_path}`, then start the servers on the copy it prints (--model DIR) and set model.path "
            "to it; or serve with asyncrl serve-engine")

    async def _check_tokenizer(self, server: Server) -> None:
        """The server tokenizes the probe texts as this trainer's tokenizer does, or it serves
        another model (its token ids would mean other words here): refused at connect."""
        for text in TOKENIZER_PROBES:
            ours = self._tokenizer.encode(text, add_special_tokens=False)
            try:
                reply = await self._call(server, "POST", "/tokenize", {"model": server.model, "prompt": text,
                                                                       "add_special_tokens": False}, missing_ok=True)
            except ControlError:  # no tokenizer there (vllm serve --skip-tokenizer-init): nothing to compare
                reply = None
            if reply is None:
                return  # the delivery check (weight_sync.check_every) still compares what it serves
            theirs = reply.get("tokens") if isinstance(reply, dict) else None
            if theirs != ours:
                raise ServersUnusable(
                    f"{self._fleet.key}: engine server {server.url} serves {server.model!r}, which tokenizes "
                    f"{text!r} as {str(theirs)[:60]}; this trainer's model.path {self._model_path!r} as "
                    f"{str(ours)[:60]}. Start the servers on model.path's model (vllm serve --model DIR; asyncrl "
                    "serve-engine with the same model.path), or set model.path to theirs")

    async def _serve_base(self, server: Server) -> None:
        """A fresh run's server that a previous run left on its weights (its label names
        another version) reloads its model's own weights from the directory its model card
        names (``root``), said on stderr. Not ``reload_weights`` with no path: vLLM reads that
        as the last path it loaded, a previous run's weights."""
        info = await self._call(server, "GET", "/weight_info", missing_ok=True)
        label = info.get("weight_version") if isinstance(info, dict) else None
        if label in (None, "", str(self._version)):
            return
        label = str(label)
        if not server.root:
            raise ServersUnusable(f"{self._fleet.key}: engine server {server.url} serves weights labelled {label!r} "
                                  "and its model card names no directory (root) to reload its own weights from: "
                                  "restart it" + (", or resume the run that left it (resume=true)"
                                                  if label.isdigit() else ""))
        await self._call(server, "POST", "/collective_rpc",
                         {"method": "reload_weights", "kwargs": {"weights_path": server.root}},
                         timeout=self.settings.weight_load_timeout_s, knob="remote.weight_load_timeout_s")
        await self._call(server, "POST", "/reset_prefix_cache", missing_ok=True)
        served = (f"served version {label} (a previous run's weights)" if label.isdigit() else
                  f"had its weights labelled {label!r}, a label no asyncrl run sets (never trained by one)")
        print(f"asyncrl: engine server {server.url} {served}: reloaded {server.model}'s own weights for this fresh "
              "run", file=sys.stderr, flush=True)

    @property
    def servers(self) -> list[Server]:
        return self._fleet.servers

    async def _call(self, server: Server, method: str, path: str, body: dict | None = None, **kw: object) -> object:
        """A control call to one server (``Fleet.call``)."""
        return await self._fleet.call(server, method, path, body, **kw)  # type: ignore[arg-type]

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def queue_state(self) -> None:
        """Its queue is the servers' own (``RolloutEngine.queue_state``)."""
        return None

    @property
    def max_context(self) -> int:
        """The smallest context of the servers: a request must fit wherever it is re-issued."""
        return self._fleet.max_context

    max_model_len = max_context  # the name this client had (vLLM's word for it)

    def fleet(self) -> dict[str, float | str]:
        """The fleet as this client sees it now, for a step's row (``Fleet.describe``)."""
        return self._fleet.describe()

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
            failures = 0  # this request's failures on a server that still answered /health
            while True:
                await self._open.wait()
                server = self._fleet.pick(key)
                started_in = self._pauses  # a pause after this one is what aborts this request
                reason = ""
                try:
                    new, new_logprobs, new_versions, finish = await self._complete(
                        server, prompt_ids + tokens, sampling, budget - len(tokens))
                except ServerLost as lost:
                    new, new_logprobs, new_versions, finish, reason = (lost.tokens, lost.logprobs, lost.versions,
                                                                       None, lost.reason)
                asked = self._modes.get(started_in + 1)  # the pause that ended it, if one did
                if finish is None and asked in ("abort", "keep"):
                    finish = "abort"  # our own pause cut its stream (vLLM ends it with no finish reason)
                elif finish == "abort" and asked is None:  # no pause of ours: the server is going down?
                    finish, reason = None, "it aborted a request no pause asked to abort (shutting down?)"
                tokens += new
                logprobs += new_logprobs
                versions += new_versions
                if on_tokens is not None and new:
                    on_tokens(list(new))
                if finish is None:  # failed: sent again from the tokens so far
                    if len(tokens) >= budget:
                        return Completion(tokens, logprobs, versions, "length")
                    failures = await self._failed(server, reason, failures, len(tokens))
                    continue
                self.stats.tokens += len(new)
                if finish == "abort" and asked == "keep" and len(tokens) < budget:
                    continue  # held: sent again once the client resumes
                return Completion(tokens, logprobs, versions, finish)
        finally:
            self._in_flight -= 1
            self._update_busy()

    async def _failed(self, server: Server, reason: str, failures: int, carried: int) -> int:
        """A request to ``server`` failed (``reason``) with ``carried`` tokens received: the
        server is lost when its ``/health`` fails too (``Fleet.suspect``), or when it answers
        but this request failed there ``FAILURES_LIMIT`` times; the request is sent again
        either way. Returns the request's count of failures on a server that answered."""
        if not await self._fleet.suspect(server, reason):
            failures += 1
            if failures < FAILURES_LIMIT:
                return failures
            self._fleet.lose(server, f"{reason}; {failures} times for one request, though GET /health answers")
        self.stats.reissued_requests += 1  # sent again elsewhere, carrying every token received so far
        self.stats.reissued_tokens += carried
        return 0

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
                budget = max(min(sampling.max_tokens, server.max_model_len - len(prompt)), 1)
                for attempt in range(2):  # once more where the server still answers /health
                    try:
                        tokens, logprobs, versions, finish = await self._complete(server, list(prompt), sampling,
                                                                                  budget)
                        break
                    except ServerLost as exc:
                        reason = f"during the delivery probe: {exc.reason}"
                        if attempt or await self._fleet.suspect(server, reason):
                            self._fleet.lose(server, reason)
                            return None
                done.append(Completion(tokens, logprobs, versions, finish))
            return f"engine server {server.url}", done

        probed = await asyncio.gather(*[one(s) for s in self.servers if s.usable])
        return [p for p in probed if p is not None]

    async def _complete(self, server: Server, prompt: list[int], sampling: SamplingParams,
                        max_tokens: int) -> tuple[list[int], list[float], list[int], FinishReason]:
        def label() -> int:  # the version the server was resumed on, when a token arrives
            return server.serving if server.serving is not None else self._version

        return await stream_completion(self._fleet.live(), server, prompt, sampling, max_tokens,
                                       settings=self.settings, stats=self.stats, label=label)

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
            await self._fleet.fan_out("POST", f"/pause?mode={query}", timeout=timeout)
        return None

    async def resume(self) -> None:
        async with self._control:
            for server in self._fleet.usable():  # from the resume on, its tokens come from what it was sent
                server.serving = server.version
            await self._fleet.fan_out("POST", "/resume")
            self._paused = False
            self._open.set()
            self._update_busy()

    async def update_weights(self, update: WeightUpdate | Mapping[str, torch.Tensor], version: int) -> None:
        """Deliver ``update`` to every server while all are paused (paused here, ``keep``,
        unless the caller paused them) and label it ``version``: full weights through files
        or NCCL (``remote.weight_transfer``), LoRA adapters alone through vLLM's LoRA loading
        (``remote_weights.py``). What is written is written before the pause: a shorter
        stall. A run sends one kind."""
        deliver = await self.weights.prepare(as_update(update), version)
        paused_here = not self._paused
        try:
            if paused_here:
                await self.pause("keep")
            async with self._control:
                await deliver
                self._version = version
                self._fleet.forget_prefixes()  # prefix caches were dropped with the old weights
        finally:
            deliver.close()  # never awaited when the pause failed
            if paused_here:
                await self.resume()

    async def _revive(self, server: Server) -> None:
        """A lost server that answers again: paused, brought to the current weights and
        version, resumed unless the fleet is paused, used again."""
        self.weights.check_revivable(server)
        async with self._control:
            await self._call(server, "POST", "/pause?mode=abort")
            loaded = await self._fleet.read_card(server)
            await self.weights.bring_back(server, self._version, loaded)
            server.version = self._version
            if not self._paused:
                server.serving = server.version
                await self._call(server, "POST", "/resume")
            server.version, server.usable, server.lost_reason = self._version, True, None
        print(f"asyncrl: engine server {server.url} is back, on version {self._version}; used again",
              file=sys.stderr, flush=True)

    async def shutdown(self) -> None:
        """Closes this client (the servers are the user's: they keep running; an NCCL group's
        servers leave it, so a later trainer can form its own)."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.weights.close()
        await self._fleet.close()

    def _update_busy(self) -> None:
        self.stats.set_busy(self._in_flight > 0 and not self._paused)
