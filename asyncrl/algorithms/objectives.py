"""The objectives beyond token-level decoupled PPO: GSPO, CISPO and IcePop, and where the
masks against the training–inference mismatch live.

Notation as in ``losses.py``: μ the engine's logprob, π_prox the learner's at the start of
the optimizer step, π_θ the current one; per token r = π_θ / π_prox and k = π_prox / μ,
which in an async run is staleness (μ from an older version) times the engine/learner
mismatch (same version, other numerics). The loss sees only their product: it is not
given the versions, and the learner holds no copy of old weights to tell them apart.

Decisions:

- **Masks are options, not losses** (``algorithm.is_mask``: ``token``, ``sequence``,
  ``geometric``, band ``[is_mask_low, is_mask_high]``). A mask is a statement about the
  data — which samples are too far from the learner to trust — not about the update, so
  one knob composes with every objective (decoupled PPO, GSPO, CISPO, IcePop) rather than
  one loss per pairing. Sources: truncated IS against the mismatch, Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training" (blog); masked IS at
  token and sequence level and the geometric-mean sequence mask, Liu, Li et al. 2025, "When
  speed kills stability: demystifying RL collapse from the training–inference mismatch"
  (blog). A dropped token keeps its place in the normaliser (``aggregation`` divides by the
  model tokens, dropped or not), so the learner's weighing of micro-batches still holds.
- **IcePop is a registered loss** all the same, because its weight differs from decoupled
  PPO's, not only its mask: inside the band it applies the untruncated k, outside 0 —
  "mask instead of truncate" — with a band ([0.5, 5] by default) far wider than ``is_cap``.
- **GSPO and CISPO** are losses: their gradients differ from PPO's, not just their weights.

With a recomputed π_prox every objective keeps AReaL's split: the trust region (the clip)
is measured against π_prox and the staleness is corrected by a detached weight built from
k. In bypass (π_prox := μ) that weight is 1, the ratio against μ carrying the whole
correction, and the masks compare the learner's current logprob with μ.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algorithms.correction import band_keep, clean, prepare, sequence_mean
from asyncrl.algorithms.losses import (
    aggregate,
    clipped_ppo,
    clipped_surrogate,
    is_diagnostics,
    ratio_band,
    register_policy_loss,
    token_means,
    truncated_weight,
)
from asyncrl.config import AlgorithmConfig


@register_policy_loss("gspo")
def gspo_loss(logprobs: Tensor, behavior_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
              proximal_logprobs: Tensor | None = None,
              config: AlgorithmConfig | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al., Qwen, arXiv 2507.18071): the
    ratio and its clip are per sequence, length-normalised.

    For sequence i with model tokens t ∈ s_i:
    ``s_i = exp(mean_t (log π_θ − log π_prox))``, and each token carries GSPO-token's
    ``ŝ_t = sg[s_i] · π_θ(t) / sg[π_θ(t)]`` (value s_i, gradient s_i · ∇log π_θ(t)), so

        ``L_t = − w_i · min(ŝ_t·A_t, clip(ŝ_t, 1 − gspo_clip_low, 1 + gspo_clip_high)·A_t)``

    aggregated by ``aggregation``. With one advantage per sequence and ``seq_mean`` this is
    GSPO's sequence objective exactly (its gradient is s_i · mean_t ∇log π_θ(t)); with
    ``token_mean`` each sequence weighs by its length; per-token advantages (B, T) work as
    in GSPO-token. A clip zeroes the whole sequence's gradient on the side its advantage
    pushes (``clip_fraction`` counts its tokens).

    π_prox: s_i is measured against π_prox (the trust region), and staleness is corrected
    per sequence by ``w_i = min(exp(mean_t log(π_prox / μ)), is_cap)``, the same
    length-normalised geometric mean GSPO uses for its ratio (the product over tokens
    would explode or vanish with the length); ``is_correction=false`` or bypass: w_i = 1.
    Reads ``gspo_clip_low``, ``gspo_clip_high``, ``is_cap``, ``is_correction``, ``is_mask``,
    ``aggregation``. Metrics as decoupled PPO's (``ratio_mean`` is the tokens' mean s_i,
    ``is_weight_mean`` their w_i).
    """
    config = config if config is not None else AlgorithmConfig()
    inputs = prepare(logprobs, behavior_logprobs, advantages, mask, proximal_logprobs)
    seq_ratio = torch.exp(sequence_mean(inputs.logprobs.detach() - inputs.proximal, inputs.mask))  # (B, 1)
    token_ratio = seq_ratio * torch.exp(inputs.logprobs - inputs.logprobs.detach())  # value s_i, (B, T)
    surrogate, clipped = clipped_surrogate(token_ratio, inputs.advantages, config.gspo_clip_low, config.gspo_clip_high)
    seq_weight = torch.exp(sequence_mean(inputs.is_log_weight(), inputs.mask))  # (B, 1)
    weight, weight_metrics = truncated_weight(seq_weight.expand_as(surrogate), inputs, config)
    loss = aggregate(-weight * surrogate, inputs.mask, config.aggregation)
    metrics = {"clip_fraction": clipped, "ratio_mean": seq_ratio.expand_as(surrogate)} | is_diagnostics(inputs)
    return loss, token_means(metrics | weight_metrics, inputs)


@register_policy_loss("cispo")
def cispo_loss(logprobs: Tensor, behavior_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
               proximal_logprobs: Tensor | None = None,
               config: AlgorithmConfig | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585): REINFORCE
    with a clipped, detached importance weight, so no token is ever dropped:

        ``L_t = − w_t · sg(clip(r_t, 1 − clip_low, 1 + clip_high)) · A_t · log π_θ(t)``

    with r_t = π_θ / π_prox (π_θ / μ in bypass). PPO's clip zeroes the gradient of a token
    that left the trust region; CISPO's only bounds its weight, so rare tokens that move
    a lot (the "forks" of a reasoning chain) keep contributing. At the first optimizer step
    of a batch (r = 1) its gradient equals decoupled PPO's; they part from the second
    (``optim.ppo_epochs`` or ``mini_batches`` > 1). The loss's value depends on log π_θ
    itself and is not comparable with the PPO losses'; its gradient is.

    π_prox: the clip is measured against π_prox (the same ``clip_low``/``clip_high`` as
    decoupled PPO: switching changes what the clip does, not where), and staleness is
    corrected by the truncated ``w_t = min(π_prox / μ, is_cap)``, the product w_t · r_t
    being the whole π_θ / μ; ``is_correction=false`` or bypass: w_t = 1. MiniMax-M1 set no
    lower bound (``clip_low`` close to 1 does that here). ``clip_fraction`` counts the
    tokens whose weight was clipped.
    """
    config = config if config is not None else AlgorithmConfig()
    inputs = prepare(logprobs, behavior_logprobs, advantages, mask, proximal_logprobs)
    ratio = torch.exp(inputs.logprobs.detach() - inputs.proximal)  # (B, T), detached
    bounded = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    weight, weight_metrics = truncated_weight(torch.exp(inputs.is_log_weight()), inputs, config)
    loss = aggregate(-weight * bounded * inputs.advantages * inputs.logprobs, inputs.mask, config.aggregation)
    metrics = {"clip_fraction": bounded != ratio, "ratio_mean": ratio} | is_diagnostics(inputs)
    return loss, token_means(metrics | weight_metrics, inputs)


@register_policy_loss("icepop")
def icepop_loss(logprobs: Tensor, behavior_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                proximal_logprobs: Tensor | None = None,
                config: AlgorithmConfig | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop (Ling team, inclusionAI, Ring-1T report "Every step evolves", arXiv 2510.18855):
    PPO whose tokens with a training/inference probability ratio outside [α, β] get no
    gradient, and whose others are weighed by that ratio, untruncated:

        ``L_t = − M(k_t) · min(r_t·A_t, clip(r_t, 1 − clip_low, 1 + clip_high)·A_t)``,
        ``M(k) = k if α ≤ k ≤ β else 0``, k_t = π_prox / μ, α = ``icepop_low``, β = ``icepop_high``.

    π_prox: IcePop's k is the learner's probability over the engine's *for the same
    weights*; here π_prox / μ also holds the staleness of μ, so in an async run the mask
    drops tokens that are too stale as well as those the engine computed too differently
    (at η = 0, or on tokens of the trained version, it is IcePop's k exactly). The trust
    region is against π_prox. Bypass: the band compares the learner's current logprob with
    μ and the weight is 1 on kept tokens, r already being π_θ / μ. ``is_correction=false``:
    the band still drops, kept tokens weigh 1. ``icepop_masked_fraction``: the tokens it
    dropped; ``is_mask`` still applies on top.
    """
    config = config if config is not None else AlgorithmConfig()
    inputs = prepare(logprobs, behavior_logprobs, advantages, mask, proximal_logprobs)
    inside = band_keep(inputs.learner_log_ratio(), inputs.mask, "token", config.icepop_low, config.icepop_high)
    keep, dropped = ratio_band(inputs, config)
    raw_weight = torch.exp(inputs.is_log_weight())  # 1 in bypass
    weight = clean(raw_weight if config.is_correction else torch.ones_like(raw_weight), inside & keep)
    loss, metrics = clipped_ppo(inputs, weight, config)
    metrics |= {"is_weight_mean": weight, "icepop_masked_fraction": inputs.mask & ~inside} | dropped
    return loss, token_means(metrics, inputs)
