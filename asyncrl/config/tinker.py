"""``asyncrl serve-tinker``: the Tinker API served over ``model.path`` (``asyncrl/tinker/``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config.base import Section


TINKER_LORA_ALPHA = 32.0
"""peft's ``lora_alpha`` of every Tinker LoRA client (scale alpha / rank): Tinker's LoRA takes a
rank, not an alpha, so ``serve-tinker`` uses this one and ``learner.url`` refuses another
``model.lora.alpha``. Here, on the ground floor, because the config's check reads it."""


class TinkerConfig(Section):
    """``asyncrl serve-tinker``: Tinker's training and sampling API (LoRA training clients on
    the served base models, sampling clients) for Tinker's own SDK (``docs/tinker.md``)."""

    host: str = "127.0.0.1"
    """Where it listens. Beyond loopback it needs ``api_key`` (exit 2 otherwise)."""
    port: int = Field(8200, ge=0, le=65535)
    """Its port (0 = any free port; the bound URL is printed)."""
    api_key: str | None = Field(None, min_length=1)
    """When set, every route but the health check wants the SDK's ``X-API-Key: <key>`` (its
    ``api_key=``), else 401. The SDK itself refuses a key that does not start with ``tml-``, so
    choose one that does. Unset (loopback only): any key the SDK sends is accepted."""
    base_model: str | None = Field(None, min_length=1)
    """The name the SDK asks for (``create_lora_training_client(base_model=...)``, e.g.
    ``smollm2-135m-instruct``); ``None``: ``model.path`` as written. The default base: a
    sampling client that names none samples it."""
    models: dict[str, str] = {}
    """More base models served beside ``model.path``: the name the SDK asks for → the model's
    path or ``asyncrl models`` name (loaded with ``model``'s other settings). Each has its own
    sampling engine (memory: its weights twice, as the default's); a training client trains on
    the base its create names, and a state it saves records that base."""
    recompute_layers: bool | Literal["auto"] = "auto"
    """Whether a training call keeps only each decoder layer's input for the backward and
    computes the layer again there (activation checkpointing: about one hidden state a layer a
    position instead of ~18, for one more forward of the layers). ``auto``: per micro-batch,
    the fewest layers whose recompute keeps the estimated activations (layers × hidden ×
    padded positions × bytes × 18) within ``activation_budget_mib`` — none for a small
    micro-batch, nearly all for a 4096-token one (``docs/tinker.md``, "Memory"). ``true``:
    every layer, always; ``false``: none (every activation kept)."""
    activation_budget_mib: int = Field(768, ge=1)
    """``recompute_layers: auto``'s bound on the activations a micro-batch keeps for its
    backward, MiB (the default keeps SmolLM2-135M's server under 3 GB at the 4096-token
    micro-batch)."""
    max_lora_rank: int = Field(128, ge=1)
    """The largest LoRA rank a training client may ask for (a larger one is refused)."""
    checkpoint_dir: str | None = None
    """Where ``save_state`` and ``save_weights_for_sampler`` write; ``None``: ``<output_dir>/tinker``."""
