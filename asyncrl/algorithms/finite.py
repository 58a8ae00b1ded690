"""What the learner may be fed and what it may produce: finite numbers, or a stopped run.

One non-finite value poisons everything after it: a NaN advantage makes a NaN loss, a
NaN gradient makes every weight NaN after one optimizer step, and a run that "goes on"
from there trains nothing while logging plausible-looking rows. So each quantity is
checked where it is made — rewards and advantages as a group enters the buffer, the loss
and the gradient norm before the optimizer step is taken, the weights after it and
before a checkpoint is written — and the first bad one stops the run, named.

Finite but extreme rewards are refused too (``algorithm.max_abs_reward``): a reward of
1e300 is finite in Python but infinite in the float32 the advantages are computed in,
and the differences between rewards of that size are lost long before that. Refusing is
chosen over rescaling: a reward that large is almost always a bug in the reward
function, and silently standardising it would train on the bug.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor


class NonFiniteError(FloatingPointError):
    """A NaN, an infinity or an out-of-range reward where training needs a finite number.
    Not retried: the same input gives the same value again."""


def check_rewards(rewards: Iterable[float], *, max_abs: float, task_id: str, step: int) -> None:
    """Every reward of one task's group finite and within ±``max_abs``."""
    for reward in rewards:
        if not math.isfinite(reward):
            raise NonFiniteError(f"non-finite reward {reward!r} for task {task_id} (step {step}); the reward "
                                 "function must return a finite float")
        if abs(reward) > max_abs:
            raise NonFiniteError(f"reward {reward!r} for task {task_id} (step {step}) is beyond "
                                 f"algorithm.max_abs_reward={max_abs:g}; advantages are float32, where rewards this "
                                 "large lose their differences or overflow. Rescale the reward, or raise the limit")


def check_advantages(advantages: Tensor, *, estimator: str, task_id: str, step: int) -> None:
    """The advantages of one group (an estimator, a user's included, may divide by zero)."""
    if not bool(torch.isfinite(advantages).all()):
        raise NonFiniteError(f"non-finite advantage from estimator {estimator!r} for task {task_id} (step {step}): "
                             f"{advantages.tolist()}")


def first_nonfinite(values: Mapping[str, Tensor]) -> str | None:
    """The name of the first of ``values`` (scalars, in order) that is not finite; one
    device sync for all of them."""
    if not values:
        return None
    finite = torch.isfinite(torch.stack([v.detach().float().reshape(()) for v in values.values()])).tolist()
    return next((name for name, ok in zip(values, finite) if not ok), None)


def nonfinite_parameters(named: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity. ``isfinite`` per tensor rather than
    a norm: the norm of large finite weights can overflow float32 and would be a false alarm."""
    named = list(named)
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t.detach()).all() for _, t in named]).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]


def count_nonfinite(tensors: Iterable[Tensor]) -> Tensor:
    """How many of ``tensors`` hold a NaN or an infinity, as a tensor on their device: no
    sync, so the train step reads it with its metrics."""
    return torch.stack([~torch.isfinite(t.detach()).all() for t in tensors]).sum().float()
