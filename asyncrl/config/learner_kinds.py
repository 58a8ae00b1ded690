"""The learner kinds: one typed table of where a run's learner runs and what it can do.

As with the engine kinds (``engine_kinds.py``), every caller that must treat learners
differently asks this table about a capability (does it train in this process? can it stream
a step, shard, reuse samples? where does its optimizer state live for a checkpoint?), never
which kind it has, and never a config field that happens to select one. Adding a kind is its
own module, a row here and its docs: the factory (``asyncrl/runtime/learner_factory.py``)
builds its transport from the row's ``builder``; the config's validation
(:func:`unsupported`), the runtime's start, resume compatibility and the run's banner read
the row.

It lives beside the config, which validates against it, and imports only the standard
library and the config's ground-floor constants: builders are named as ``module:function``
and imported only when a learner is built.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.config.tinker import TINKER_LORA_ALPHA

Placement = Literal["thread", "processes", "actors", "server"]
"""Where the learner computes: a thread of the trainer's process, rank processes of this
machine, Ray actors, or a server behind a URL (nothing of it computes here)."""

WeightsOut = Literal["tensors", "shared_memory", "object_store", "adapter_files"]
"""How a version's weights leave the learner for the engines: tensors in this process, one
shared-memory block from rank 0, Ray's object store, or adapter files downloaded from its
server."""

OptimizerHome = Literal["checkpoint", "server"]
"""Where the optimizer state lives for a checkpoint: written into the run's checkpoint, or
kept on the learner's server (the checkpoint holds its path there)."""


@dataclass(frozen=True)
class LearnerKind:
    """One kind of learner and its capabilities.

    Invariants: ``builder`` is ``module:function``, a function ``(cfg, LearnerRequest) ->
    Transport`` (``asyncrl/runtime/learner_factory.py``); ``losses`` None means every
    registered policy loss; ``lora_alpha`` is set only where ``weights`` is adapters alone."""

    name: str
    summary: str
    placement: Placement
    weights: frozenset[Literal["full", "adapters"]]
    """What it trains: every weight, LoRA adapters, or either."""
    weights_out: WeightsOut
    optimizer_state: OptimizerHome
    builder: str
    streams: bool = True
    """It can take a step in parts as groups land (``learner.streaming``)."""
    shards: bool = False
    """It can train as ``learner.world_size`` > 1 ranks."""
    sample_reuse: bool = True
    """Several optimizer steps a batch (``optim.ppo_epochs``, ``optim.mini_batches``)."""
    decoupled_ratio: bool = True
    """It recomputes π_prox (decoupled PPO); False: its losses take the ratio against μ only
    (``algorithm.bypass: true``)."""
    kl_reference: bool = True
    """It holds a KL reference (``algorithm.kl_coef`` > 0)."""
    token_masks: bool = True
    """It applies the engine–learner token masks (``algorithm.is_mask``)."""
    critic: bool = True
    """It trains a critic beside the policy (``critic``, ``algorithm.advantage: gae``)."""
    losses: tuple[str, ...] | None = None
    aggregations: tuple[str, ...] | None = None
    lora_alpha: float | None = None
    """A fixed LoRA scale (alpha) where the learner sets it, not the config."""
    lora_dropout: bool = True
    runtimes: frozenset[str] = frozenset({"local"})
    weight_sync: frozenset[str] = frozenset({"object_store", "collective"})
    needs: str | None = None
    """A module this environment must have to build it; ``install``: what and how, as said."""
    install: str = ""

    @property
    def trains_here(self) -> bool:
        """Its computation is on this machine (it shares the cores with the engines)."""
        return self.placement != "server"

    @property
    def model_here(self) -> bool:
        """Its policy lives in the trainer's own process: an in-process engine starts from a
        copy of it rather than loading ``model.path`` again."""
        return self.placement == "thread"

    def missing(self) -> str | None:
        """Why this environment cannot build the kind (None: it can)."""
        if self.needs is not None and importlib.util.find_spec(self.needs) is None:
            return f"the {self.name} learner needs {self.install}"
        return None


LEARNER_KINDS: dict[str, LearnerKind] = {
    "thread": LearnerKind(
        name="thread", summary="one rank on a thread of the trainer's process",
        placement="thread", weights=frozenset({"full", "adapters"}), weights_out="tensors",
        optimizer_state="checkpoint", builder="asyncrl.runtime.learner_factory:build_in_process"),
    "processes": LearnerKind(
        name="processes", summary="learner.world_size rank processes of this machine (one with learner.process)",
        placement="processes", weights=frozenset({"full", "adapters"}), weights_out="shared_memory",
        optimizer_state="checkpoint", shards=True,
        builder="asyncrl.runtime.learner_factory:build_rank_processes"),
    "ray": LearnerKind(
        name="ray", summary="learner.world_size Ray actors (runtime: ray)",
        placement="actors", weights=frozenset({"full", "adapters"}), weights_out="object_store",
        optimizer_state="checkpoint", shards=True, runtimes=frozenset({"ray"}),
        builder="asyncrl.runtime.learner_factory:build_ray_actors", needs="ray", install="Ray: pip install ray"),
    "tinker": LearnerKind(
        name="tinker", summary="a Tinker-API server at learner.url (asyncrl serve-tinker, or Tinker's service)",
        placement="server", weights=frozenset({"adapters"}), weights_out="adapter_files",
        optimizer_state="server", streams=False, sample_reuse=False, decoupled_ratio=False,
        kl_reference=False, token_masks=False, critic=False, losses=("decoupled_ppo", "cispo"),
        aggregations=("token_mean",), lora_alpha=TINKER_LORA_ALPHA, lora_dropout=False,
        weight_sync=frozenset({"object_store"}),
        builder="asyncrl.runtime.tinker_learner:build", needs="tinker", install="Tinker's SDK: pip install tinker"),
}
"""Every learner kind, by name (docs/config.md lists them)."""


def select_learner_kind(*, url: str | None, runtime: str, processes: int) -> LearnerKind:
    """The kind a run's learner is: behind ``learner.url`` when one is set, Ray actors on
    ``runtime: ray``, rank processes when the run gives the learner ``processes`` of its own,
    else a thread of the trainer's process. The one place the config's fields pick a row."""
    if url is not None:
        return LEARNER_KINDS["tinker"]
    if runtime == "ray":
        return LEARNER_KINDS["ray"]
    return LEARNER_KINDS["processes" if processes else "thread"]


def unsupported(kind: LearnerKind, cfg: Any) -> dict[str, tuple[Any, str]]:
    """What ``cfg`` asks of a learner that ``kind`` cannot do: key → (its value, what the kind
    needs). Empty when the kind does everything asked. ``cfg`` is the run's ``Config``."""
    a, o, lora, learner = cfg.algorithm, cfg.optim, cfg.model.lora, cfg.learner
    adapters_only = kind.weights == frozenset({"adapters"})
    checks: dict[str, tuple[bool, Any, str]] = {
        "model.lora": (adapters_only and lora is None, None, "true: this learner trains adapters"),
        "model.lora.alpha": (kind.lora_alpha is not None and lora is not None and lora.alpha != kind.lora_alpha,
                             getattr(lora, "alpha", None),
                             f"{kind.lora_alpha:g}: its LoRA takes a rank, its scale is alpha/rank"
                             if kind.lora_alpha is not None else ""),
        "model.lora.dropout": (not kind.lora_dropout and lora is not None and lora.dropout > 0,
                               getattr(lora, "dropout", None), "0: its LoRA has no dropout"),
        "algorithm.policy_loss": (kind.losses is not None and a.policy_loss not in kind.losses, a.policy_loss,
                                  " or ".join(kind.losses or ())),
        "algorithm.bypass": (not kind.decoupled_ratio and not a.bypass, a.bypass,
                             "true: the ratio against μ, as its losses take it"),
        "algorithm.aggregation": (kind.aggregations is not None and a.aggregation not in kind.aggregations,
                                  a.aggregation, " or ".join(kind.aggregations or ())),
        "algorithm.kl_coef": (not kind.kl_reference and a.kl_coef > 0, a.kl_coef, "0"),
        "algorithm.advantage": (not kind.critic and cfg.critic is not None, a.advantage,
                                "a group-relative estimator: it trains no critic"),
        "algorithm.is_mask": (not kind.token_masks and a.is_mask != "none", a.is_mask, "none"),
        "optim.ppo_epochs": (not kind.sample_reuse and o.ppo_epochs != 1, o.ppo_epochs, "1"),
        "optim.mini_batches": (not kind.sample_reuse and o.mini_batches != 1, o.mini_batches, "1"),
        "learner.streaming": (not kind.streams and learner.streaming, True, "false"),
        "learner.world_size": (not kind.shards and learner.world_size != 1, learner.world_size, "1"),
        "runtime": (cfg.runtime not in kind.runtimes, cfg.runtime, " or ".join(sorted(kind.runtimes))),
        "weight_sync.method": (cfg.weight_sync.method not in kind.weight_sync, cfg.weight_sync.method,
                               " or ".join(sorted(kind.weight_sync))),
        "engine": (adapters_only and "adapters" not in cfg.engine_kind.deliveries, cfg.engine,
                   "a kind that takes adapters"),
        "model.lora.sync": (adapters_only and lora is not None and lora.sync == "merged",
                            getattr(lora, "sync", None), "auto or adapters"),
    }
    return {key: (value, need) for key, (bad, value, need) in checks.items() if bad}


def learner_kind(name: str) -> LearnerKind:
    """The row of ``name``; ``ValueError`` naming the kinds there are."""
    try:
        return LEARNER_KINDS[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a learner kind: one of {', '.join(LEARNER_KINDS)}") from None
