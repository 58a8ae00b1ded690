"""The policy: where its weights are, its dtype and device, and LoRA adapters on it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from asyncrl.config.base import Section


class LoraConfig(Section):
    """LoRA adapters on the policy (``model.lora``; ``docs/scaling.md``, LoRA): the learner trains
    only low-rank adapters (through ``peft``), ΔW = B·A·``alpha``/``rank`` on each targeted
    linear layer, the base weights frozen; the KL reference is the base with the adapters
    off. ``model.lora=true`` takes every default."""

    rank: int = Field(16, ge=1)
    """r: the adapters' inner dimension (A is r × in, B is out × r)."""
    alpha: float = Field(32.0, gt=0)
    """The adapters' scale is ``alpha / rank`` (peft's ``lora_alpha``)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on an adapter's input while training (peft's ``lora_dropout``); 0 keeps the
    learner's π_prox recompute and the engine's merged weights the same function."""
    target_modules: list[str] | str = "all-linear"
    """Which linear layers get adapters: names (or name suffixes) of modules, e.g.
    ``[q_proj, v_proj]``, or ``all-linear`` (every linear layer but the LM head: the
    attention and MLP projections). Names that match no module exit 2 naming those the
    model has."""
    sync: Literal["auto", "merged", "adapters"] = "auto"
    """What a weight sync sends: ``adapters``, A, B and the scale alone (r × (in + out)
    numbers a layer), which the built-in engine merges into its own copy of the base, bit for
    bit the merged weights (``asyncrl/engine/adapters.py``), and ``engine: remote``'s servers
    load as a PEFT adapter (vLLM's ``/v1/load_lora_adapter``; not ``engine: vllm``);
    ``merged``, each targeted layer's W + s·B·A (out × in; any engine); ``auto``, adapters
    where the engine takes them (``engine: torch`` with ``rollout.dtype`` the weights', and
    ``engine: remote``), else merged (``asyncrl/learner/export.py`` decides, once)."""


class ModelConfig(Section):
    path: str = "models/countdown-tiny"
    """A Hugging Face model directory (causal LM + tokenizer)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The weights' dtype as loaded: the learner's (its master weights and AdamW state) and,
    unless ``rollout.dtype`` says otherwise, the engines'. Keep ``float32`` to train: bf16
    weights lose updates smaller than 1/256 of a weight; for bf16 compute set
    ``learner.autocast`` and ``rollout.dtype`` instead (docs/results.md, "Precision")."""
    device: str = "auto"
    """``auto`` = CUDA when available, else CPU."""
    lora: LoraConfig | None = None
    """LoRA adapters (a ``LoraConfig`` section: ``rank``, ``alpha``, ``dropout``,
    ``target_modules``, ``sync``), or ``null``: full fine-tuning. ``model.lora.rank=4`` or
    ``model.lora=true`` turns them on. One learner rank only (``learner.world_size=1``)."""

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_switch(cls, value: Any) -> Any:
        return ({} if value else None) if isinstance(value, bool) else value  # `model.lora=true`
