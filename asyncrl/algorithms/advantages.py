"""Advantage estimators on the rollout side: group-relative ones compare the rewards of the
n samples of each task with each other, so no value network is needed; ``gae``'s
advantages are per token and need a critic's values, so the learner computes them when
the batch trains (``algorithm.advantage: gae``, ``asyncrl/learner/critic.py``) and its
estimator here passes each sample's outcome reward through to it.

Every estimator maps rewards ``(G, n)`` (G groups, n samples per task) to advantages
``(G, n)``; a group whose samples all scored the same gets advantage 0 everywhere, which
is how the orchestrator recognises (and may drop) groups that carry no signal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from asyncrl.plugins import load_named

AdvantageFn = Callable[..., Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
GROUP_RELATIVE: set[str] = set()
"""Estimators that compare a sample with the others of its group: with one sample per
group they give 0 everywhere, so ``group_size=1`` trains nothing and is refused."""

_T = TypeVar("_T")


def resolve(registry: dict[str, _T], name: str, kind: str) -> _T:
    """The one place a name becomes a function; an unknown name lists the valid ones.

    ``module:function`` names a user's function without registering it first."""
    if name not in registry and ":" in name:
        try:
            registry[name] = load_named(name, key=kind)
        except ValueError as exc:
            raise KeyError(str(exc)) from None
    try:
        return registry[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))} "
                       "or module:function") from None


def register_advantage(name: str, *, group_relative: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator adding an estimator ``fn(rewards (G, n), **kwargs) -> (G, n)`` under ``name``.

    A name that is already taken is refused, so a plugin cannot silently shadow a built-in.
    ``group_relative``: it needs n ≥ 2 (see :data:`GROUP_RELATIVE`).
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        if group_relative:
            GROUP_RELATIVE.add(name)
        return fn

    return decorator


def compute_advantages(name: str, rewards: Tensor, **kwargs: object) -> Tensor:
    """Advantages ``(G, n)`` of rewards ``(G, n)`` under the estimator registered as ``name``."""
    return resolve(ADVANTAGE_ESTIMATORS, name, "advantage estimator")(_as_groups(rewards), **kwargs)


def _as_groups(rewards: Tensor) -> Tensor:
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be (G, n), got shape {tuple(rewards.shape)}")
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def _centered(rewards: Tensor) -> Tensor:
    """R − mean_g, (G, n)."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


@register_advantage("grpo", group_relative=True)
def grpo(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: ``(R − mean_g) / (std_g + eps)``. rewards (G, n) -> (G, n).

    std_g is the sample (Bessel-corrected, ``unbiased=True``) standard deviation, as in
    TRL and verl. With n == 1 it is undefined, and one sample has nothing to be compared
    with, so the advantage is 0.
    """
    rewards = _as_groups(rewards)
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards)
    std = rewards.std(dim=-1, keepdim=True, unbiased=True)
    return _centered(rewards) / (std + eps)


@register_advantage("dr_grpo", group_relative=True)
def dr_grpo(rewards: Tensor) -> Tensor:
    """Dr. GRPO: ``R − mean_g``. rewards (G, n) -> (G, n).

    No division by std_g: that division up-weights groups of nearly equal rewards (too easy
    or too hard tasks), a bias Dr. GRPO removes.
    """
    return _centered(_as_groups(rewards))


@register_advantage("rloo", group_relative=True)
def rloo(rewards: Tensor) -> Tensor:
    """RLOO: R minus the mean of the group's other n − 1 rewards. rewards (G, n) -> (G, n).

    Leaving the sample out keeps the baseline independent of it (unbiased). Algebraically
    ``R − (sum − R)/(n − 1) = n/(n − 1) · (R − mean_g)``. With n == 1 there are no others: 0.
    """
    rewards = _as_groups(rewards)
    n = rewards.shape[-1]
    if n < 2:
        return torch.zeros_like(rewards)
    return _centered(rewards) * (n / (n - 1))


@register_advantage("gae")
def outcome(rewards: Tensor) -> Tensor:
    """``gae``'s rollout side: the rewards themselves, unchanged. rewards (G, n) -> (G, n).

    What a group carries to the learner is then each sample's outcome reward, which the
    learner puts on the sample's last model token (``learner/batch.py``) and turns into
    per-token advantages with the critic's values (``algorithms/gae.py``). Not group-relative:
    one sample per task trains."""
    return _as_groups(rewards).clone()
