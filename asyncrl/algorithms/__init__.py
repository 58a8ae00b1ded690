"""Advantage estimators and policy losses: pure functions on tensors, chosen by name."""

from asyncrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo,
    grpo,
    register_advantage,
    resolve,
    rloo,
)
from asyncrl.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossFn,
    aggregate,
    entropy_from_logits,
    get_policy_loss,
    kl_k3,
    policy_loss,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "aggregate",
    "compute_advantages",
    "dr_grpo",
    "entropy_from_logits",
    "get_policy_loss",
    "grpo",
    "kl_k3",
    "policy_loss",
    "register_advantage",
    "register_policy_loss",
    "resolve",
    "rloo",
]
