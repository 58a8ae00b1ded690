"""Where the parts run — chosen here, in :func:`start`, and nowhere else.

The orchestrator gets a :class:`Runtime`: a :class:`LearnerHandle` and a
:class:`RolloutHandle` (``protocol.py``). The learner is always one
:class:`~asyncrl.runtime.transport.LearnerGroup` of ``learner.world_size`` worker ranks
(``learner_worker.py``) over a transport: in this process (``InProcess``), as rank
processes beside it (``rank_processes.py``: ``learner.world_size`` > 1, or one rank with
``learner.process``, by default on the CPU in every mode but ``sync``), or as Ray actors
(``ray_runtime.py``). The rollout side is likewise one
:class:`~asyncrl.runtime.rollout_group.RolloutGroup` of :class:`RolloutWorker` instances over a
transport: ``rollout.num_workers`` in this process, each engine decoding on its own
thread, or ``ray.num_rollout_workers`` actors.
``start`` owns their whole lifecycle — Ray's own included — so leaving its ``async
with`` releases all.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import Config
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.runtime.learner_factory import BuiltLearner, LearnerRequest, build_learner
from asyncrl.runtime.protocol import LearnerHandle, RolloutHandle, Weights
from asyncrl.runtime.rollout_group import InProcessRollouts, RolloutGroup, RolloutTransport
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.runtime.transport import CallDeadlines, InProcess, LearnerGroup, Transport
from asyncrl.seeding import rollout_worker_seed
from asyncrl.core_budget import WHOLE_WHEN_ALONE, CoreBudget, ThreadBudget
from asyncrl.weight_sync import WeightSync, open_weight_sync

__all__ = ["LearnerHandle", "RolloutHandle", "Runtime", "RuntimeStarter", "Weights", "WeightSync", "start"]


@dataclass
class Runtime:
    learner: LearnerHandle | None  # None when only scoring (``asyncrl eval``)
    rollout: RolloutHandle
    weight_sync: WeightSync | None = None  # how the learner's weights reach the engines; None without a learner

    def training(self) -> tuple[LearnerHandle, RolloutHandle, WeightSync]:
        """The learner, rollout and weight sync of a training run's runtime, which has all three."""
        if self.learner is None or self.weight_sync is None:
            raise RuntimeError("this runtime has no learner to train with (started with train=False)")
        return self.learner, self.rollout, self.weight_sync


class RuntimeStarter(Protocol):
    """:func:`start`'s signature: what a trainer is given to start its runtime with."""

    def __call__(self, cfg: Config, *, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase,
                 train: bool = True, checkpoint: Path | None = None,
                 version: int = 0) -> AbstractAsyncContextManager[Runtime]: ...


def learner_processes(cfg: Config) -> int:
    """How many processes of its own the learner of a ``runtime: local`` run has
    (``Config.learner_processes``, which the learner kinds' selection reads)."""
    return cfg.learner_processes


def _thread_split(cfg: Config, train: bool = True) -> tuple[int, int | None]:
    """torch threads for (engine, learner) in one process: when both compute at once
    (every mode but ``sync``), half the cores each, unless the config says otherwise.
    ``train`` false (``asyncrl eval``): no learner, and the engine every core.

    Always a number for the engine, never "leave it": the engine's thread is made after
    the event loop's thread went to one torch thread (:func:`one_torch_thread`), and a new
    thread left alone decodes on one core, however many there are (the run that showed it:
    docs/design.md, "Measurements behind choices in the code")."""
    cores = torch.get_num_threads() or 2
    if not train or not cfg.learner_kind.trains_here:  # no learner computing here (behind a URL, say)
        return cfg.rollout.num_threads or cores, None
    half = max(1, cores // 2)
    shared = cfg.mode != "sync"
    return (cfg.rollout.num_threads or (half if shared else cores),
            cfg.rollout.learner_threads or (half if shared else cores))


def _thread_budget(cfg: Config, engine_threads: int, learner_threads: int) -> ThreadBudget | None:
    """``rollout.thread_sharing: colocated`` (or ``colocated_learner``) where both sides
    compute at once: the budget the engine and the learner hand the cores through, the
    split being what ``split`` would give each, and a side alone taking both shares (never
    more threads than the split runs at once, whatever the calling thread's own count).
    ``sync`` needs none: its one thread already has every core."""
    if cfg.rollout.thread_sharing == "split" or cfg.mode == "sync":
        return None
    cores = engine_threads + learner_threads
    if cfg.rollout.thread_sharing == "turns":  # the engine computes only while the learner is idle
        return ThreadBudget(CoreBudget(cores=cores, engine=0, learner=cores, whole=WHOLE_WHEN_ALONE["turns"]))
    return ThreadBudget(CoreBudget(cores=cores, engine=engine_threads, learner=learner_threads,
                                   whole=WHOLE_WHEN_ALONE[cfg.rollout.thread_sharing]))


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """The calling thread computes with one torch thread inside, as it was after.

    torch's intra-op threads are an OpenMP team per OS thread that ever ran a parallel op,
    and libgomp, once the process holds more team threads than cores, stops spinning and
    puts every team's threads to sleep between ops. A thread with a team of two that merely
    exists (idle) slows the learner's step and the engine's decode (the figure is in
    docs/history.md, "one torch thread on the event loop"). So the event loop's thread,
    which only orchestrates, loads and copies with one thread and never forms a team; the
    engine's and the learner's threads set their own counts (:func:`_thread_split`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@asynccontextmanager
async def start(cfg: Config, *, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase,
                train: bool = True, checkpoint: Path | None = None, version: int = 0) -> AsyncIterator[Runtime]:
    """Start the runtime ``cfg.runtime`` names. ``train``: a learner too (resumed from
    ``checkpoint`` when given, at ``version``), else rollout workers only. ``model``: the
    policy already loaded in this process (``None`` where the workers load their own).
    Whatever was started is shut down on the way out, also when starting fails."""
    eval_replica = train and cfg.background_eval
    engine_threads, learner_threads = _thread_split(cfg, train)
    budget = _thread_budget(cfg, engine_threads, learner_threads) if train and learner_threads else None
    async with AsyncExitStack() as stack:  # callbacks run in reverse: rollout, learner, Ray
        if budget is not None:
            stack.callback(budget.close)
        stack.enter_context(one_torch_thread())
        learner: LearnerHandle | None = None
        weights = None
        if cfg.runtime == "ray":
            from asyncrl.runtime.ray_runtime import RayRollouts, start_ray, stop_ray

            stack.callback(stop_ray, start_ray(cfg))  # refuses a layout the cluster cannot place
        transport: Transport | None = None
        built: BuiltLearner | None = None
        if train:  # the learner kind's own builder (learner_factory.py): a thread, rank processes, actors, a URL
            built = build_learner(cfg, LearnerRequest(model, tokenizer, learner_threads, budget))
            transport = built.transport
        if transport is not None:
            w = cfg.watchdog
            learner = LearnerGroup(transport, CallDeadlines(w.learner_call_s, w.learner_call_factor,
                                                            w.learner_stop_grace_s))
            stack.push_async_callback(learner.shutdown)
            await transport.start()
            if checkpoint is not None:
                await learner.load_checkpoint(checkpoint)
            if built is not None and built.local is not None and built.local.learner is not None:
                model = built.local.learner.policy_copy()  # the engine's own copy of the weights
                if checkpoint is not None and (built.local.learner.update_kind == "adapters"
                                               or cfg.engine_kind.loads_model_path):
                    # adapters: that copy is the base, the engine merges them; a kind that loads
                    # model.path itself gets the checkpoint's weights before any sample
                    weights = await learner.publish()
            elif checkpoint is not None:
                weights = await learner.publish()
        rollout_transport: RolloutTransport
        if cfg.runtime == "ray":
            rollout_transport = RayRollouts(cfg, weights=weights, version=version, eval_replica=eval_replica)
        else:
            n = cfg.rollout.num_workers
            rollout_transport = InProcessRollouts([
                RolloutWorker(cfg, model=model if i == 0 or model is None else copy.deepcopy(model),
                              tokenizer=tokenizer, weights=weights, version=version,
                              seed=rollout_worker_seed(cfg.seed, i, version),
                              num_threads=max(1, engine_threads // n) if engine_threads else None,
                              eval_replica=eval_replica, thread_budget=budget) for i in range(n)])
        rollout: RolloutHandle = RolloutGroup(rollout_transport)
        stack.push_async_callback(rollout.shutdown)
        if isinstance(rollout_transport, InProcessRollouts):
            await rollout_transport.start()
            engine = rollout_transport.workers[0].engine
            local = built.local if built is not None else None
            if (cfg.mode == "sync" and local is not None and isinstance(transport, InProcess)
                    and isinstance(engine, TorchEngine) and n == 1):
                # the engine and the learner take turns: one thread for both, so one OpenMP team
                transport.share_thread(engine)
            if local is not None:
                local.num_threads = learner_threads  # the step's own threads from here on
        sync = None
        if learner is not None:  # weight_sync.method; a collective group is formed here and closed first
            sync = await open_weight_sync(cfg, learner, rollout)
            stack.push_async_callback(sync.close)
        yield Runtime(learner, rollout, sync)
