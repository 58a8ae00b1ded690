"""One factory: the learner a config asks for, built from its row of the learner kinds table.

``build_learner`` reads ``cfg.learner_kind.builder`` (``asyncrl/config/learner_kinds.py``)
and calls it; each builder below knows its own kind's construction and nothing else. Every
kind comes back as a transport the one :class:`~asyncrl.runtime.transport.LearnerGroup`
drives, whose workers implement :class:`~asyncrl.runtime.protocol.LearnerRank`, so nothing
above this module asks which kind it has.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import Config, ConfigError
from asyncrl.core_budget import ThreadBudget
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.transport import InProcess, Transport


@dataclass
class LearnerRequest:
    """What the runtime hands the factory. ``model``/``tokenizer``: the policy already loaded
    in this process (a learner on a thread takes it over). ``num_threads``: the learner's
    share of the cores. ``thread_budget``: the cores it shares with the engine."""

    model: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    num_threads: int | None = None
    thread_budget: ThreadBudget | None = None


@dataclass
class BuiltLearner:
    """A learner's transport; ``local``: its rank when it lives in this process (the kind's
    ``model_here``), whose policy an engine here starts from."""

    transport: Transport
    local: LearnerWorker | None = None


def build_learner(cfg: Config, request: LearnerRequest) -> BuiltLearner:
    """The learner of ``cfg.learner_kind``, not yet started (its transport's ``start`` joins
    the ranks and loads the policy). A kind this environment cannot build is refused naming
    what to install."""
    kind = cfg.learner_kind
    if (missing := kind.missing()) is not None:
        raise ConfigError(missing)
    module, function = kind.builder.split(":")
    built: BuiltLearner = getattr(importlib.import_module(module), function)(cfg, request)
    return built


def build_in_process(cfg: Config, request: LearnerRequest) -> BuiltLearner:
    """One rank on a thread of this process. In ``sync`` beside an engine it can share a
    thread with, it will share the engine's thread; until then (joining, loading a
    checkpoint) it runs on a thread of its own with one torch thread, so that thread forms
    no OpenMP team that would stay beside the engine's (``runtime.one_torch_thread``)."""
    shares = cfg.mode == "sync" and cfg.engine_kind.colocatable
    worker = LearnerWorker(cfg, model=request.model, tokenizer=request.tokenizer,
                           num_threads=1 if shares else request.num_threads, thread_budget=request.thread_budget)
    return BuiltLearner(InProcess(worker), local=worker)


def build_rank_processes(cfg: Config, request: LearnerRequest) -> BuiltLearner:
    """``cfg.learner_processes`` rank processes of this machine; this process keeps the engine."""
    from asyncrl.runtime.rank_processes import RankProcesses

    ranks = cfg.learner_processes
    threads = max(1, (request.num_threads or torch.get_num_threads()) // ranks)
    return BuiltLearner(RankProcesses(cfg, world_size=ranks, num_threads=threads,
                                      thread_budget=request.thread_budget))


def build_ray_actors(cfg: Config, request: LearnerRequest) -> BuiltLearner:
    """``learner.world_size`` Ray actors (the cluster was started by the runtime)."""
    from asyncrl.runtime.ray_runtime import RayActors

    return BuiltLearner(RayActors(cfg))
