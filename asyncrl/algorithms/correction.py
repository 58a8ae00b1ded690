"""What every policy loss does with μ and π_prox before its own arithmetic: clean the masked
positions, and find the tokens or sequences whose engine/learner ratio leaves a band.

Pure functions on (B, T) tensors; the losses in ``losses.py`` and ``objectives.py`` share
them, so each loss reads as its own formula and the masking rule is written once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

MaskLevel = Literal["none", "token", "sequence", "geometric"]


def clean(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` with 0 where the bool ``mask`` is off, before any arithmetic touches them
    (``0 · NaN`` is NaN, so multiplying by the mask afterwards would not do)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


@dataclass(frozen=True)
class LossInputs:
    """A loss's per-token inputs, (B, T) each, 0 at masked positions.

    ``logprobs`` (π_θ) carry the gradient; ``behavior`` (μ), ``proximal`` (π_prox, or μ in
    bypass) and ``advantages`` are detached.
    """

    mask: Tensor
    logprobs: Tensor
    behavior: Tensor
    proximal: Tensor
    advantages: Tensor
    bypass: bool

    def learner_log_ratio(self) -> Tensor:
        """log(π_learner / μ) per token, what the masks compare: the learner's probability of
        each sampled token over the engine's. π_learner is π_prox; in bypass (no recompute)
        the current logprob, detached, which is π_prox at the first optimizer step of a
        batch. Detached; 0 at masked positions."""
        learner = self.logprobs.detach() if self.bypass else self.proximal
        return learner - self.behavior

    def is_log_weight(self) -> Tensor:
        """log(π_prox / μ) per token, the staleness correction's weight before truncation:
        0 in bypass (π_prox := μ, the ratio against μ already corrects). Detached."""
        return self.proximal - self.behavior


def prepare(logprobs: Tensor, behavior_logprobs: Tensor, advantages: Tensor, mask: Tensor,
            proximal_logprobs: Tensor | None) -> LossInputs:
    """The :class:`PolicyLossFn` arguments as :class:`LossInputs`: ``advantages`` (B,) are
    broadcast over their row's tokens, ``proximal_logprobs=None`` (bypass) becomes μ."""
    mask = mask.bool()
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1), broadcast over T
    behavior = clean(behavior_logprobs.detach(), mask)
    proximal = behavior if proximal_logprobs is None else clean(proximal_logprobs.detach(), mask)
    return LossInputs(mask=mask, logprobs=clean(logprobs, mask), behavior=behavior, proximal=proximal,
                      advantages=clean(advantages.detach().expand_as(logprobs), mask),
                      bypass=proximal_logprobs is None)


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of each row over its masked-in tokens, (B, T) -> (B, 1); 0 for a row without any."""
    counts = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(values.dtype)
    return clean(values, mask).sum(dim=-1, keepdim=True) / counts


def band_keep(log_ratio: Tensor, mask: Tensor, level: MaskLevel, low: float, high: float) -> Tensor:
    """The tokens (B, T, bool) a ratio band keeps: those of ``mask`` whose ratio lies in
    ``[low, high]``, the ratio being, by ``level``:

    - ``token``: each token's own, exp(log_ratio_t) (token-level masked IS; IcePop);
    - ``sequence``: its sequence's product, exp(Σ_t log_ratio_t), the sequence's true
      importance weight (sequence-level masked IS): a dropped sequence loses every token;
    - ``geometric``: its sequence's geometric mean, exp(mean_t log_ratio_t), which does not
      shrink or grow with the length as the product does;
    - ``none``: every token of ``mask``.

    Compared in log space, so a product over a long sequence cannot overflow.
    """
    if level == "none":
        return mask
    if level == "token":
        stat = log_ratio
    elif level == "sequence":
        stat = clean(log_ratio, mask).sum(dim=-1, keepdim=True)  # (B, 1)
    elif level == "geometric":
        stat = sequence_mean(log_ratio, mask)  # (B, 1)
    else:
        raise ValueError(f"unknown mask level {level!r}; expected none, token, sequence or geometric")
    return mask & (stat >= math.log(low)) & (stat <= math.log(high))
