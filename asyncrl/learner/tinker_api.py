"""What Tinker's API means, for both sides of it in asyncrl: the client that trains through
a Tinker-API URL (``learner.url``, ``asyncrl/runtime/tinker_learner.py``) and the server
that answers one (``asyncrl serve-tinker``, ``asyncrl/tinker/``). One table each for the
LoRA layer groups and the scale, so the two never disagree on what a client asked for.

The translation of asyncrl's step into Tinker's is here as pure functions on tensors:

- asyncrl's ``decoupled_ppo`` in bypass with ``token_mean`` is Tinker's ``ppo`` (``cispo``:
  ``cispo``) divided by N, the step's model tokens: Tinker's losses are *sums* over target
  positions with the ratio π_θ/μ. The loss is linear in the advantage and the clip depends
  on its sign only, so each token's advantage is sent divided by N and the two take the same
  gradient (:func:`datums`; ``docs/tinker.md``, "asyncrl's trainer with a learner by URL").
- ``forward_backward`` returns each position's logprob under the weights it computed with:
  the ratio's mean and the mismatch by version lag come from them (:func:`ratio_metrics`).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.algorithms.mismatch import mismatch_metrics, mismatch_sums
from asyncrl.config import ConfigError
from asyncrl.config.tinker import TINKER_LORA_ALPHA
from asyncrl.learner.batch import TrainBatch

LORA_ALPHA = TINKER_LORA_ALPHA
"""peft's ``lora_alpha`` of every Tinker LoRA client (``asyncrl/config/tinker.py`` says why)."""
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "c_attn", "out_proj")
"""Linear layers Tinker's ``train_attn`` names (the server treats every other linear layer but
the head as the MLP's, ``train_mlp``)."""
UNEMBED = ("lm_head",)
WHOLE_GROUPS = {"attention": {"q_proj", "k_proj", "v_proj", "o_proj"}, "mlp": {"gate_proj", "up_proj", "down_proj"}}
"""The groups, as a client names them in ``model.lora.target_modules`` for Llama-style layer
names (SmolLM2, Qwen, Llama); any other model's names go as ``all-linear``."""
TINKER_LOSS = {"decoupled_ppo": "ppo", "cispo": "cispo"}
"""asyncrl's objective → the Tinker loss that is it in bypass (``asyncrl/tinker/losses.py``)."""


def lora_groups(targets: list[str] | str) -> tuple[bool, bool]:
    """(``train_attn``, ``train_mlp``) for ``model.lora.target_modules``; ConfigError for a
    set Tinker cannot name (part of a group: Tinker trains whole groups)."""
    if targets == "all-linear":
        return True, True
    wanted = {targets} if isinstance(targets, str) else set(targets)
    attn, mlp = (WHOLE_GROUPS[group] <= wanted for group in ("attention", "mlp"))
    named = (WHOLE_GROUPS["attention"] if attn else set()) | (WHOLE_GROUPS["mlp"] if mlp else set())
    if wanted != named or not wanted:
        raise ConfigError(f"model.lora.target_modules={sorted(wanted)}: a learner by URL asks Tinker for whole "
                          f"groups of layers, the attention's {sorted(WHOLE_GROUPS['attention'])} and/or the MLP's "
                          f"{sorted(WHOLE_GROUPS['mlp'])}; use all-linear or those lists")
    return attn, mlp


def datums(batch: TrainBatch) -> tuple[list[Any], int]:
    """The batch as Tinker datums for ``ppo``/``cispo`` (each row's tokens, its targets, μ as
    ``logprobs``, its advantage on model tokens divided by the step's model-token count N)
    and N. Prompt, tool and padding positions carry advantage 0: they add nothing to a sum."""
    from tinker import types

    mask = batch.loss_mask.float()
    tokens = int(mask.sum().item())
    scale = 1.0 / max(tokens, 1)
    rows = []
    for i in range(batch.size):
        length = int(batch.attention_mask[i].sum().item())
        ids = batch.input_ids[i, :length].tolist()
        advantage = batch.advantages[i] if batch.advantages.dim() == 1 else batch.advantages[i, :length - 1]
        per_token = (advantage * mask[i, :length - 1] * scale).float()
        # Datum converts lists to TensorData (its __post_init__), though tinker annotates TensorData only
        rows.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": ids[1:], "logprobs": batch.behavior_logprobs[i, :length - 1].float().tolist(),  # type: ignore[dict-item]
            "advantages": per_token.tolist()}))  # type: ignore[dict-item]
    return rows, tokens


def ratio_metrics(batch: TrainBatch, logprobs: list[torch.Tensor], version: int) -> dict[str, float]:
    """From the logprobs the server computed at the start of the step (``forward_backward``
    returns them; π_θ = π_prox there): the ratio π_θ/μ's mean over model tokens, and the
    engine–learner mismatch by version lag that the learner in process logs
    (``asyncrl/algorithms/mismatch.py``: ``asyncrl doctor`` checks lag 0)."""
    current = torch.zeros_like(batch.behavior_logprobs, dtype=torch.float32)
    for i, row in enumerate(logprobs):
        current[i, :row.numel()] = row.float()
    mask = batch.loss_mask.float()
    if not bool(mask.any()):
        return {}
    behavior = batch.behavior_logprobs.float()
    ratio = torch.exp(current - behavior)[mask > 0]
    out = {"actor/ratio_mean": float(ratio.mean())}
    if batch.versions is not None:
        out |= mismatch_metrics(mismatch_sums(behavior, current, mask, version - batch.versions))
    return out
