"""On-policy distillation as per-token advantages: the student samples, a frozen teacher scores
each sampled token, and the per-token reverse KL to the teacher is the learning signal.

With μ the student's sampling logprob of token t (the behavior logprob the engine returned)
and τ the teacher's logprob of the same token in the same context,

    A_t = A_seq − c · (μ_t − τ_t)        on model tokens (mask 1); 0 elsewhere,

where A_seq is the episode's advantage from its reward (0 for distillation alone) and c the
coefficient. ``μ_t − τ_t`` is the single-sample estimate of the reverse KL
KL(π_student ‖ π_teacher) at that position: a token the teacher finds likelier than the
student did gets a positive advantage. The teacher is frozen, so this adds no staleness:
both logprobs are of tokens already sampled, and the decoupled loss's importance weights
correct for the policy having moved since, as they do for the reward's advantage.
"""

from __future__ import annotations

import torch
from torch import Tensor


def distill_advantages(advantages: Tensor, behavior_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor,
                       coef: float) -> Tensor:
    """Per-token advantages (B, T) from per-sequence ``advantages`` (B,) and the student's
    ``behavior_logprobs`` and ``teacher_logprobs`` (B, T) on the same tokens; ``mask`` (B, T)
    is 1 on model tokens. Masked positions are exactly 0 whatever the logprobs hold there."""
    keep = mask.bool()
    gap = torch.where(keep, behavior_logprobs - teacher_logprobs, torch.zeros_like(behavior_logprobs))
    per_token = advantages.unsqueeze(-1) - coef * gap
    return torch.where(keep, per_token, torch.zeros_like(per_token))


def reverse_kl(behavior_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """The mean over model tokens of ``μ − τ``: the sampled estimate of KL(student ‖ teacher)
    per token, what ``distill/reverse_kl`` logs (0-d tensor; 0 when no token is masked in)."""
    keep = mask.bool()
    gap = torch.where(keep, behavior_logprobs - teacher_logprobs, torch.zeros_like(behavior_logprobs))
    return gap.sum() / keep.sum().clamp(min=1)
