"""Policy losses for asynchronous RL, as pure functions on per-token tensors.

Notation, per token: μ = behavior logprob (the engine's, possibly several versions old),
π_prox = logprob under the learner's weights at the start of the optimizer step, π_θ =
current logprob. Decoupled PPO (AReaL) separates the two jobs PPO's old policy does: the
trust region is measured against π_prox, and the staleness of μ is corrected by a
truncated importance weight ``w = min(π_prox / μ, C)``.

Masks are 1 for model tokens and 0 for tool/environment tokens and padding. Masked
positions are replaced by constants *before* any arithmetic, so a NaN or inf there can
reach neither the loss nor the gradient (``0 · NaN`` is NaN, so multiplying by the mask
after the fact would not be enough, even for the gradient of ``torch.where``).

Every registered loss has one signature, :class:`PolicyLossFn` (as verl's ``core_algos``
registry: the per-token tensors plus the whole algorithm config), so the learner can call
any of them the same way and a new loss reads whatever hyperparameters it needs from
``config`` instead of the learner knowing each loss's keywords. GSPO, CISPO, IcePop and
the ratio-band masks of ``algorithm.is_mask`` are in ``objectives.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from asyncrl.algorithms.advantages import resolve
from asyncrl.algorithms.correction import LossInputs, band_keep, clean, prepare
from asyncrl.config import AlgorithmConfig


class PolicyLossFn(Protocol):
    """What the learner calls for ``algorithm.policy_loss``, registered or ``module:function``.

    ``logprobs`` (B, T) carry the gradient; ``behavior_logprobs`` (B, T) are the engine's
    μ; ``advantages`` are (B,) or (B, T); ``mask`` (B, T) is 1 on model tokens.
    ``proximal_logprobs`` (B, T) is π_prox, or ``None`` in bypass mode (π_prox := μ).
    ``config`` is the run's ``algorithm`` section: clip ranges, caps, ``aggregation`` and
    anything else a loss needs. Returns the scalar loss (aggregated with
    ``config.aggregation``, which the learner relies on to weigh micro-batches) and
    detached scalar metrics, each a token mean over ``mask`` (logged as ``actor/<key>``).
    """

    def __call__(self, logprobs: Tensor, behavior_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                 proximal_logprobs: Tensor | None, config: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]: ...


POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def _token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Every masked-in token of the batch weighs the same; long answers weigh more."""
    return values.sum() / mask.sum().clamp(min=1).to(values.dtype)


def _seq_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Every sequence weighs the same, whatever its length; empty sequences are skipped."""
    counts = mask.sum(dim=-1)  # (B,)
    per_seq = values.sum(dim=-1) / counts.clamp(min=1).to(values.dtype)  # (B,)
    return per_seq.sum() / (counts > 0).sum().clamp(min=1).to(values.dtype)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"token_mean": _token_mean, "seq_mean": _seq_mean}


def aggregate(values: Tensor, mask: Tensor, mode: str = "token_mean") -> Tensor:
    """Reduce per-token values (B, T) over the tokens where mask (B, T) is set, to a scalar.

    ``token_mean``: sum over masked tokens / their number. ``seq_mean``: masked mean of each
    sequence, then the mean over sequences with at least one masked token. An empty mask
    gives 0, not NaN, so a batch of tool-only turns cannot poison the optimizer.
    """
    reduce = resolve(AGGREGATIONS, mode, "aggregation")
    mask = mask.bool()
    return reduce(torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)), mask)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator adding a loss with the :class:`PolicyLossFn` signature under ``name``."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        check_policy_loss(fn, name)
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def check_policy_loss(fn: Callable[..., object], name: str) -> None:
    """Refuse a function the learner's call could not bind (say, one written for another
    keyword set), at registration or pre-flight rather than at the first optimizer step.
    Functions whose signature Python cannot read pass unchecked."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None, None, None, proximal_logprobs=None, config=None)
    except TypeError as exc:
        raise TypeError(f"policy loss {name!r} does not take the learner's call "
                        "fn(logprobs, behavior_logprobs, advantages, mask, *, proximal_logprobs, config) "
                        f"(asyncrl.algorithms.losses.PolicyLossFn): {exc}") from None


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss ``name`` (registered, or ``module:function``), checked against :class:`PolicyLossFn`."""
    fn = resolve(POLICY_LOSSES, name, "policy loss")
    check_policy_loss(fn, name)
    return fn


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(π_θ ‖ π_ref) per token: ``exp(d) − d − 1`` with d = ref − lp.

    Unbiased under samples from π_θ, never negative and low-variance (Schulman, "Approximating
    KL divergence"). ``expm1`` keeps it accurate when d is tiny. (B, T) -> (B, T).
    """
    d = ref_logprobs - logprobs
    return torch.expm1(d) - d


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at each position's ``targets`` token, in float32
    whatever the logits' dtype (a bf16 log-softmax loses the small differences the
    importance ratios are made of). logits (..., V), targets (...) -> (...).

    The one place "log-softmax, then gather the sampled token" is written: the learner's
    π and π_prox, serve-tinker's losses and sampler, the delivery probe and the tiny
    warm-ups all read a token's logprob through it, so they agree to the bit."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position: ``logsumexp(z) − Σ p·z``. (B, T, V) -> (B, T).

    Stable for large logits, and 0 rather than NaN when some logits are −inf (their p is 0).
    """
    probs = torch.softmax(logits, dim=-1)
    finite = torch.where(probs > 0, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate per token, ``min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A)``,
    and where the clipped term is strictly the smaller (its gradient is then zero: the
    token is outside the trust region on the side its advantage pushes). (B, T) each."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return torch.minimum(unclipped, clipped), clipped < unclipped


def is_diagnostics(inputs: LossInputs) -> dict[str, Tensor]:
    """Per-token values every loss reports, whatever weight it applies: the first two
    moments of the untruncated π_prox/μ (the learner turns them into ``actor/is_ess``) and
    the k3 KL(π_θ ‖ π_prox), ``approx_kl``. Detached."""
    raw = torch.exp(inputs.is_log_weight())
    return {"is_raw_weight_mean": raw, "is_raw_weight_sq_mean": raw.square(),
            "approx_kl": kl_k3(inputs.logprobs.detach(), inputs.proximal)}


def ratio_band(inputs: LossInputs, config: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The tokens ``algorithm.is_mask`` keeps (B, T, bool; every model token when ``none``)
    and, when it is on, the share it dropped as ``is_masked_fraction`` (per token)."""
    keep = band_keep(inputs.learner_log_ratio(), inputs.mask, config.is_mask, config.is_mask_low,
                     config.is_mask_high)
    dropped = {} if config.is_mask == "none" else {"is_masked_fraction": inputs.mask & ~keep}
    return keep, dropped


def truncated_weight(raw_weight: Tensor, inputs: LossInputs,
                     config: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The staleness correction ``min(raw_weight, is_cap)`` per token (1 with
    ``is_correction`` off), 0 on the tokens ``is_mask`` drops, and its per-token metrics
    ``is_weight_mean`` (after truncation), ``is_truncated_fraction`` and the mask's share."""
    truncated = raw_weight.clamp(max=config.is_cap)
    keep, dropped = ratio_band(inputs, config)
    weight = clean(truncated if config.is_correction else torch.ones_like(truncated), keep)
    return weight, {"is_weight_mean": truncated, "is_truncated_fraction": raw_weight > config.is_cap} | dropped


def token_means(values: dict[str, Tensor], inputs: LossInputs) -> dict[str, Tensor]:
    """Per-token metrics (B, T; a bool counts as 1) as detached token means over the model
    tokens, as the learner logs them."""
    with torch.no_grad():
        return {key: aggregate(value.to(inputs.logprobs.dtype), inputs.mask, "token_mean")
                for key, value in values.items()}


def clipped_ppo(inputs: LossInputs, weight: Tensor, config: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """``− weight · min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A)`` with r = π_θ/π_prox,
    aggregated, and its per-token metrics (not yet averaged). ``weight`` (B, T) is detached:
    the correction of the loss calling it, 0 on the tokens it drops."""
    ratio = torch.exp(inputs.logprobs - inputs.proximal)  # (B, T)
    surrogate, clipped = clipped_surrogate(ratio, inputs.advantages, config.clip_low, config.clip_high)
    loss = aggregate(-weight * surrogate, inputs.mask, config.aggregation)
    return loss, {"clip_fraction": clipped, "ratio_mean": ratio.detach()} | is_diagnostics(inputs)


@register_policy_loss("decoupled_ppo")
def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    proximal_logprobs: Tensor | None = None,
    config: AlgorithmConfig | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO: ``L_t = − w · min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A)``.

    A :class:`PolicyLossFn`; reads ``clip_low``, ``clip_high``, ``is_cap``,
    ``is_correction``, ``is_mask`` (with its band) and ``aggregation`` from ``config``
    (``None``: the defaults).

    Shapes: logprobs, behavior_logprobs, proximal_logprobs, mask (B, T); advantages (B,)
    (one per trajectory, broadcast over its tokens) or (B, T). Returns the scalar loss and
    detached scalar metrics, all token means over masked tokens:

    - ``clip_fraction``: tokens where the clipped term is strictly the smaller, i.e. the
      token is outside the trust region on the side its advantage pushes, so its gradient
      is zero (r > 1 + clip_high with A > 0, or r < 1 − clip_low with A < 0);
    - ``is_weight_mean``, ``is_truncated_fraction`` (π_prox/μ > is_cap), ``ratio_mean``;
    - ``is_raw_weight_mean`` and ``is_raw_weight_sq_mean``, the first two moments of the
      untruncated π_prox/μ, from which the learner reports the effective sample size
      ``(E w)² / E w²`` (1 on policy, towards 0 as μ drifts from π_prox);
    - ``approx_kl``: k3 estimate of KL(π_θ ‖ π_prox), ``kl_k3(logprobs, π_prox)``: never
      negative, unlike the plain mean of ``log π_prox − log π_θ``;
    - ``is_masked_fraction`` when ``is_mask`` is on: the tokens it dropped
      (``asyncrl/algorithms/objectives.py`` has the masks' sources).

    ``proximal_logprobs=None`` is bypass mode (no recompute pass): π_prox := μ and w = 1,
    which is exactly PPO against the behavior logprobs. ``config.is_correction=False`` keeps
    π_prox but applies no weight (w = 1): stale tokens are trained as if π_prox had
    sampled them — the naive baseline that ``asyncrl bench staleness`` measures the
    correction against (the IS metrics still describe the weights it did not apply). The
    upper clip is wider than the lower one (DAPO's clip-higher) so low-probability
    tokens can still grow.
    """
    config = config if config is not None else AlgorithmConfig()
    if not config.is_cap > 0:
        raise ValueError(f"is_cap must be a positive float, got {config.is_cap!r}")
    inputs = prepare(logprobs, behavior_logprobs, advantages, mask, proximal_logprobs)
    # detached: its inputs are; 1 in bypass
    weight, weight_metrics = truncated_weight(torch.exp(inputs.is_log_weight()), inputs, config)
    loss, metrics = clipped_ppo(inputs, weight, config)
    return loss, token_means(metrics | weight_metrics, inputs)
