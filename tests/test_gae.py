"""GAE, token rewards, whitening, the clipped value loss and explained variance against
numbers worked out by hand (arithmetic in the comments), and GAE against the explicit sum
A_k = Σ_l (γλ)^l δ_{k+l} on random inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncrl.algorithms import explained_variance, gae, token_rewards, value_loss, whiten
from asyncrl.types import Step, Trajectory

D = torch.float64
NAN = math.nan


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, expected if isinstance(expected, torch.Tensor) else t(expected),
                               atol=atol, rtol=0)


def one_row(rewards, values, mask, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    advantages, returns = gae(t([rewards]), t([values]), t([mask]), **kw)
    return advantages[0], returns[0]


# --------------------------------------------------------------------------- GAE by hand


def test_lambda_one_is_monte_carlo_return_minus_value():
    # γ = 1: G = [1, 1, 1] (the one reward, at the end, reaches every action);
    # A = G − V = [1 − 0.5, 1 − 0.25, 1 − 0.75] = [0.5, 0.75, 0.25]; R = A + V = G.
    advantages, returns = one_row([0, 0, 1], [0.5, 0.25, 0.75], [1, 1, 1], gamma=1.0, lam=1.0)
    close(advantages, [0.5, 0.75, 0.25])
    close(returns, [1, 1, 1])


def test_lambda_one_discounted():
    # γ = 0.5: G_3 = 2; G_2 = 0 + 0.5·2 = 1; G_1 = 1 + 0.5·1 = 1.5. V = 1 everywhere:
    # A = [0.5, 0, 1]; R = G = [1.5, 1, 2].
    advantages, returns = one_row([1, 0, 2], [1, 1, 1], [1, 1, 1], gamma=0.5, lam=1.0)
    close(advantages, [0.5, 0.0, 1.0])
    close(returns, [1.5, 1.0, 2.0])


def test_lambda_zero_is_one_step_td():
    # γ = 0.5, V = [1, 2, 4], V after the last action = 0:
    # δ_1 = 1 + 0.5·2 − 1 = 1; δ_2 = 0 + 0.5·4 − 2 = 0; δ_3 = 2 + 0.5·0 − 4 = −2.
    # λ = 0: A = δ; R = A + V = [2, 2, 2] (= r + γ V_next).
    advantages, returns = one_row([1, 0, 2], [1, 2, 4], [1, 1, 1], gamma=0.5, lam=0.0)
    close(advantages, [1.0, 0.0, -2.0])
    close(returns, [2.0, 2.0, 2.0])


def test_gamma_and_lambda_below_one():
    # γ = 0.5, λ = 0.5 (γλ = 0.25), V = 0.5 everywhere, reward 1 at the end:
    # δ_3 = 1 − 0.5 = 0.5; δ_2 = 0 + 0.5·0.5 − 0.5 = −0.25; δ_1 = −0.25 likewise.
    # A_3 = 0.5; A_2 = −0.25 + 0.25·0.5 = −0.125; A_1 = −0.25 + 0.25·(−0.125) = −0.28125.
    # R = A + 0.5 = [0.21875, 0.375, 1.0].
    advantages, returns = one_row([0, 0, 1], [0.5, 0.5, 0.5], [1, 1, 1], gamma=0.5, lam=0.5)
    close(advantages, [-0.28125, -0.125, 0.5])
    close(returns, [0.21875, 0.375, 1.0])


# A two-turn row: prompt | turn 1 (2 tokens) | tool output (2 tokens) | turn 2 (2 tokens) | padding.
GAP_MASK = [0, 1, 1, 0, 0, 1, 1, 0]
GAP_REWARDS = [0, 0, 0.5, 0, 0, 0, 1, 0]  # turn 1's reward on its last token, the outcome on the last one
# the critic's output on tokens the model did not write is never read: NaN there must not matter
GAP_VALUES = [NAN, 0.5, 1.0, NAN, 7.0, 2.0, 0.5, NAN]


def test_a_tool_output_gap_is_bootstrapped_across_with_one_discount():
    # λ = 1, γ = 0.5, actions at 1, 2, 5, 6 (the gap 3–4 is not a step):
    # G_6 = 1; G_5 = 0 + 0.5·1 = 0.5; G_2 = 0.5 + 0.5·G_5 = 0.75 (one γ across the gap, not three);
    # G_1 = 0 + 0.5·0.75 = 0.375. A = G − V = [−0.125, −0.25, −1.5, 0.5]; 0 off the actions.
    advantages, returns = one_row(GAP_REWARDS, GAP_VALUES, GAP_MASK, gamma=0.5, lam=1.0)
    close(advantages, [0, -0.125, -0.25, 0, 0, -1.5, 0.5, 0])
    close(returns, [0, 0.375, 0.75, 0, 0, 0.5, 1.0, 0])


def test_a_gap_bootstraps_from_the_next_actions_value():
    # λ = 0, γ = 0.5: turn 1's last action bootstraps from turn 2's first value (2.0), not
    # from the tool token's 7.0: δ_2 = 0.5 + 0.5·2.0 − 1.0 = 0.5.
    # δ_1 = 0 + 0.5·1.0 − 0.5 = 0; δ_5 = 0 + 0.5·0.5 − 2 = −1.75; δ_6 = 1 + 0 − 0.5 = 0.5.
    advantages, returns = one_row(GAP_REWARDS, GAP_VALUES, GAP_MASK, gamma=0.5, lam=0.0)
    close(advantages, [0, 0.0, 0.5, 0, 0, -1.75, 0.5, 0])
    close(returns, [0, 0.5, 1.5, 0, 0, 0.25, 1.0, 0])


def test_the_last_action_bootstraps_from_zero():
    # λ = 0, γ = 1: δ = r + 1·0 − V = 1 − 3 = −2; the padding's value 100 after it is not read.
    advantages, returns = one_row([1, 0], [3, 100], [1, 0], gamma=1.0, lam=0.0)
    close(advantages, [-2.0, 0.0])
    close(returns, [1.0, 0.0])


def test_padding_changes_nothing():
    # Row 1 is row 0's first three tokens right-padded to 5 (pad values and rewards NaN/0 garbage
    # but rewards on padding are 0): it gives what it gives alone, and 0 on its padding.
    rewards = t([[0, 1, 0, 0, 2], [0, 1, 2, 0, 0]])
    values = t([[0.3, 0.1, 0.4, 0.2, 0.9], [0.3, 0.1, 0.4, NAN, NAN]])
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    alone_a, alone_r = gae(rewards[1:, :3], values[1:, :3], mask[1:, :3], gamma=0.9, lam=0.8)
    close(advantages[1], torch.cat([alone_a[0], t([0, 0])]))
    close(returns[1], torch.cat([alone_r[0], t([0, 0])]))
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()


def test_a_reward_on_a_tool_token_goes_to_the_action_before_it():
    # mask [1, 0, 1]: the 2 landing on the tool token is a_1's reward, as if r = [2, 0, 0].
    # γ = 0.5, λ = 0, V = [1, ·, 1]: δ_1 = 2 + 0.5·1 − 1 = 1.5; δ_3 = 0 − 1 = −1.
    moved, _ = one_row([0, 2, 0], [1, 5, 1], [1, 0, 1], gamma=0.5, lam=0.0)
    there, _ = one_row([2, 0, 0], [1, 5, 1], [1, 0, 1], gamma=0.5, lam=0.0)
    close(moved, [1.5, 0, -1.0])
    close(moved, there)


def test_a_reward_before_the_first_action_is_dropped():
    # no action earned the 5 on the prompt token: A = 1 + 0 − 0 = 1 for the one action.
    advantages, returns = one_row([5, 1], [0, 0], [0, 1], gamma=1.0, lam=1.0)
    close(advantages, [0, 1.0])
    close(returns, [0, 1.0])


def test_gae_is_detached_and_computed_in_float32_at_least():
    values = torch.zeros(1, 3, dtype=torch.bfloat16, requires_grad=True)
    advantages, returns = gae(torch.ones(1, 3), values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert advantages.dtype == torch.float32 and not advantages.requires_grad and not returns.requires_grad
    close(advantages.double(), [[3.0, 2.0, 1.0]])  # G with γ = 1: 3, 2, 1


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"gamma": 1.0, "lam": 1.5}, "lam"), ({"gamma": 1.0, "lam": -0.1}, "lam"), ({"gamma": 1.0, "lam": NAN}, "lam"),
    ({"gamma": 1.1, "lam": 1.0}, "gamma"), ({"gamma": -1.0, "lam": 1.0}, "gamma"),
])
def test_bad_gamma_or_lambda_are_refused_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be in \[0, 1\]"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)


def test_shape_mismatch_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"^values has shape \(1, 3\) but rewards has \(1, 2\)"):
        gae(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 2\)"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(2, 2), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"^rewards must be \(B, T\)"):
        gae(torch.zeros(2), torch.zeros(2), torch.ones(2), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"^old_values has shape"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 2), clip=0.2)
    with pytest.raises(ValueError, match=r"^clip must be a positive float"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), clip=0.0)


# --------------------------------------------------------------------------- GAE against the explicit sum


def reference_gae(rewards: list[float], values: list[float], mask: list[int], gamma: float,
                  lam: float) -> tuple[list[float], list[float]]:
    """One row, by the definition: the actions' own rewards (a gap's rewards added to the
    action before it, those before the first action dropped), δ_k over consecutive actions
    with V after the last = 0, A_k = Σ_j (γλ)^j δ_{k+j} summed explicitly."""
    actions = [i for i, m in enumerate(mask) if m]
    own = {i: 0.0 for i in actions}
    previous = None
    for i, r in enumerate(rewards):
        previous = i if mask[i] else previous
        if previous is not None:
            own[previous] += r
    deltas = [own[i] + gamma * (values[actions[k + 1]] if k + 1 < len(actions) else 0.0) - values[i]
              for k, i in enumerate(actions)]
    advantages, returns = [0.0] * len(mask), [0.0] * len(mask)
    for k, i in enumerate(actions):
        advantages[i] = sum((gamma * lam) ** j * deltas[k + j] for j in range(len(actions) - k))
        returns[i] = advantages[i] + values[i]
    return advantages, returns


@pytest.mark.parametrize("seed", range(5))
def test_gae_equals_the_explicit_sum_on_random_rows(seed):
    rng = random.Random(seed)
    b, length = 4, 17
    gamma, lam = rng.choice([1.0, rng.random()]), rng.choice([0.0, 1.0, rng.random()])
    mask = [[int(rng.random() < 0.6) for _ in range(length)] for _ in range(b)]
    mask[0] = [0] * length  # a row with no action at all
    rewards = [[rng.gauss(0, 1) if rng.random() < 0.3 else 0.0 for _ in range(length)] for _ in range(b)]
    values = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(b)]
    advantages, returns = gae(t(rewards), t(values), t(mask), gamma=gamma, lam=lam)
    for row in range(b):
        want_a, want_r = reference_gae(rewards[row], values[row], mask[row], gamma, lam)
        close(advantages[row], want_a, atol=1e-10)
        close(returns[row], want_r, atol=1e-10)


# --------------------------------------------------------------------------- token rewards


def two_turn_trajectory(turn_rewards: tuple[float, float] = (0.0, 0.0)) -> Trajectory:
    # prompt [1, 2] | turn 1 [5, 6] | tool [7, 8, 9] | turn 2 [10, 11, 12] | template [13]
    return Trajectory(
        prompt_ids=[1, 2], response_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13],
        loss_mask=[1, 1, 0, 0, 0, 1, 1, 1, 0], logprobs=[0.0] * 9, versions=[0] * 9,
        steps=[Step(None, prompt_tokens=2, response_tokens=2, finish_reason="stop", reward=turn_rewards[0]),
               Step(None, prompt_tokens=7, response_tokens=3, finish_reason="stop", reward=turn_rewards[1])])


def test_token_rewards_put_the_outcome_and_each_turns_reward_on_its_last_model_token():
    # outcome 1 on response position 7 (token 12, the last model token); turn 1's 0.5 on position 1
    # (its last token: prompt_tokens 2 − prompt 2 + 2 − 1); turn 2's 0.25 on position 7 too: 1.25.
    assert token_rewards(two_turn_trajectory(), 1.0) == [0, 0, 0, 0, 0, 0, 0, 1.0, 0]
    assert token_rewards(two_turn_trajectory((0.5, 0.25)), 1.0) == [0, 0.5, 0, 0, 0, 0, 0, 1.25, 0]


def test_token_rewards_feed_gae_across_the_tool_output():
    # On the learner's target axis (entry j − 1 is token j; prompt of 2 ⇒ response position i is
    # entry i + 1): λ = γ = 1 and V = 0 make A the reward still to come at each action:
    # turn 1's tokens 1.5 (0.5 + 1), turn 2's tokens 1.
    trajectory = two_turn_trajectory((0.5, 0.0))
    rewards = [0.0] + token_rewards(trajectory, 1.0)
    mask = [0] + trajectory.loss_mask
    advantages, _ = gae(t([rewards]), torch.zeros(1, len(mask), dtype=D), t([mask]), gamma=1.0, lam=1.0)
    close(advantages[0], [0, 1.5, 1.5, 0, 0, 0, 1.0, 1.0, 1.0, 0])


def test_token_rewards_refuse_what_they_cannot_place():
    trajectory = two_turn_trajectory((0.5, 0.0))
    trajectory.loss_mask[1] = 0  # turn 1's last token no longer a model token
    with pytest.raises(ValueError, match=r"^steps\[0\]\.reward: model call 0's last token"):
        token_rewards(trajectory, 1.0)
    empty = Trajectory(prompt_ids=[1], steps=[Step(None, prompt_tokens=1, response_tokens=0, finish_reason="abort")])
    assert token_rewards(empty, 1.0) == []
    empty.steps[0].reward = 0.5
    with pytest.raises(ValueError, match=r"^steps\[0\]\.reward = 0.5, but model call 0 produced no token"):
        token_rewards(empty, 1.0)


# --------------------------------------------------------------------------- whitening


def test_whitening_is_over_the_actions_only():
    # actions hold 1, 2, 3: mean 2, Bessel-corrected std sqrt((1 + 0 + 1)/2) = 1 ⇒ −1, 0, 1;
    # the non-action positions (NaN, 100) count for nothing and come out 0.
    whitened = whiten(t([[1, NAN, 2], [100, 3, 0]]), t([[1, 0, 1], [0, 1, 0]]), eps=0.0)
    close(whitened, [[-1.0, 0, 0.0], [0, 1.0, 0]])


def test_whitening_random_gives_mean_zero_std_one_over_actions():
    gen = torch.Generator().manual_seed(0)
    advantages = torch.randn(3, 20, generator=gen, dtype=D) * 5 + 3
    mask = torch.rand(3, 20, generator=gen) < 0.5
    whitened = whiten(advantages, mask, eps=0.0)
    close(whitened[mask].mean(), t(0.0), atol=1e-12)
    close(whitened[mask].std(), t(1.0), atol=1e-12)
    assert (whitened[~mask] == 0).all()


# --------------------------------------------------------------------------- value loss


def test_value_clip_one_token_clipped_one_not():
    # clip 0.2, V_old = 0.
    # token 1: V = 0.5 moved past the clip: unclipped (0.5 − 1)² = 0.25, clipped V = 0.2 gives
    #   (0.2 − 1)² = 0.64, the larger ⇒ 0.64 and clipped (its gradient in V is 0).
    # token 2: V = 0.1 inside ±0.2: both terms (0.1 − 0.3)² = 0.04 ⇒ 0.04, not clipped.
    # token 3: masked (NaN garbage). loss = ½ · (0.64 + 0.04)/2 = 0.17; clip fraction 1/2.
    values = t([[0.5, 0.1, NAN]]).requires_grad_()
    loss, metrics = value_loss(values, t([[0, 0, NAN]]), t([[1, 0.3, NAN]]), t([[1, 1, 0]]), clip=0.2)
    close(loss, t(0.17))
    close(metrics["value_clip_frac"], t(0.5))
    close(metrics["returns_mean"], t(0.65))  # (1 + 0.3)/2
    loss.backward()
    # token 1 clipped: 0; token 2: ½·2·(0.1 − 0.3)/2 tokens = −0.1; masked: 0
    close(values.grad, [[0.0, -0.1, 0.0]])


def test_value_outside_the_clip_range_but_the_unclipped_term_larger_is_not_clipped():
    # V = 0.5, V_old = 0, clip 0.2, R = −1: unclipped (1.5)² = 2.25 > clipped (0.2 + 1)² = 1.44,
    # so the max keeps the unclipped term: loss ½·2.25 = 1.125, nothing clipped.
    loss, metrics = value_loss(t([[0.5]]), t([[0.0]]), t([[-1.0]]), t([[1]]), clip=0.2)
    close(loss, t(1.125))
    close(metrics["value_clip_frac"], t(0.0))


def test_value_loss_without_clip_is_half_the_squared_error():
    # ½ · ((0.5 − 1)² + (3 − 1)²)/2 = ½ · 4.25/2 = 1.0625
    loss, metrics = value_loss(t([[0.5, 3.0]]), t([[0.0, 0.0]]), t([[1.0, 1.0]]), t([[1, 1]]), clip=None)
    close(loss, t(1.0625))
    close(metrics["value_clip_frac"], t(0.0))
    close(metrics["value_loss"], t(1.0625))


def test_value_loss_aggregates_like_the_policy_loss():
    # squared errors: row 0 one token, (3 − 1)² = 4; row 1 two tokens, 0 and 0.
    # seq_mean: rows 4 and 0 ⇒ mean 2 ⇒ loss ½·2 = 1; the metric stays the token mean ½·4/3 = 2/3.
    values, returns, mask = t([[3.0, 0.0], [1.0, 1.0]]), t([[1.0, 0.0], [1.0, 1.0]]), t([[1, 0], [1, 1]])
    loss, metrics = value_loss(values, values, returns, mask, clip=None, aggregation="seq_mean")
    close(loss, t(1.0))
    close(metrics["value_loss"], t(2 / 3))
    token, _ = value_loss(values, values, returns, mask, clip=None)
    close(token, t(2 / 3))


# --------------------------------------------------------------------------- explained variance


def test_explained_variance_by_hand():
    returns = t([[1, 2, 3, NAN]])
    mask = t([[1, 1, 1, 0]])
    close(explained_variance(returns, returns, mask), t(1.0))  # perfect: Var[R − V] = 0
    close(explained_variance(t([[7, 7, 7, 0]]), returns, mask), t(0.0))  # constant: Var[R − c] = Var[R]
    # V = [1, 2, 2]: R − V = [0, 0, 1], mean 1/3, Var = (1/9 + 1/9 + 4/9)/3 = 2/9;
    # Var[R] = (1 + 0 + 1)/3 = 2/3 ⇒ 1 − (2/9)/(2/3) = 2/3.
    close(explained_variance(t([[1, 2, 2, 5]]), returns, mask), t(2 / 3))


def test_explained_variance_of_returns_that_do_not_vary_is_zero_not_nan():
    close(explained_variance(t([[0.5, 2.0]]), t([[1.0, 1.0]]), t([[1, 1]])), t(0.0))
    close(explained_variance(t([[0.5]]), t([[1.0]]), t([[0]])), t(0.0))
