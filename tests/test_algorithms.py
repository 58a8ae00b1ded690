"""Advantages and losses against numbers worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    aggregate,
    compute_advantages,
    dr_grpo,
    entropy_from_logits,
    get_policy_loss,
    grpo,
    kl_k3,
    policy_loss,
    register_advantage,
    register_policy_loss,
    rloo,
)
from asyncrl.algorithms.losses import POLICY_LOSSES, check_policy_loss
from asyncrl.config import AlgorithmConfig

D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def close(actual: torch.Tensor, expected, atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, t(expected) if not isinstance(expected, torch.Tensor) else expected,
                               atol=atol, rtol=0)


# --------------------------------------------------------------------------- advantages

REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_grpo_by_hand():
    # group 1: mean 0.5, deviations ±0.5, sample var = 4·0.25/3 = 1/3, std = 1/√3
    #          → ±0.5·√3 = ±0.8660254; group 2: zero variance → 0
    a = 0.5 * math.sqrt(3)
    close(grpo(t(REWARDS)), [[a, -a, -a, a], [0, 0, 0, 0]], atol=1e-5)
    # [3, 0, 0]: mean 1, deviations [2, −1, −1], sample var 6/2 = 3 → [2/√3, −1/√3, −1/√3]
    s = 1 / math.sqrt(3)
    close(grpo(t([[3.0, 0.0, 0.0]])), [[2 * s, -s, -s]], atol=1e-5)


def test_dr_grpo_by_hand():
    # R − 0.5 and R − 1
    close(dr_grpo(t(REWARDS)), [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])
    close(dr_grpo(t([[3.0, 0.0, 0.0]])), [[2.0, -1.0, -1.0]])


def test_rloo_by_hand():
    # R=1: others [0,0,1] mean 1/3 → 2/3; R=0: others [1,0,1] mean 2/3 → −2/3
    close(rloo(t(REWARDS)), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0]])
    # [3,0,0]: 3 − (0+0)/2 = 3; 0 − (3+0)/2 = −1.5
    close(rloo(t([[3.0, 0.0, 0.0]])), [[3.0, -1.5, -1.5]])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_single_sample_groups_get_zero(name):
    out = compute_advantages(name, t([[5.0], [2.0]]))
    assert out.shape == (2, 1)
    close(out, [[0.0], [0.0]])
    assert torch.isfinite(out).all()


def test_integer_rewards_are_accepted():
    close(compute_advantages("dr_grpo", torch.tensor([[1, 0]])).to(D), [[0.5, -0.5]])


def test_unknown_estimator_names_valid_ones():
    with pytest.raises(KeyError, match="grpo.*rloo"):
        compute_advantages("nope", t(REWARDS))


def test_user_estimator_is_used_by_name():
    @register_advantage("test_best_minus")
    def best_minus(rewards: torch.Tensor) -> torch.Tensor:
        return rewards - rewards.max(dim=-1, keepdim=True).values

    try:
        close(compute_advantages("test_best_minus", t([[1.0, 3.0]])), [[-2.0, 0.0]])
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("test_best_minus")(best_minus)
    finally:
        del ADVANTAGE_ESTIMATORS["test_best_minus"]


# --------------------------------------------------------------------------- decoupled PPO

# per token: ratio r = π_θ/π_prox, raw weight π_prox/μ, advantage A (ε_low 0.2, ε_high 0.28, C 2)
RATIO = [[1.1, 1.5, 0.5], [1.0, 1.2, 1.5]]
RAW_W = [[1.0, 1.0, 1.0], [3.0, 1.5, 1.0]]
ADV = [[1.0, 1.0, -1.0], [2.0, -1.0, -1.0]]
PROX = [[-1.0, -0.5, -2.0], [-1.2, -0.3, -0.7]]
# L = −w·min(r·A, clip(r, 0.8, 1.28)·A):
#   (0,0) inside:                −1·min(1.1, 1.1)        = −1.1
#   (0,1) r>1.28, A>0 clipped:   −1·min(1.5, 1.28)       = −1.28
#   (0,2) r<0.8,  A<0 clipped:   −1·min(−0.5, −0.8)      = +0.8
#   (1,0) w=min(3,2)=2:          −2·min(2·1, 2·1)        = −4
#   (1,1) w=1.5, inside:         −1.5·min(−1.2, −1.2)    = +1.8
#   (1,2) r>1.28 but A<0 → the unclipped term is smaller: −1·min(−1.5, −1.28) = +1.5
LOSS_TOKENS = [[-1.1, -1.28, 0.8], [-4.0, 1.8, 1.5]]
# dL/dlogπ_θ = −w·r·A on the unclipped branch, 0 where clipped; token_mean divides by 6
GRAD = [[-1.1 / 6, 0.0, 0.0], [-4.0 / 6, 1.8 / 6, 1.5 / 6]]


def ppo_inputs():
    prox = t(PROX)
    logprobs = (prox + t(RATIO).log()).requires_grad_(True)
    behavior = prox - t(RAW_W).log()
    return logprobs, behavior, t(ADV), torch.ones(2, 3, dtype=torch.bool), prox


def test_decoupled_ppo_by_hand():
    logprobs, behavior, adv, mask, prox = ppo_inputs()
    loss, m = policy_loss(logprobs, behavior, adv, mask, proximal_logprobs=prox)
    close(loss, (-1.1 - 1.28 + 0.8 - 4.0 + 1.8 + 1.5) / 6)  # = −2.28/6 = −0.38
    close(loss, -0.38)
    loss.backward()
    close(logprobs.grad, GRAD)
    close(m["clip_fraction"], 2 / 6)  # (0,1) and (0,2); (1,2) is outside the range but unclipped
    close(m["is_weight_mean"], (1 + 1 + 1 + 2 + 1.5 + 1) / 6)  # = 1.25
    close(m["is_truncated_fraction"], 1 / 6)
    close(m["ratio_mean"], (1.1 + 1.5 + 0.5 + 1.0 + 1.2 + 1.5) / 6)  # = 6.8/6
    assert all(not v.requires_grad and v.ndim == 0 for v in m.values())
    # seq_mean: row means −1.58/3 and −0.7/3 → (−0.52667 − 0.23333)/2 = −0.38: equal lengths agree
    loss_seq, _ = policy_loss(logprobs, behavior, adv, mask, proximal_logprobs=prox,
                              config=AlgorithmConfig(aggregation="seq_mean"))
    close(loss_seq, -0.38)


def test_approx_kl_is_k3_against_proximal():
    logprobs, behavior, adv, mask, prox = ppo_inputs()
    _, m = policy_loss(logprobs, behavior, adv, mask, proximal_logprobs=prox)
    # k3 with d = log π_prox − log π_θ = −log r: 1/r + log r − 1 per token
    expected = sum(1 / r + math.log(r) - 1 for row in RATIO for r in row) / 6
    close(m["approx_kl"], expected)


def test_positive_advantage_inside_clip_pushes_logprob_up():
    logprobs = t([[-1.0]]).requires_grad_(True)
    loss, _ = policy_loss(logprobs, t([[-1.05]]), t([0.7]), torch.ones(1, 1))
    loss.backward()
    # r = e^0.05 ≈ 1.0513 inside [0.8, 1.28]: dL/dlogπ = −r·A < 0, so a descent step raises logπ
    close(logprobs.grad, [[-math.exp(0.05) * 0.7]])
    assert logprobs.grad.item() < 0


def test_masked_tokens_contribute_nothing():
    logprobs, behavior, adv, _, prox = ppo_inputs()
    mask = t([[1, 1, 0], [1, 0, 0]])  # 0 = tool tokens / padding
    loss, m = policy_loss(logprobs, behavior, adv, mask, proximal_logprobs=prox)
    close(loss, (-1.1 - 1.28 - 4.0) / 3)  # = −6.38/3 = −2.126667
    loss.backward()
    grad = logprobs.grad.clone()
    close(grad, [[-1.1 / 3, 0.0, 0.0], [-4.0 / 3, 0.0, 0.0]])

    hole = ~mask.bool()
    poisoned = logprobs.detach().masked_fill(hole, float("nan")).requires_grad_(True)
    loss2, m2 = policy_loss(poisoned, behavior.masked_fill(hole, float("inf")), adv.masked_fill(hole, float("nan")),
                            mask, proximal_logprobs=prox.masked_fill(hole, float("-inf")))
    loss2.backward()
    assert torch.equal(loss2, loss.detach())
    assert torch.equal(poisoned.grad, grad)
    assert (poisoned.grad[hole] == 0).all()
    for key in m:
        assert torch.equal(m2[key], m[key]), key


def test_bypass_is_plain_ppo_against_behavior():
    behavior = t([[-1.0, -0.5, -2.0], [-1.2, -0.3, -0.7]])
    r = t([[1.1, 1.5, 0.7], [0.5, 1.0, 1.4]])
    logprobs = (behavior + r.log()).requires_grad_(True)
    adv = t([1.0, -2.0])  # (B,): one advantage per trajectory
    mask = torch.ones(2, 3)
    bypass, m = policy_loss(logprobs, behavior, adv, mask)
    explicit, _ = policy_loss(logprobs, behavior, adv, mask, proximal_logprobs=behavior)
    assert torch.equal(bypass, explicit)
    close(m["is_weight_mean"], 1.0)
    close(m["is_truncated_fraction"], 0.0)
    # A=+1: −min(1.1, 1.1) = −1.1; −min(1.5, 1.28) = −1.28; −min(0.7, 0.8) = −0.7
    # A=−2: −min(−1.0, −1.6) = 1.6; −min(−2, −2) = 2.0; −min(−2.8, −2.56) = 2.8
    close(bypass, (-1.1 - 1.28 - 0.7 + 1.6 + 2.0 + 2.8) / 6)  # = 3.32/6
    ratio = torch.exp(logprobs - behavior)
    a = adv[:, None]
    reference = -torch.min(ratio * a, ratio.clamp(0.8, 1.28) * a).mean()
    close(bypass, reference)


def test_is_cap_must_be_positive():
    logprobs, behavior, adv, mask, _ = ppo_inputs()
    with pytest.raises(ValueError, match="is_cap"):
        policy_loss(logprobs, behavior, adv, mask, config=AlgorithmConfig.model_construct(is_cap=0.0))


# --------------------------------------------------------------------------- aggregation

def test_token_mean_vs_seq_mean_unequal_lengths():
    values = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    close(aggregate(values, mask, "token_mean"), 2.5)  # (1+2+3+4)/4
    close(aggregate(values, mask, "seq_mean"), 3.0)  # (2 + 4)/2
    # the PPO example with mask [[1,1,0],[1,0,0]]: token (−1.1−1.28−4)/3; seq ((−1.1−1.28)/2 − 4)/2
    logprobs, behavior, adv, _, prox = ppo_inputs()
    pmask = t([[1, 1, 0], [1, 0, 0]])
    loss_seq, _ = policy_loss(logprobs, behavior, adv, pmask, proximal_logprobs=prox,
                              config=AlgorithmConfig(aggregation="seq_mean"))
    close(loss_seq, (-1.19 - 4.0) / 2)  # = −2.595


def test_aggregate_skips_empty_rows_and_guards_empty_masks():
    values = t([[1.0, 3.0], [float("nan"), float("inf")]])
    mask = t([[1, 1], [0, 0]])
    close(aggregate(values, mask, "seq_mean"), 2.0)  # the empty row is not a 0 in the mean
    close(aggregate(values, mask, "token_mean"), 2.0)
    for mode in ("token_mean", "seq_mean"):
        close(aggregate(values, torch.zeros(2, 2), mode), 0.0)


def test_unknown_names_list_valid_ones():
    with pytest.raises(KeyError, match="seq_mean.*token_mean"):
        aggregate(t([[1.0]]), t([[1.0]]), "sum")
    with pytest.raises(KeyError, match="decoupled_ppo"):
        get_policy_loss("nope")
    assert get_policy_loss("decoupled_ppo") is policy_loss


# --------------------------------------------------------------------------- KL, entropy

def test_kl_k3():
    # lp = 0, ref = log 2: e^{log 2} − log 2 − 1 = 2 − 0.693147 − 1 = 0.306853
    close(kl_k3(t([[0.0]]), t([[math.log(2)]])), [[1 - math.log(2)]])
    x = torch.randn(4, 7, dtype=D)
    assert torch.equal(kl_k3(x, x), torch.zeros_like(x))
    assert (kl_k3(x, torch.randn(4, 7, dtype=D)) >= 0).all()


def test_entropy_from_logits():
    close(entropy_from_logits(torch.zeros(2, 3, 5, dtype=D)), torch.full((2, 3), math.log(5), dtype=D))
    # large and −inf logits: [1000, 1000, −inf] is uniform over 2 → log 2; one-hot → 0
    close(entropy_from_logits(t([[[1000.0, 1000.0, -math.inf], [0.0, -math.inf, -math.inf]]])),
          [[math.log(2), 0.0]])


def test_module_function_names_a_user_estimator():
    from asyncrl.algorithms import compute_advantages

    # a user's function, named module:function in the config, with no registration
    out = compute_advantages("asyncrl.algorithms.advantages:dr_grpo", torch.tensor([[1.0, 0.0]]))
    assert out.tolist() == [[0.5, -0.5]]


def test_naive_objective_drops_the_importance_weight_but_reports_it():
    logprobs, behavior, adv, mask, prox = ppo_inputs()
    loss, m = policy_loss(logprobs, behavior, adv, mask, proximal_logprobs=prox,
                          config=AlgorithmConfig(is_correction=False))
    # as test_decoupled_ppo_by_hand with w = 1: (1,0) −min(2, 2) = −2; (1,1) −min(−1.2, −1.2) = +1.2
    close(loss, (-1.1 - 1.28 + 0.8 - 2.0 + 1.2 + 1.5) / 6)
    loss.backward()
    close(logprobs.grad, [[-1.1 / 6, 0.0, 0.0], [-2.0 / 6, 1.2 / 6, 1.5 / 6]])
    # the weights it did not apply are still described: truncated mean, raw moments
    close(m["is_weight_mean"], 1.25)
    close(m["is_raw_weight_mean"], (1 + 1 + 1 + 3 + 1.5 + 1) / 6)
    close(m["is_raw_weight_sq_mean"], (1 + 1 + 1 + 9 + 2.25 + 1) / 6)



# --------------------------------------------------------------------------- the loss registry

def test_a_registered_loss_gets_the_tensors_and_the_algorithm_config():
    """The contract (``PolicyLossFn``): four tensors, ``proximal_logprobs`` and ``config``,
    whatever the loss; a loss reads its own hyperparameters off the config."""
    seen = {}

    @register_policy_loss("test_contract_scaled")
    def scaled(logprobs, behavior_logprobs, advantages, mask, *, proximal_logprobs, config):
        seen["config"] = config
        loss, metrics = policy_loss(logprobs, behavior_logprobs, advantages, mask,
                                    proximal_logprobs=proximal_logprobs, config=config)
        return 2 * loss, metrics

    try:
        logprobs, behavior, adv, mask, prox = ppo_inputs()
        cfg = AlgorithmConfig(policy_loss="test_contract_scaled")
        loss, _ = get_policy_loss(cfg.policy_loss)(logprobs, behavior, adv, mask, proximal_logprobs=prox, config=cfg)
        close(loss, 2 * -0.38)
        assert seen["config"] is cfg
    finally:
        POLICY_LOSSES.pop("test_contract_scaled", None)


def old_style_loss(logprobs, behavior_logprobs, advantages, mask, *, proximal_logprobs=None, clip_low=0.2):
    raise AssertionError("never called")


def test_a_loss_that_cannot_take_the_call_is_refused_before_training():
    with pytest.raises(TypeError, match="proximal_logprobs, config"):
        register_policy_loss("test_contract_old_style")(old_style_loss)
    assert "test_contract_old_style" not in POLICY_LOSSES
    try:  # named module:function, as pre-flight and the learner resolve algorithm.policy_loss
        with pytest.raises(TypeError, match="test_algorithms:old_style_loss"):
            get_policy_loss("test_algorithms:old_style_loss")
    finally:
        POLICY_LOSSES.pop("test_algorithms:old_style_loss", None)
    check_policy_loss(lambda *args, **kwargs: None, "forwarding")  # *args, **kwargs take anything
