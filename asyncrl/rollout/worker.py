"""A rollout worker: one engine replica and the workflows that drive it.

For ``runtime: local`` the trainer holds ``rollout.num_workers`` in its own process; for
``runtime: ray`` each is the body of a Ray actor (``ray_runtime.py``); the one rollout
handle over them is ``rollout_group.py``. Either way the orchestrator asks
it for whole groups, evaluations and weight updates; the staleness gate stays with the
orchestrator and every token's version is stamped by the engine inside the worker.

Every episode, training or evaluation, takes a slot of one semaphore
(``rollout.max_concurrent_episodes``): that is the load a service behind the workflow
sees from this worker. Blocking user code of those episodes (a synchronous agent, a
reward function) runs on the worker's own pool of daemon threads of the same size
(``asyncrl/threads.py``), closed with the worker: a call that hangs past its timeout is
abandoned there, counted, and never keeps the process from exiting.

Every episode samples with its own seed (``asyncrl/seeding.py``), from the run's seed and
the episode's coordinates, so which worker runs it, next to what, and when, changes none
of its tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.rollout.client import LLMClient, stop_token_ids, takes_sink
from asyncrl.config import Config, ConfigError
from asyncrl.engine.factory import EngineRequest, build_engine
from asyncrl.engine.protocol import RolloutEngine, TokenSink
from asyncrl.weight_updates import WeightUpdate, as_update
from asyncrl.frozen.client import close_open_clients
from asyncrl.rollout.eval_scoring import EvalResult, evaluate
from asyncrl.rollout.gateway import Gateway
from asyncrl.rollout.gateway.tool_calls import resolve_format
from asyncrl.rollout.journal import EpisodeKey, Journal
from asyncrl.policy import check_policy
from asyncrl.seeding import Purpose, episode_seed
from asyncrl.tasks.base import Task
from asyncrl.core_budget import ThreadBudget
from asyncrl.threads import UserThreads
from asyncrl.types import Completion, Episode, SamplingParams
from asyncrl.rollout.workflows.base import run_episode
from asyncrl.rollout.workflows.registry import build_workflow

GATEWAY_COUNTS = ("tool_parse_errors", "sampling_overrides")
ENGINE_COUNTS = {"decode_steps": "steps", "prefills": "prefills", "prefill_rows": "prefill_rows",
                 "prefill_tokens": "prefill_tokens", "prefill_reused": "prefill_reused", "tokens": "tokens",
                 "prefill_s": "prefill_s", "decode_positions": "decode_positions"}
"""``engine_work``'s counts (and the prefill steps' seconds), by the engine stats' field."""
REPLAY_COUNTS = ("replayed_episodes", "replayed_tokens", "replay_diverged")
EPISODE_TIMES = ("episode_lead_s", "episode_tail_s", "timed_episodes")
"""Training episodes' own seconds before their first engine call and outside their engine
calls after it (workflow, tokenizing, reward, tools), and how many: ``asyncrl plan`` adds
them around each simulated generation."""
CHECKPOINT_ABORT_WAIT_S = 5.0
"""At most this long ``in_flight`` waits for the sequences it aborted to reach their journals."""


class RolloutWorker:
    def __init__(self, cfg: Config, *, model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, weights: WeightUpdate | None = None,
                 version: int = 0, seed: int = 0, num_threads: int | None = None, eval_replica: bool = False,
                 thread_budget: ThreadBudget | None = None) -> None:
        """``model``/``tokenizer`` given: use them (in-process). Otherwise load them from
        ``model.path`` here, in the worker's own process. ``weights``: the latest published,
        loaded over ``model.path``'s. ``eval_replica``: a second engine for evaluation beside
        training (torch engine only). ``thread_budget``: the cores the training engine shares
        with the learner (``rollout.thread_sharing``; not the replica's). The engines
        themselves are built by :meth:`start`."""
        if tokenizer is None:
            tokenizer = check_policy(cfg.model)
        self.cfg, self.tokenizer = cfg, tokenizer
        self._model, self._weights, self._version = model, weights, version
        self._seed, self._num_threads, self._eval_replica = seed, num_threads, eval_replica
        self.thread_budget = thread_budget
        self.workflow = build_workflow(cfg)
        s, e = cfg.sampling, cfg.eval
        self.sampling = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                       top_k=s.top_k, stop_token_ids=stop_token_ids(tokenizer))
        self.eval_sampling = SamplingParams(max_tokens=s.max_tokens, temperature=e.temperature, top_p=s.top_p,
                                            top_k=s.top_k, stop_token_ids=self.sampling.stop_token_ids)
        self.slots = asyncio.Semaphore(cfg.rollout.max_concurrent_episodes)
        self.user_threads = UserThreads(cfg.rollout.max_concurrent_episodes)  # blocking agents, reward functions
        self.engine: RolloutEngine | None = None
        self.gateway: Gateway | None = None  # for openai_agent: the sessions its agents talk to
        self.eval_engine: RolloutEngine | None = None  # the replica that background evaluation uses
        self._eval_lock = asyncio.Lock()  # one evaluation at a time holds the replica's weights
        self._ready = asyncio.Event()
        self._start_error: BaseException | None = None
        self.journals: dict[EpisodeKey, Journal] = {}  # training episodes under way: what a checkpoint keeps
        self.replay_counts = dict.fromkeys(REPLAY_COUNTS, 0)
        self.drain_s = 0.0  # weight syncs' waits for running sequences to finish (partial_rollout=off)
        self.load_s: float | None = None  # the last weight sync's load on the engine (None: none yet)
        self.episode_times = dict.fromkeys(EPISODE_TIMES, 0.0)
        self.attached: dict[str, Any] = {}  # what ``apply`` installed (a weight receiver); closed by shutdown

    async def start(self) -> None:
        """Build the engine (vLLM starts its own processes, hence async and separate). A
        failure here is raised to every call that waits for the engine, not just this one."""
        try:
            await self._build_engines()
            if self.cfg.workflow.name == "openai_agent":  # a gateway on a free local port, for this worker's agents
                self.gateway = Gateway(self.tokenizer, resolve_format(self.cfg.gateway.tool_parser, self.tokenizer),
                                       model_name=self.cfg.model.path, settings=self.cfg.gateway)
                await self.gateway.start("127.0.0.1", 0)
                self.workflow = build_workflow(self.cfg, gateway=self.gateway)
        except BaseException as exc:
            self._start_error = exc
            raise
        finally:
            self._model = self._weights = None  # the engines hold what they need
            self._ready.set()

    async def _build_engines(self) -> None:
        """The configured kind of engine, through the one factory (``asyncrl/engine/factory.py``);
        weights published while it started (a sync may come meanwhile) are applied after."""
        request = EngineRequest(seed=self._seed, version=self._version, model=self._model, weights=self._weights,
                                num_threads=self._num_threads, eval_replica=self._eval_replica,
                                thread_budget=self.thread_budget, tokenizer=self.tokenizer)
        built = await build_engine(self.cfg, request)
        self.engine, self.eval_engine = built.engine, built.eval_engine
        applied = request.weights
        while self._weights is not None and self._weights is not applied:  # newer ones may come meanwhile
            applied = self._weights
            await self.engine.update_weights(as_update(applied), self._version)

    async def ready_engine(self) -> RolloutEngine:
        """The engine once started (raises what stopped it from starting)."""
        await self._ready.wait()
        if isinstance(self._start_error, ConfigError):  # the user's to fix, said as such (exit 2)
            raise self._start_error
        if self._start_error is not None:
            raise RuntimeError(f"the rollout engine failed to start: {self._start_error!r}") from self._start_error
        return self.engine

    async def gateway_counts(self) -> dict[str, int]:
        """The gateway's counts; ``user_threads_abandoned``: calls of blocking user code
        given up on (timed out) while their thread was still in it; and what replaying
        episodes from a checkpoint took from it (``replayed_episodes``, ``replayed_tokens``)
        and where a workflow asked for something else (``replay_diverged``)."""
        counts = self.gateway.counts if self.gateway is not None else {}
        return {**{k: counts.get(k, 0) for k in GATEWAY_COUNTS},
                "user_threads_abandoned": self.user_threads.abandoned_total, **self.replay_counts}

    async def engine_work(self) -> dict[str, float]:
        """The engine's busy seconds and step counts (``RolloutHandle.engine_work``); 0 while it starts."""
        if not self._ready.is_set() or self.engine is None:
            return {"busy_s": 0.0}
        stats = self.engine.stats
        counts = stats.counts()  # what this kind of engine counts of its own work
        return {"busy_s": stats.busy_s, "drain_s": self.drain_s, **self.episode_times,
                **{name: counts[field] for name, field in ENGINE_COUNTS.items() if field in counts},
                **(self.thread_budget.counters() if self.thread_budget is not None else {})}

    async def engine_fleet(self) -> dict[str, float | str]:
        """``RolloutHandle.engine_fleet``: with ``engine: remote``, the servers as the client
        sees them (``RemoteEngine.fleet``) and ``weight_load_s``, the seconds the last weight
        sync's load took across them (the weights written once, every server's load); else {}."""
        if not self._ready.is_set() or not self.engine.kind.fleet:
            return {}
        fleet = self.engine.fleet()  # a fleet kind's engine reports its servers
        return fleet if self.load_s is None else {**fleet, "weight_load_s": self.load_s}

    async def _episode(self, task: Task, engine: RolloutEngine, sampling: SamplingParams, purpose: Purpose,
                       draw: int, sample: int, replay: dict[str, Any] | None = None,
                       keys: list[EpisodeKey] | None = None) -> Episode:
        """One episode. A training one (``keys`` given) keeps a journal of what it generates
        (:meth:`in_flight`), under a key added to ``keys`` for its group to drop when the
        whole group is done; ``replay`` (its journal from a checkpoint) is played back into
        the attempt it was recorded in."""
        w = self.cfg.workflow

        def journal(attempt: int) -> Journal:
            key = EpisodeKey(task.id, draw, sample, attempt)
            for old in [k for k in keys if k[:3] == key[:3]]:  # a failed attempt's record is of no use to a restart
                self._count_replay(self.journals.pop(old, None))
            keys.append(key)
            recorded = Journal.for_replay(replay) if replay is not None else None
            self.journals[key] = recorded if recorded is not None and recorded.key == key else Journal(key)
            return self.journals[key]

        async with self.slots:
            timed = _TimedEngine(engine)
            with self.user_threads.current():
                episode = await run_episode(
                    self.workflow, task, lambda: LLMClient(timed, self.tokenizer, sampling),
                    timeout_s=w.timeout_s, max_retries=w.max_retries,
                    seed=lambda attempt: episode_seed(self.cfg.seed, purpose, task.id, draw, sample, attempt),
                    journal=journal if keys is not None else None)
            if keys is not None and timed.first is not None:
                lead = timed.first - timed.start
                self.episode_times["episode_lead_s"] += lead
                self.episode_times["episode_tail_s"] += time.perf_counter() - timed.start - lead - timed.engine_s
                self.episode_times["timed_episodes"] += 1
            return episode

    def _count_replay(self, journal: Journal | None) -> None:
        if journal is None or not (journal.replayed_tokens or journal.diverged):
            return
        self.replay_counts["replayed_episodes"] += 1
        self.replay_counts["replayed_tokens"] += journal.replayed_tokens
        if journal.diverged:
            self.replay_counts["replay_diverged"] += 1
            if self.replay_counts["replay_diverged"] == 1:
                print(f"asyncrl: episode {tuple(journal.key)} replayed from a checkpoint asked for another context "
                      "than it had; it sampled afresh from there (a workflow that is not deterministic given the "
                      "model's replies; counted in rollout/replay_diverged_total)", file=sys.stderr)

    async def run_group(self, task: Task, n: int, draw: int = 0,
                        replay: Mapping[int, dict[str, Any]] | None = None) -> list[Episode]:
        """``n`` episodes of ``task``, in sample order; a failing episode comes back as an
        error episode. ``draw``: the train epoch the task was handed out in (its seeds).
        ``replay``: sample -> its journal from a checkpoint, to continue rather than redo."""
        engine = await self.ready_engine()
        replay, keys = replay or {}, []
        try:  # an episode's journal lives as long as its group: a restart re-issues the whole group
            return list(await asyncio.gather(*[
                self._episode(task, engine, self.sampling, "train", draw, i, replay.get(i), keys) for i in range(n)]))
        finally:
            for key in keys:
                self._count_replay(self.journals.pop(key, None))

    async def in_flight(self) -> list[dict[str, Any]]:
        """The journals of the training episodes under way (``Journal.to_dict``), for a
        checkpoint. Running sequences are aborted first, so that their tokens so far reach
        the journals; the clients resume them at once, as after a weight sync (sampling is
        seeded per position, so the tokens are those they would have sampled anyway)."""
        if not self._ready.is_set() or self.engine is None or not self.journals:
            return []
        journals = list(self.journals.values())
        returned = [j.calls_returned for j in journals]
        waiting = [not j.parked for j in journals]
        aborted = await self.engine.pause("abort")
        try:
            deadline = time.monotonic() + CHECKPOINT_ABORT_WAIT_S
            while time.monotonic() < deadline:
                back = sum(w and j.calls_returned > r for j, r, w in zip(journals, returned, waiting))
                if back >= (aborted if aborted is not None else sum(waiting)):
                    break
                await asyncio.sleep(0.001)
            return [j.to_dict() for j in self.journals.values()]
        finally:
            await self.engine.resume()

    async def evaluate(self, tasks: list[Task], version: int, weights: WeightUpdate | None = None,
                       on_episode: Callable[[Episode], None] | None = None) -> EvalResult:
        """Score ``tasks`` on ``version``: on the evaluation replica, loading ``weights``
        first when given, else on the rollout engine (which must serve ``version``). Beside
        training (on the replica) it holds at most half of the episode slots, so training's
        episodes always find the other half rather than waiting out a slow evaluation."""
        engine = await self.ready_engine()
        async with self._eval_lock:
            if self.eval_engine is not None:
                engine = self.eval_engine
                if weights is not None:
                    await engine.update_weights(weights, version)
            if engine.version != version:
                raise RuntimeError(f"asked to evaluate version {version}, but the engine serves {engine.version}")
            slots = self.cfg.rollout.max_concurrent_episodes
            result = await evaluate(lambda task, i: self._episode(task, engine, self.eval_sampling, "eval", 0, i),
                                    tasks, indexed=True, samples_per_task=self.cfg.eval.samples_per_task,
                                    max_concurrent=max(1, slots // 2) if self.eval_engine is not None else slots,
                                    success_threshold=self.cfg.eval.success_threshold, on_episode=on_episode)
        check_pinned(result.episodes, version)
        return result

    async def sync_weights(self, weights: WeightUpdate, version: int, mode: str) -> list[int]:
        """Load ``weights`` as ``version``. What happens to generation under way:
        ``continue``: it goes on with the new weights (in-flight update); ``abort``: it
        returns now and the client resumes it with prompt + partial tokens; ``off``: it
        finishes on the old weights first. Returns ``[the version the engine serves]``."""
        if not self._ready.is_set():  # still starting: it loads these when it is up
            self._weights, self._version = weights, version
            return [version]
        engine = await self.ready_engine()
        if mode != "continue":
            start = time.perf_counter()
            await engine.pause("abort" if mode == "abort" else "wait")
            if mode != "abort":  # the wait, apart from the load: a plan simulates the two apart
                self.drain_s += time.perf_counter() - start
        start = time.perf_counter()
        await engine.update_weights(weights, version)
        self.load_s = time.perf_counter() - start
        if mode != "continue":
            await engine.resume()
        return [engine.version]

    async def apply(self, fn: Callable[..., Any], *args: Any, index: int = 0) -> list[Any]:
        """``[fn(self, index, *args)]``, awaited when it returns an awaitable: how weight
        sync installs its receiver here (``index``: this worker's place among them)."""
        result = fn(self, index, *args)
        return [await result if inspect.isawaitable(result) else result]

    async def shutdown(self) -> None:
        self.user_threads.close()  # threads stuck in user code are daemons: not waited for
        for thing in reversed(list(self.attached.values())):
            thing.close()
        self.attached.clear()
        if self.gateway is not None:
            await self.gateway.stop()
        await close_open_clients()  # a judge's session (inside the workflow's reward function)
        for engine in (self.engine, self.eval_engine):
            if engine is not None:
                await engine.shutdown()


def check_pinned(episodes: list[Episode], version: int) -> None:
    """Every token an evaluation scored was sampled at the ``version`` it evaluates, or it
    raises naming the versions found: evaluation's own engine is sent weights only by the
    evaluation holding it (``_eval_lock``), so a token of another version means something
    else sent its servers weights meanwhile (another trainer on ``eval.urls``), and the
    score would mix two policies."""
    other = sorted({v for e in episodes for t in e.trajectories for v, m in zip(t.versions, t.loss_mask)
                    if m and v != version})
    if other:
        raise RuntimeError(f"the evaluation of version {version} got tokens sampled at version(s) {other}: its "
                           "engine served other weights meanwhile. eval.urls must be servers no other trainer "
                           "sends weights to")


class _TimedEngine:
    """The engine as one episode's clients see it, their calls timed: the episode's own
    seconds around them are the rollout side's cost, which ``asyncrl plan`` simulates."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.start = time.perf_counter()
        self.first: float | None = None  # the first call's start
        self.engine_s = 0.0  # in calls, the engine's queue included

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       on_tokens: TokenSink | None = None) -> Completion:
        """Streams (``on_tokens``) when the engine does: an agent's streamed reply in a
        training session arrives token by token, as on plain ``/v1``."""
        start = time.perf_counter()
        if self.first is None:
            self.first = start
        try:
            if on_tokens is None:
                return await self.engine.generate(prompt_ids, sampling)
            if takes_sink(self.engine):
                return await self.engine.generate(prompt_ids, sampling, on_tokens=on_tokens)
            completion = await self.engine.generate(prompt_ids, sampling)
            on_tokens(list(completion.token_ids))  # an engine that does not stream: all at once, as promised
            return completion
        finally:
            self.engine_s += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

