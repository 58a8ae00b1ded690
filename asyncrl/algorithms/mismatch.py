"""The engine–learner mismatch, per step and by version lag: how far the logprob the
engine reported for a sampled token (μ) is from the learner's at the version that token
names, the invariant ``asyncrl doctor`` checks first.

At lag 0 (a token sampled by the version being trained) the learner's logprob at the
start of the step *is* π_prox, so μ vs π_prox there is pure mismatch: other numerics
(bfloat16, another engine's kernels), or an engine that does not hold the weights it
stamps (a skipped or broken sync). On the built-in engine in float32 it is ~1e-6. At lag
k ≥ 1 it also holds k versions of learning, which is what the staleness correction
corrects; the lag-0 figure is the floor under all of them.

Per lag the learner logs (``mismatch/*_lag{k}``, ``k < MAX_LAG``; ``lag{MAX_LAG}`` holds
every lag from ``MAX_LAG`` on):

- ``k3``: the k3 estimate of KL(μ ‖ π) over the lag's tokens, ``(r − 1) − log r`` with
  r = π/μ, the estimator the losses use (``kl_k3``): never negative, unbiased under μ;
- ``max_abs``: the largest |log π − log μ| of a token;
- ``beyond_fraction``: the share of the lag's tokens with |log π − log μ| > ``MISMATCH_BOUND``;
- ``tokens``: how many tokens the figures are over (a lag with none is not logged).
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algorithms.losses import kl_k3

MISMATCH_BOUND = 0.1
"""|Δ log p| beyond which a token counts in ``beyond_fraction``: a 10 % disagreement on the
token's probability, far above float32 noise (1e-4, ``weight_sync.check_tolerance``) and
rare even for a bfloat16 engine."""
MAX_LAG = 3
"""Lags 0 … MAX_LAG − 1 are logged each; ``lag{MAX_LAG}`` is every lag from it on."""
_COLUMNS = 4  # tokens, k3 sum, tokens beyond the bound, max |Δ|


def mismatch_sums(behavior: Tensor, learner: Tensor, mask: Tensor, lag: Tensor) -> Tensor:
    """Per lag bucket (row k: lag k, the last row lag ≥ ``MAX_LAG``) the sums the step's
    figures come from: (tokens, Σ k3, tokens beyond ``MISMATCH_BOUND``, max |Δ|).

    ``behavior`` μ, ``learner`` the learner's logprobs at the version each token names the
    lag from, ``mask`` the model tokens, ``lag`` the trained version minus the token's;
    all (B, T). Returns (MAX_LAG + 1, 4), detached; sums add over micro-batches (the max
    column takes the max)."""
    with torch.no_grad():
        behavior, learner = behavior.float(), learner.float()
        diff = (learner - behavior).abs()
        k3 = kl_k3(behavior, learner)
        model = mask > 0
        out = torch.zeros(MAX_LAG + 1, _COLUMNS, device=behavior.device)
        for k in range(MAX_LAG + 1):
            sel = model & ((lag >= k) if k == MAX_LAG else (lag == k))
            if not bool(sel.any()):  # a CPU-GPU sync point, one per lag bucket
                continue
            out[k, 0] = sel.sum()
            out[k, 1] = k3[sel].sum()
            out[k, 2] = (diff[sel] > MISMATCH_BOUND).sum()
            out[k, 3] = diff[sel].max()
        return out


def add_sums(total: Tensor, part: Tensor) -> None:
    """``part`` (a :func:`mismatch_sums`) added into ``total`` in place: counts and sums
    added, maxima taken."""
    total[:, :3] += part[:, :3]
    total[:, 3] = torch.maximum(total[:, 3], part[:, 3])


def mismatch_metrics(sums: Tensor) -> dict[str, float]:
    """The step's ``mismatch/*`` metrics from its :func:`mismatch_sums`; a lag no token had
    is left out."""
    out: dict[str, float] = {}
    for k, (tokens, k3, beyond, max_abs) in enumerate(sums.tolist()):
        if tokens <= 0:
            continue
        out |= {f"mismatch/k3_lag{k}": k3 / tokens, f"mismatch/max_abs_lag{k}": max_abs,
                f"mismatch/beyond_fraction_lag{k}": beyond / tokens, f"mismatch/tokens_lag{k}": tokens}
    return out
