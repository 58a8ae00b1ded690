"""Broken user code for ``tests/bad_inputs.py``: reward functions, an estimator and a loss
that a user might write by mistake, each named in a run's config as ``bad_rewards:name``."""

from __future__ import annotations

import time

import torch

from asyncrl.algorithms.losses import policy_loss

CALLS = {"loss": 0}


def raises(task, response: str) -> float:
    raise ValueError("the reward service is down")


def hangs(task, response: str) -> float:
    time.sleep(3600)
    return 0.0


def nan(task, response: str) -> float:
    return float("nan")


def huge(task, response: str) -> float:
    """Finite in Python, infinite in float32."""
    return 1e300 if len(response) % 2 else -1e300


def text(task, response: str) -> str:
    return "1.0"


def nan_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """Standardises without an epsilon: a group of equal rewards divides 0 by 0."""
    centered = rewards - rewards.mean(-1, keepdim=True)
    return centered / centered.abs().amax(-1, keepdim=True)


def nan_loss_at_step_2(*args, **kwargs):
    """The decoupled PPO loss, NaN from its second call (one micro-batch a step)."""
    CALLS["loss"] += 1
    loss, metrics = policy_loss(*args, **kwargs)
    return (loss * float("nan"), metrics) if CALLS["loss"] >= 2 else (loss, metrics)
