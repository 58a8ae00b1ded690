"""What a learner sends the engines at a weight sync, typed: :class:`FullWeights` (whole
tensors under the model's own parameter names) or :class:`AdapterUpdate` (LoRA's A, B and
scale per targeted layer, merged by the engine onto its own base) — :data:`WeightUpdate`.

A module of its own, on the ground floor, because both sides speak it and neither owns it:
the learner chooses one kind once per run (``asyncrl/learner/export.py``), the weight sync
carries it (flat, through :func:`flatten_update`, where a transport moves flat tensors), and
an engine dispatches on its type (``RolloutEngine.update_weights``). A sharded learner
gathers before it sends and merged LoRA sends the merged layers, so both are
:class:`FullWeights` (whole tensors; a subset of the names is a valid update).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class FullWeights(Mapping[str, torch.Tensor]):
    """Whole tensors (never shards) under the model's own parameter names, read as a
    mapping: every parameter (full fine-tuning; a sharded learner's, gathered), or some of
    them (LoRA merged: each targeted layer's W + s·B·A; the rest is the base the engine
    already holds). An engine copies each into the parameter of that name."""

    tensors: Mapping[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class LayerAdapter:
    """One targeted layer's LoRA: ΔW = scale · B @ A. a: (r, in), b: (out, r);
    ``transposed``: the base stores the layer (in, out) (GPT-2's Conv1D), so ΔW is too."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    transposed: bool = False


@dataclass(frozen=True)
class AdapterUpdate:
    """LoRA adapters alone (``model.lora.sync``: ``adapters``, the default where the engine
    takes them): each targeted layer's :class:`LayerAdapter` under its base parameter's name
    (``model.layers.0.self_attn.q_proj.weight``); r × (in + out) numbers a layer instead of
    out × in. The engine merges W_base + scale · B @ A onto its own copy of the base
    (``asyncrl/engine/adapters.py``), every time from the base, never from a previous merge.
    ``rank`` and ``alpha`` are the run's ``model.lora`` (scale = alpha / rank), for an
    engine that loads adapters as a PEFT directory."""

    layers: Mapping[str, LayerAdapter]
    rank: int
    alpha: float

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.a, layer.b))


WeightUpdate = FullWeights | AdapterUpdate
"""What ``RolloutEngine.update_weights`` takes: the learner's choice of what is sent."""


def as_update(update: WeightUpdate | Mapping[str, torch.Tensor]) -> WeightUpdate:
    """``update``, a plain name → tensor mapping read as :class:`FullWeights` (what callers
    passed before the update was typed)."""
    if isinstance(update, (FullWeights, AdapterUpdate)):
        return update
    if isinstance(update, Mapping):
        return FullWeights(update)
    raise TypeError(f"update_weights takes FullWeights or AdapterUpdate (asyncrl.weight_updates), not "
                    f"{type(update).__name__}")


def flatten_update(update: WeightUpdate) -> tuple[Any, dict[str, torch.Tensor]]:
    """``update`` as (a small picklable header, flat name → tensor) for a transport that
    moves flat tensors (the collective's buckets, a shared-memory block);
    :func:`unflatten_update` is its inverse. The header says the kind, so nothing is read
    from the names."""
    if isinstance(update, FullWeights):
        return ("full",), dict(update.tensors)
    names = list(update.layers)
    header = ("adapters", update.rank, update.alpha,
              tuple((name, layer.scale, layer.transposed) for name, layer in update.layers.items()))
    tensors = {f"{i}.a": update.layers[name].a for i, name in enumerate(names)}
    tensors |= {f"{i}.b": update.layers[name].b for i, name in enumerate(names)}
    return header, tensors


def unflatten_update(header: Any, tensors: Mapping[str, torch.Tensor]) -> WeightUpdate:
    """The update :func:`flatten_update` made ``(header, tensors)`` of."""
    if header[0] == "full":
        return FullWeights(dict(tensors))
    _, rank, alpha, layers = header
    return AdapterUpdate({name: LayerAdapter(tensors[f"{i}.a"], tensors[f"{i}.b"], scale, transposed)
                          for i, (name, scale, transposed) in enumerate(layers)}, rank=rank, alpha=alpha)
