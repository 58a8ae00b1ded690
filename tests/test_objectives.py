"""GSPO, CISPO, IcePop and the ratio-band masks (``asyncrl/algorithms/objectives.py``)
against numbers worked out by hand (arithmetic in the comments), plus what every
objective must share: NaN-proof masked positions, use by name, a short training run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from asyncrl.algorithms import cispo_loss, get_policy_loss, gspo_loss, icepop_loss, policy_loss
from asyncrl.cli import main
from asyncrl.config import AlgorithmConfig, load_config

D = torch.float64
OBJECTIVES = {"decoupled_ppo": policy_loss, "gspo": gspo_loss, "cispo": cispo_loss, "icepop": icepop_loss}
LEVELS = ("none", "token", "sequence", "geometric")


def t(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=D)


def close(actual: torch.Tensor, expected, atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, expected if isinstance(expected, torch.Tensor) else t(expected),
                               atol=atol, rtol=0)


def inputs(log_r, log_k, prox):
    """π_θ = π_prox · r (carrying the gradient) and μ = π_prox / k, from per-token logs."""
    prox = t(prox)
    logprobs = (prox + t(log_r)).requires_grad_(True)
    return logprobs, prox - t(log_k), prox


# --------------------------------------------------------------------------- GSPO

L3 = math.log(3.0)
# row 0: every token's log r = 0.3, log k = 0; row 1: log r = [0.1, −0.1, ·], log k = [ln 3, ln 3, ·],
# its third token masked (tool output)
GSPO_MASK = t([[1, 1, 1], [1, 1, 0]])
GSPO_CFG = {"gspo_clip_low": 0.1, "gspo_clip_high": 0.2}


def gspo_inputs():
    return inputs([[0.3, 0.3, 0.3], [0.1, -0.1, 0.0]], [[0.0, 0.0, 0.0], [L3, L3, 0.0]],
                  [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])


def test_gspo_by_hand():
    logprobs, behavior, prox = gspo_inputs()
    adv = t([1.0, -0.5])
    loss, m = gspo_loss(logprobs, behavior, adv, GSPO_MASK, proximal_logprobs=prox,
                        config=AlgorithmConfig(**GSPO_CFG))
    # row 0: s = exp(mean(0.3, 0.3, 0.3)) = e^0.3 = 1.34986 > 1.2 with A = 1 > 0: clipped to 1.2;
    #        w = min(exp(mean(0, 0, 0)), 2) = 1 → each token −1·1.2 = −1.2, gradient 0
    # row 1: s = exp(mean(0.1, −0.1)) = 1, inside; w = min(exp(mean(ln 3, ln 3)), 2) = min(3, 2) = 2
    #        → each token −2·(1·−0.5) = +1.0, gradient −w·s·A = +1.0
    # token mean over 5 tokens: (3·−1.2 + 2·1.0)/5 = −1.6/5 = −0.32
    close(loss, -0.32)
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0, 0.0], [1.0 / 5, 1.0 / 5, 0.0]])
    close(m["clip_fraction"], 3 / 5)  # the clipped sequence's tokens
    close(m["ratio_mean"], (3 * math.exp(0.3) + 2 * 1.0) / 5)
    close(m["is_weight_mean"], (3 * 1.0 + 2 * 2.0) / 5)  # = 1.4
    close(m["is_truncated_fraction"], 2 / 5)
    close(m["is_raw_weight_mean"], (3 * 1.0 + 2 * 3.0) / 5)  # token-level k, untruncated: 9/5
    assert all(not v.requires_grad and v.ndim == 0 for v in m.values())


def test_gspo_seq_mean_is_the_sequence_objective():
    logprobs, behavior, prox = gspo_inputs()
    adv = t([1.0, -0.5])
    cfg = AlgorithmConfig(aggregation="seq_mean", **GSPO_CFG)
    loss, _ = gspo_loss(logprobs, behavior, adv, GSPO_MASK, proximal_logprobs=prox, config=cfg)
    # per-sequence means −1.2 and +1.0, then their mean: −0.1; row 1's gradient is
    # (1/G)·(1/|s|)·(−w·s·A) = ½·½·1.0 = 0.25 per token
    close(loss, -0.1)
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]])
    # GSPO's own sequence form, s_i with its gradient, −(1/G)·Σ_i w_i·min(s_i·A_i, clip(s_i)·A_i)
    lp = logprobs.detach().clone().requires_grad_(True)
    m = GSPO_MASK.bool()
    s = torch.exp(torch.where(m, lp - prox, 0.0).sum(-1) / m.sum(-1))
    w = torch.tensor([1.0, 2.0], dtype=D)
    reference = -(w * torch.minimum(s * adv, s.clamp(0.9, 1.2) * adv)).mean()
    reference.backward()
    close(loss.detach(), reference.detach())
    close(logprobs.grad, lp.grad)


def test_gspo_default_ranges_are_the_papers():
    cfg = AlgorithmConfig()
    assert (cfg.gspo_clip_low, cfg.gspo_clip_high) == (3e-4, 4e-4)
    logprobs, behavior, prox = gspo_inputs()
    loss, m = gspo_loss(logprobs, behavior, t([1.0, -0.5]), GSPO_MASK, proximal_logprobs=prox, config=cfg)
    # row 0 clipped at 1.0004: 3·−1.0004; row 1 s = 1 inside: 2·+1.0 → (−3.0012 + 2)/5
    close(loss, (-3 * 1.0004 + 2.0) / 5)
    close(m["clip_fraction"], 3 / 5)


# --------------------------------------------------------------------------- CISPO

# r = π_θ/π_prox: row 0 [1.5, 1.0, 0.5], row 1 [1.1, 2.0, 0.9]; k = π_prox/μ: row 0 all 1, row 1 [1, 3, 1.5]
CISPO_R = [[1.5, 1.0, 0.5], [1.1, 2.0, 0.9]]
CISPO_K = [[1.0, 1.0, 1.0], [1.0, 3.0, 1.5]]
CISPO_PROX = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -2.0]]


def cispo_inputs():
    return inputs(t(CISPO_R).log(), t(CISPO_K).log(), CISPO_PROX)


def test_cispo_by_hand():
    logprobs, behavior, prox = cispo_inputs()
    adv = t([1.0, -2.0])
    mask = torch.ones(2, 3)
    loss, m = cispo_loss(logprobs, behavior, adv, mask, proximal_logprobs=prox)
    # clip(r, 0.8, 1.28): row 0 [1.28, 1.0, 0.8], row 1 [1.1, 1.28, 0.9]; w = min(k, 2): row 1 [1, 2, 1.5]
    lp = [[-1.0 + math.log(1.5), -2.0, -0.5 + math.log(0.5)], [-1.0 + math.log(1.1), -1.0 + math.log(2.0),
                                                               -2.0 + math.log(0.9)]]
    # L_t = −w·sg(clip r)·A·log π_θ
    per_token = [-1.28 * 1 * lp[0][0], -1.0 * 1 * lp[0][1], -0.8 * 1 * lp[0][2],
                 -1.1 * -2 * lp[1][0], -2 * 1.28 * -2 * lp[1][1], -1.5 * 0.9 * -2 * lp[1][2]]
    close(loss, sum(per_token) / 6)
    loss.backward()
    # dL/dlog π_θ = −w·clip(r)·A / 6: the token with r = 1.5 > 1.28 and A > 0 still learns
    # (PPO's clip would give it 0), its weight bounded at 1.28
    close(logprobs.grad, [[-1.28 / 6, -1.0 / 6, -0.8 / 6], [2.2 / 6, 2 * 1.28 * 2 / 6, 1.5 * 0.9 * 2 / 6]])
    close(m["clip_fraction"], 3 / 6)  # r = 1.5, 0.5 and 2.0 were clipped
    close(m["is_weight_mean"], (1 + 1 + 1 + 1 + 2 + 1.5) / 6)
    close(m["is_truncated_fraction"], 1 / 6)
    ppo_loss, _ = policy_loss(logprobs, behavior, adv, mask, proximal_logprobs=prox)
    ppo_grad = torch.autograd.grad(ppo_loss, logprobs)[0]
    assert ppo_grad[0, 0] == 0 and logprobs.grad[0, 0] != 0


def test_cispo_first_step_gradient_is_decoupled_ppos():
    # r = 1 (π_θ = π_prox, the first optimizer step of a batch): −w·A·∇log π_θ for both
    torch.manual_seed(0)
    prox = torch.randn(3, 5, dtype=D) - 2
    behavior = prox - 0.5 * torch.randn(3, 5, dtype=D)
    adv, mask = torch.randn(3, dtype=D), torch.rand(3, 5) > 0.3
    grads = []
    for fn in (cispo_loss, policy_loss):
        logprobs = prox.clone().requires_grad_(True)
        fn(logprobs, behavior, adv, mask, proximal_logprobs=prox)[0].backward()
        grads.append(logprobs.grad)
    close(grads[0], grads[1])


# --------------------------------------------------------------------------- masks

# r = 1 everywhere, so every objective's term is w·A; k by row: [1, 3, 0.4], [1.5, 1.5, 1.5], [0.3, 0.3, 1]
MASK_K = [[1.0, 3.0, 0.4], [1.5, 1.5, 1.5], [0.3, 0.3, 1.0]]
MASK_ADV = [1.0, 2.0, -1.0]


def mask_inputs():
    return inputs(torch.zeros(3, 3), t(MASK_K).log(), [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0], [-0.2, -1.1, -2.2]])


# min(k, 2): rows [1, 2, 0.4], [1.5, 1.5, 1.5], [0.3, 0.3, 1]; band [0.5, 2]:
# token: keeps row 0's first token, all of row 1, row 2's last → 4 of 9 dropped
# sequence (product): 1.2 kept, 3.375 dropped, 0.09 dropped → 6 of 9
# geometric (cube root of the product): 1.063 kept, 1.5 kept, 0.448 dropped → 3 of 9
MASK_CASES = {
    "none": ([[1, 2, 0.4], [1.5, 1.5, 1.5], [0.3, 0.3, 1]], None),
    "token": ([[1, 0, 0], [1.5, 1.5, 1.5], [0, 0, 1]], 4 / 9),
    "sequence": ([[1, 2, 0.4], [0, 0, 0], [0, 0, 0]], 6 / 9),
    "geometric": ([[1, 2, 0.4], [1.5, 1.5, 1.5], [0, 0, 0]], 3 / 9),
}


@pytest.mark.parametrize("level", LEVELS)
def test_ratio_band_masks_by_hand(level):
    weights, dropped = MASK_CASES[level]
    logprobs, behavior, prox = mask_inputs()
    loss, m = policy_loss(logprobs, behavior, t(MASK_ADV), torch.ones(3, 3), proximal_logprobs=prox,
                          config=AlgorithmConfig(is_mask=level))
    # L = −Σ w·A / 9 (the dropped tokens stay in the normaliser); dL/dlog π_θ = −w·A/9
    w = t(weights)
    close(loss, -(w * t(MASK_ADV)[:, None]).sum() / 9)
    loss.backward()
    close(logprobs.grad, -w * t(MASK_ADV)[:, None] / 9)
    if dropped is None:
        assert "is_masked_fraction" not in m
    else:
        close(m["is_masked_fraction"], dropped)
    # e.g. token: −(1·1 + 2·4.5 − 1·1)/9 = −1.0; geometric: −(3.4 + 9)/9
    expected = {"none": -10.8 / 9, "token": -1.0, "sequence": -3.4 / 9, "geometric": -12.4 / 9}[level]
    close(loss, expected)


def test_band_masks_compose_with_every_objective():
    logprobs, behavior, prox = mask_inputs()
    for name, fn in OBJECTIVES.items():
        _, m = fn(logprobs, behavior, t(MASK_ADV), torch.ones(3, 3), proximal_logprobs=prox,
                  config=AlgorithmConfig(is_mask="sequence"))
        close(m["is_masked_fraction"], 6 / 9)  # the ratio band judges the data, whatever the objective
        assert name == "decoupled_ppo" or "clip_fraction" in m


def test_bands_are_validated():
    with pytest.raises(ValueError, match="algorithm.is_mask_low=2.0 must be below algorithm.is_mask_high=2.0"):
        AlgorithmConfig(is_mask_low=2.0)
    with pytest.raises(ValueError, match="icepop_low"):
        AlgorithmConfig(icepop_low=5.0, icepop_high=0.5)
    with pytest.raises(ValueError):
        AlgorithmConfig(is_mask="bogus")


# --------------------------------------------------------------------------- IcePop


def test_icepop_by_hand():
    logprobs, behavior, prox = mask_inputs()
    loss, m = icepop_loss(logprobs, behavior, t(MASK_ADV), torch.ones(3, 3), proximal_logprobs=prox)
    # band [0.5, 5], weight k untruncated inside: row 0 [1, 3, 0 (0.4 < 0.5)], row 1 [1.5]·3, row 2 [0, 0, 1]
    # L = −(1·(1 + 3) + 2·4.5 − 1·1)/9 = −12/9
    close(loss, -12 / 9)
    loss.backward()
    close(logprobs.grad, [[-1 / 9, -3 / 9, 0], [-3 / 9, -3 / 9, -3 / 9], [0, 0, 1 / 9]])
    close(m["icepop_masked_fraction"], 3 / 9)
    close(m["is_weight_mean"], (1 + 3 + 4.5 + 1) / 9)


def test_icepop_is_masked_is_without_truncation():
    # decoupled PPO with the token band [α, β] and a cap at β applies the same weights
    logprobs, behavior, prox = mask_inputs()
    adv = t(MASK_ADV)
    for proximal in (prox, None):  # bypass too: the band then compares sg(π_θ) with μ, the weight is 1
        ice, m = icepop_loss(logprobs, behavior, adv, torch.ones(3, 3), proximal_logprobs=proximal)
        ppo, n = policy_loss(logprobs, behavior, adv, torch.ones(3, 3), proximal_logprobs=proximal,
                             config=AlgorithmConfig(is_mask="token", is_mask_low=0.5, is_mask_high=5.0, is_cap=5.0))
        close(ice, ppo)
        close(m["icepop_masked_fraction"], n["is_masked_fraction"])
        close(m["icepop_masked_fraction"], 3 / 9)


def test_bypass_masks_compare_the_learners_logprob_with_mu():
    logprobs, behavior, _ = mask_inputs()
    # no π_prox: k is exp(sg(log π_θ) − log μ), the same k as above since π_θ = π_prox here
    _, m = policy_loss(logprobs, behavior, t(MASK_ADV), torch.ones(3, 3), config=AlgorithmConfig(is_mask="token"))
    close(m["is_masked_fraction"], 4 / 9)


# --------------------------------------------------------------------------- shared contract


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("level", LEVELS)
def test_masked_positions_cannot_leak(name, level):
    fn = OBJECTIVES[name]
    cfg = AlgorithmConfig(is_mask=level)
    logprobs, behavior, prox = cispo_inputs()
    adv = t([[1.0, -2.0, 0.5], [0.3, -1.0, 2.0]])  # per-token advantages
    mask = t([[1, 1, 0], [1, 0, 0]])
    loss, m = fn(logprobs, behavior, adv, mask, proximal_logprobs=prox, config=cfg)
    loss.backward()
    hole = ~mask.bool()
    poisoned = logprobs.detach().masked_fill(hole, float("nan")).requires_grad_(True)
    loss2, m2 = fn(poisoned, behavior.masked_fill(hole, float("inf")), adv.masked_fill(hole, float("nan")), mask,
                   proximal_logprobs=prox.masked_fill(hole, float("-inf")), config=cfg)
    loss2.backward()
    assert torch.equal(loss2, loss.detach())
    assert torch.equal(poisoned.grad, logprobs.grad)
    assert (poisoned.grad[hole] == 0).all()
    assert m2.keys() == m.keys() and all(torch.equal(m2[k], m[k]) for k in m), name
    # an all-masked batch (a tool-only micro-batch) gives 0, not NaN
    empty, _ = fn(poisoned, behavior, adv, torch.zeros(2, 3), proximal_logprobs=prox, config=cfg)
    assert empty.item() == 0


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batches_weighed_by_their_share_take_the_whole_batchs_step(name, aggregation):
    # the learner splits a batch by rows and weighs each part's loss by its share of the
    # batch's tokens (token_mean) or non-empty rows (seq_mean): a sequence-level objective
    # must keep that exact, since no row is ever split
    fn, cfg = OBJECTIVES[name], AlgorithmConfig(aggregation=aggregation, is_mask="geometric", is_mask_high=1.5)
    torch.manual_seed(1)
    prox = torch.randn(5, 4, dtype=D) - 1
    behavior = prox - 0.4 * torch.randn(5, 4, dtype=D)
    start = prox + 0.2 * torch.randn(5, 4, dtype=D)
    adv, mask = torch.randn(5, dtype=D), torch.rand(5, 4) > 0.3
    whole = start.clone().requires_grad_(True)
    fn(whole, behavior, adv, mask, proximal_logprobs=prox, config=cfg)[0].backward()
    parts = start.clone().requires_grad_(True)
    count = (lambda m: m.sum()) if aggregation == "token_mean" else (lambda m: (m.sum(-1) > 0).sum())
    for rows in (slice(0, 2), slice(2, 5)):
        loss, _ = fn(parts[rows], behavior[rows], adv[rows], mask[rows], proximal_logprobs=prox[rows], config=cfg)
        (loss * count(mask[rows]) / count(mask)).backward()
    close(parts.grad, whole.grad, atol=1e-12)


@pytest.mark.parametrize("name", ["gspo", "cispo", "icepop"])
def test_usable_by_name_and_through_the_config(name):
    assert get_policy_loss(name) is OBJECTIVES[name]
    cfg = load_config("examples/countdown/async.yaml", [f"algorithm.policy_loss={name}", "algorithm.is_mask=geometric"])
    assert cfg.algorithm.policy_loss == name and cfg.algorithm.is_mask == "geometric"
    logprobs, behavior, prox = cispo_inputs()
    loss, metrics = get_policy_loss(cfg.algorithm.policy_loss)(logprobs, behavior, t([1.0, -2.0]), torch.ones(2, 3),
                                                                proximal_logprobs=prox, config=cfg.algorithm)
    assert torch.isfinite(loss) and "is_masked_fraction" in metrics


@pytest.mark.parametrize("overrides", [["algorithm.policy_loss=gspo"], ["algorithm.policy_loss=cispo"],
                                       ["algorithm.policy_loss=icepop"],
                                       ["algorithm.is_mask=geometric", "algorithm.bypass=true"]])
def test_a_short_run_trains_with_each(tmp_path, policy_dir, overrides):  # ~1 s each
    out = tmp_path / "run"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "total_steps=2", "batch_size=2", "group_size=4", "eval_every=0", "eval.num_tasks=4",
                 "eval.samples_per_task=1", "algorithm.filter_zero_variance=false", "task.num_train=64",
                 "task.num_validation=8", *overrides]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert len(trained) == 2 and all(math.isfinite(r["actor/loss"]) for r in trained)
    key = "actor/icepop_masked_fraction" if "icepop" in overrides[0] else "actor/clip_fraction"
    assert all(key in r for r in trained)
    if "algorithm.is_mask=geometric" in overrides:
        assert all(0 <= r["actor/is_masked_fraction"] <= 1 for r in trained)
