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
from asyncrl.algorithms.gae import explained_variance, gae, token_rewards, value_loss, whiten
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
    token_logprobs,
)
from asyncrl.algorithms.objectives import cispo_loss, gspo_loss, icepop_loss  # registers them

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "aggregate",
    "cispo_loss",
    "compute_advantages",
    "dr_grpo",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "get_policy_loss",
    "grpo",
    "gspo_loss",
    "icepop_loss",
    "kl_k3",
    "policy_loss",
    "register_advantage",
    "register_policy_loss",
    "resolve",
    "rloo",
    "token_logprobs",
    "token_rewards",
    "value_loss",
    "whiten",
]
