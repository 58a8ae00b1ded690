"""What the engines are sent, chosen once per run (``docs/scaling.md``, LoRA).

Four kinds, two types (``asyncrl/engine/protocol.py``):

- ``full``: every parameter, whole (a sharded learner gathers first) — :class:`FullWeights`;
- ``adapters``: LoRA's A, B and scale per targeted layer — :class:`AdapterUpdate`, which the
  engine merges onto its own base (``asyncrl/engine/adapters.py``). The default with
  ``model.lora`` wherever the engine takes it: the built-in engine, with the engine's
  weights in the learner's dtype (a rounded base would merge to other weights), and
  ``engine: remote``, whose servers load them as a PEFT adapter (vLLM's LoRA loading);
- ``merged``: each targeted layer's W + s·B·A — :class:`FullWeights` of those names only
  (the rest is the base the engine loaded from ``model.path``);
- ``merged_every_weight``: the same and the frozen rest too, for an engine that reloads
  whole models only (vLLM, and ``engine: remote`` with ``model.lora.sync=merged``, whose
  servers may be ``vllm serve``).

:func:`update_kind` makes the choice from the config; :func:`engine_update` and
:func:`engine_start` are the only places that act on it, so "where do adapters reach the
engine" is ``AdapterUpdate``: made in ``lora.adapter_update``, taken by
``TorchEngine.update_weights``.
"""

from __future__ import annotations

import copy
from typing import Literal, cast

import torch
from transformers import PreTrainedModel

from asyncrl.config import LoraConfig
from asyncrl.config.engine_kinds import engine_kind
from asyncrl.weight_updates import FullWeights, WeightUpdate
from asyncrl.learner.lora import adapter_update, base_copy, merged_copy, merged_targets, peft_model

UpdateKind = Literal["full", "merged", "merged_every_weight", "adapters"]


def update_kind(lora: LoraConfig | None, *, engine: str = "torch", same_dtype: bool = True) -> UpdateKind:
    """The run's kind of update. ``engine``: the ``engine:`` value, read through its row of
    the kinds table (``asyncrl/config/engine_kinds.py``: whether it takes adapters alone, merges them
    in its own dtype, takes a subset of the weights); ``same_dtype``: the engines' weights
    are in the learner's dtype (``rollout.dtype`` unset or equal to ``model.dtype``). An
    explicit ``model.lora.sync=adapters`` the engine cannot take is refused by the config."""
    if lora is None:
        return "full"
    kind = engine_kind(engine)
    # a kind that merges adapters itself does so in its own dtype: only when that is the learner's
    takes_adapters = "adapters" in kind.deliveries and (same_dtype or not kind.adapters_merged_locally)
    if lora.sync == "adapters" or (lora.sync == "auto" and takes_adapters):
        return "adapters"
    return "merged" if kind.partial_updates else "merged_every_weight"  # one that reloads every weight: all sent


def engine_update(module: torch.nn.Module, kind: UpdateKind) -> WeightUpdate:
    """What the engines load now, without a copy where there is one to read: ``full``, the
    parameters themselves (a sharded model's DTensors, global shapes); the LoRA kinds, new
    tensors (``module`` is then the ``PeftModel``)."""
    if kind == "adapters":
        return adapter_update(peft_model(module))
    if kind == "full":
        return FullWeights(dict(module.named_parameters()))
    return FullWeights(merged_targets(peft_model(module), every_weight=kind == "merged_every_weight"))


def engine_start(module: torch.nn.Module, kind: UpdateKind) -> PreTrainedModel:
    """A plain model for an engine in the learner's process, ``module`` untouched: the
    policy (a deep copy; the LoRA adapters merged), or for ``adapters`` the base alone,
    onto which the engine merges what it is sent."""
    if kind == "adapters":
        return base_copy(peft_model(module))
    if kind == "full":
        return cast(PreTrainedModel, copy.deepcopy(module))  # full: the Hugging Face model itself
    return merged_copy(peft_model(module))
