"""The losses Tinker's SDK names (``forward_backward(data, loss_fn)``), as asyncrl's own.

Tinker's built-in losses are **sums** over every target position of every datum in the call
(its ``loss:sum``), with the ratio taken against the sampler's logprobs (``logprobs``, μ) and
no aggregation: the caller puts zeros in ``advantages`` / ``weights`` where nothing trains.
asyncrl's registered policy losses (``asyncrl/algorithms/losses.py``, ``objectives.py``) are
the same formulas aggregated by ``token_mean``, and in bypass mode (``proximal_logprobs=None``:
π_prox := μ, no truncated weight) their ratio is exactly π_θ/μ. So each Tinker loss here is
one registered loss called in bypass over the call's positions, times their count N:

- ``ppo``: ``decoupled_ppo`` with ε_low = 1 − ``clip_low_threshold``, ε_high =
  ``clip_high_threshold`` − 1 (Tinker's thresholds are bounds on the ratio itself);
- ``cispo``: ``cispo`` with the same bounds;
- ``importance_sampling``: ``decoupled_ppo`` whose clip never binds (ε_low = 1: the ratio is
  never below 0; ε_high = ∞): min(r·A, r·A) = r·A, Tinker's −Σ r·A. The config's ``clip_low < 1``
  bound guards users' runs, not this use, so that config is built unvalidated.

``cross_entropy`` (−Σ w·log p, the weights per position) and ``dro`` (−Σ (log p·A −
β/2·(log p − μ)²)) have no registered counterpart; they are written here as the one-line pure
functions they are. ``gspo`` is Tinker's GSPO-token, whose sequence ratio runs over the tokens
a ``sequence_ratio_mask`` marks while its sum runs over every position: asyncrl's registered
``gspo`` takes one mask for both, so :func:`gspo` is written here from the shared pieces
(``clipped_surrogate``, ``sequence_mean``). A name Tinker's types list and this table lacks
(``stable_reinforce``: its formula is not published) is refused by :func:`tinker_loss` naming
what is served.

Every function takes per-position tensors (B, T) — ``logprobs`` carrying the gradient, the
loss inputs, and a bool ``mask`` of the real positions (padding off) — and returns the summed
loss (a scalar) and detached scalar metrics named with the reduction the SDK combines chunks
by (``loss:sum``, ``<name>:mean``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from asyncrl.algorithms.correction import clean, sequence_mean
from asyncrl.algorithms.losses import clipped_surrogate, get_policy_loss
from asyncrl.config import AlgorithmConfig

TinkerLoss = Callable[[Tensor, Mapping[str, Tensor], Tensor, Mapping[str, float]], tuple[Tensor, dict[str, Tensor]]]
"""(logprobs (B, T), loss inputs name -> (B, T), mask (B, T) bool, loss_fn_config) -> (loss, metrics)."""

PPO_CLIP = (0.8, 1.2)
"""Tinker's default ``clip_low_threshold`` / ``clip_high_threshold`` (ratio bounds)."""


class LossInputError(ValueError):
    """A loss called without an input or config value it needs (the client's mistake)."""


def _need(inputs: Mapping[str, Tensor], loss: str, *names: str) -> list[Tensor]:
    missing = [n for n in names if n not in inputs]
    if missing:
        raise LossInputError(f"loss_fn {loss!r} needs loss_fn_inputs {list(names)}; missing {missing}")
    return [inputs[n] for n in names]


def _registered(name: str, clip_low: float, clip_high: float) -> TinkerLoss:
    """Tinker's ratio loss as asyncrl's registered ``name`` in bypass, summed (× N)."""
    fn = get_policy_loss(name)

    def loss(logprobs: Tensor, inputs: Mapping[str, Tensor], mask: Tensor,
             config: Mapping[str, float]) -> tuple[Tensor, dict[str, Tensor]]:
        sampled, advantages = _need(inputs, name, "logprobs", "advantages")
        low, high = _thresholds(config, clip_low, clip_high)
        # model_copy: ε_low = 1 (importance_sampling) is outside the user-facing bound
        algorithm = AlgorithmConfig().model_copy(update={"clip_low": 1.0 - low, "clip_high": high - 1.0,
                                                         "aggregation": "token_mean"})
        mean, metrics = fn(logprobs, sampled, advantages, mask, proximal_logprobs=None, config=algorithm)
        count = mask.sum().to(mean.dtype)  # N: token_mean divided by it
        return mean * count, {f"{key}:mean": value for key, value in metrics.items()}

    return loss


def _thresholds(config: Mapping[str, float], low: float, high: float) -> tuple[float, float]:
    low = float(config.get("clip_low_threshold", low))
    high = float(config.get("clip_high_threshold", high))
    if not 0 <= low <= 1 <= high:
        raise LossInputError(f"loss_fn_config needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                             f"{low} and {high}")
    return low, high


def cross_entropy(logprobs: Tensor, inputs: Mapping[str, Tensor], mask: Tensor,
                  config: Mapping[str, float]) -> tuple[Tensor, dict[str, Tensor]]:
    """−Σ w_t · log p(target_t): Tinker's supervised loss, ``weights`` per position (1 where
    the position trains, 0 where not; any real weight: the SDK's custom losses send −∂C/∂log p)."""
    (weights,) = _need(inputs, "cross_entropy", "weights")
    return -(clean(weights, mask) * clean(logprobs, mask)).sum(), {}


def dro(logprobs: Tensor, inputs: Mapping[str, Tensor], mask: Tensor,
        config: Mapping[str, float]) -> tuple[Tensor, dict[str, Tensor]]:
    """−Σ (log π_θ · A − β/2 · (log π_θ − μ)²): REINFORCE with a quadratic pull towards the
    sampler's logprobs μ; ``beta`` from ``loss_fn_config`` (required: no default is guessed)."""
    sampled, advantages = _need(inputs, "dro", "logprobs", "advantages")
    if "beta" not in config:
        raise LossInputError("loss_fn 'dro' needs loss_fn_config={'beta': ...}")
    lp = clean(logprobs, mask)
    drift = lp - clean(sampled, mask)
    return -(lp * clean(advantages, mask) - 0.5 * float(config["beta"]) * drift.square()).sum(), {}


def gspo(logprobs: Tensor, inputs: Mapping[str, Tensor], mask: Tensor,
         config: Mapping[str, float]) -> tuple[Tensor, dict[str, Tensor]]:
    """Tinker's ``gspo`` (GSPO-token, Zheng et al. 2025, as Tinker's docs write it): per datum
    the sequence ratio s = exp(mean over the tokens ``sequence_ratio_mask`` marks of
    log π_θ − μ), each position's ratio s_t = sg(s)·π_θ/sg(π_θ) (value s, gradient s·∇log π_θ),
    and −Σ_t min(s_t·A_t, clip(s_t, lo, hi)·A_t) over every position. ``clip_low_threshold``
    and ``clip_high_threshold`` are required: Tinker's docs give gspo no default, and GSPO's
    own (1 ∓ 3e-4 / 4e-4) are far from PPO's 0.8 / 1.2, so none is guessed. A datum marking no
    token has s = 1."""
    sampled, advantages, in_ratio = _need(inputs, "gspo", "logprobs", "advantages", "sequence_ratio_mask")
    missing = [key for key in ("clip_low_threshold", "clip_high_threshold") if key not in config]
    if missing:
        raise LossInputError(f"loss_fn 'gspo' needs loss_fn_config {missing} (no default is guessed: GSPO's paper "
                             "clips at 1 - 3e-4 and 1 + 4e-4, PPO at 0.8 and 1.2)")
    low, high = _thresholds(config, 0.0, 0.0)
    lp = clean(logprobs, mask)
    log_ratio = sequence_mean(lp.detach() - clean(sampled, mask), mask & (in_ratio != 0))  # (B, 1)
    ratio = torch.exp(log_ratio + lp - lp.detach())  # (B, T): value s, gradient s·∇log π_θ
    surrogate, clipped = clipped_surrogate(ratio, clean(advantages, mask), 1.0 - low, high - 1.0)
    positions = mask.sum().clamp(min=1)
    return -clean(surrogate, mask).sum(), {"clip_fraction:mean": (clipped & mask).sum() / positions}


TINKER_LOSSES: dict[str, TinkerLoss] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": _registered("decoupled_ppo", 0.0, math.inf),
    "ppo": _registered("decoupled_ppo", *PPO_CLIP),
    "cispo": _registered("cispo", *PPO_CLIP),
    "dro": dro,
    "gspo": gspo,
}
"""Every loss this server runs, by the name the SDK sends."""


GRADIENT_WEIGHTS = {"cross_entropy": "weights", "importance_sampling": "advantages", "ppo": "advantages",
                    "cispo": "advantages", "gspo": "advantages"}
"""Each loss's input that multiplies every position's term (and so its gradient): where it is 0
the position has no gradient, and its logprob is computed without one (``learner/head.py``).
``dro`` is not here: its pull towards μ weighs every position."""


def gradient_positions(name: str, inputs: Mapping[str, Tensor], mask: Tensor) -> Tensor:
    """The positions (B, T bool) where loss ``name`` can have a gradient: ``mask`` where its
    :data:`GRADIENT_WEIGHTS` input is not 0, all of ``mask`` for a loss without one."""
    weight = inputs.get(GRADIENT_WEIGHTS.get(name, ""))
    return mask if weight is None else mask & (weight != 0)


def tinker_loss(name: str) -> TinkerLoss:
    """The loss ``name``; an unknown one is a :class:`LossInputError` naming those served."""
    if name not in TINKER_LOSSES:
        raise LossInputError(f"loss_fn {name!r} is not implemented by this server (asyncrl serve-tinker); it serves "
                             f"{', '.join(TINKER_LOSSES)} (and the SDK's forward_backward_custom, which runs "
                             "client-side over cross_entropy)")
    return TINKER_LOSSES[name]


def as_floats(values: dict[str, Tensor]) -> dict[str, float]:
    """Metrics as floats (one host sync for the call, at its end)."""
    with torch.no_grad():
        return {key: float(value) for key, value in values.items()}
