"""LoRA adapters shipped alone (an :class:`~asyncrl.engine.protocol.AdapterUpdate`, the
default with ``model.lora`` where the engine takes them): the built-in engine merges them
into its own copy of the targeted layers (``docs/scaling.md``, LoRA).

A sync then carries, per targeted layer (the base model's parameter name, e.g.
``model.layers.0.self_attn.q_proj.weight``), A (r × in), B (out × r) and the scale alpha / r
(and whether the base stores the layer transposed, GPT-2's Conv1D): r × (in + out) numbers
instead of out × in. The engine keeps the base of each targeted layer (a copy taken at its
first adapter load, when its weights are still the base: loaded from ``model.path``, and an
engine in the learner's process starts from the base too, ``Learner.policy_copy``) and loads
W = W_base + s·B·A computed by :func:`merged_weight`.

Token-exactness: the merge is the very function the learner's merged sync runs
(``asyncrl.learner.lora.merged_targets`` calls :func:`merged_weight` too), on the same
inputs: W_base is bit-identical to the learner's frozen base (both loaded from
``model.path``, never trained) and A, B, s are the learner's own. So on the same kind of
device the engine holds, bit for bit, the weights a merged sync would have sent it, and its
logprobs are the merged path's: equal to the learner's adapter forward within the float32
bound (1e-4), which the delivery check (``asyncrl/weight_sync/delivery.py``) verifies.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from asyncrl.engine.protocol import AdapterUpdate


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, *,
                  transposed: bool = False) -> torch.Tensor:
    """W_base + scale · B @ A, in ``base``'s dtype. base: (out, in), a: (r, in), b: (out, r);
    ``transposed``: base is stored (in, out) (GPT-2's Conv1D), so the delta is too. Summed
    in float32 and cast once, so a bf16 base is rounded once, not per term."""
    delta = b.float() @ a.float()  # (out, in)
    return (base.float() + scale * (delta.T if transposed else delta)).to(base.dtype)


class AdapterMerger:
    """One engine's base copies of the targeted layers, and the merge of what a sync sends."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    def merge(self, update: AdapterUpdate, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each layer of ``update`` merged, under the layer's own name. The base of a layer
        is copied from ``params`` the first time its adapters come (the engine's weights are
        the base until then). A layer the model does not have is a ``KeyError``."""
        out = {}
        for name, layer in update.layers.items():
            if name not in params:
                raise KeyError(f"update_weights got adapters for {name!r}, which the model does not have")
            base = self.base.get(name)
            if base is None:
                base = self.base[name] = params[name].detach().clone()
            out[name] = merged_weight(base, layer.a.to(base.device), layer.b.to(base.device), layer.scale,
                                      transposed=layer.transposed)
        return out
