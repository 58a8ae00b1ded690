"""Generalized advantage estimation (GAE) over the model's own tokens, and the critic's loss.

Pure functions on (B, T) tensors, laid out like every other per-token field (on the learner's
target axis: entry j − 1 describes token j, so the value at entry j − 1 is V of the state in
which token j is chosen). ``mask`` is 1 on the tokens the model produced (the *actions*) and
0 on the prompt, tool outputs, the user's turns, chat-template text and padding.

How GAE crosses tokens the model did not write. Only actions are MDP steps: a tool's output
or a user's turn is the environment's transition, not a step of its own. So along a row the
recursion runs over the actions a_1 … a_n only (with V_{n+1} = 0: after the last action
there is nothing left to earn)::

    δ_k = r_k + γ · V_{k+1} − V_k          A_k = δ_k + γλ · A_{k+1}          R_k = A_k + V_k

where V_{k+1} is the value of the *next action* however many non-action tokens lie between:
the next turn's first token bootstraps across the gap, and the gap costs one γ (one step),
not one γ per tool token. Non-action positions get advantage and return 0.

Rewards on non-action tokens are credited to the previous action (undiscounted): a reward
observed after a_k and before a_{k+1} is the environment's answer to a_k. A reward before a
row's first action answers no action and changes no action's advantage, so it is dropped.
:func:`token_rewards` puts every reward on an action already; the rule is for callers that
score tool outputs where they land.

Values at non-action positions (a critic's output over prompt or padding) are made 0 before
any arithmetic (``algorithms/losses.py`` says why), so a NaN there cannot reach the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algorithms.correction import clean
from asyncrl.algorithms.losses import aggregate
from asyncrl.types import Trajectory


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def _check_shapes(reference: str, tensors: dict[str, Tensor]) -> None:
    """Every tensor (B, T) and the shape of ``tensors[reference]``; the error names the odd one."""
    want = tuple(tensors[reference].shape)
    if len(want) != 2:
        raise ValueError(f"{reference} must be (B, T), got shape {want}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != want:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but {reference} has {want}")


def _float(*tensors: Tensor) -> torch.dtype:
    """The dtype the arithmetic runs in: the inputs' widest float, at least float32 (a
    bfloat16 critic's values summed over thousands of tokens would lose the advantage)."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Advantages and returns ``(A, R)``, (B, T) each, of token rewards (B, T), the critic's
    values (B, T) and the action mask (B, T), over the actions only (module docstring).

    ``gamma`` (discount per action) and ``lam`` (GAE's λ) in [0, 1]: λ = 1 gives the
    discounted Monte-Carlo return minus V, λ = 0 the one-step TD error. Detached; 0 at
    non-action positions. A reverse scan over T, vectorized over B (T small launches).
    """
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    _check_shapes("rewards", {"rewards": rewards, "values": values, "mask": mask})
    dtype = _float(rewards, values)
    action = mask.bool()  # (B, T)
    rewards = rewards.to(dtype)
    values = clean(values.detach().to(dtype), action)
    zero = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)  # (B,)
    next_value, next_advantage, carried = zero, zero, zero
    advantages: list[Tensor] = []
    for t in reversed(range(rewards.shape[1])):
        acts = action[:, t]  # (B,)
        reward = rewards[:, t] + carried  # a gap's rewards join the action before it
        advantage = reward + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        advantages.append(torch.where(acts, advantage, zero))
        next_value = torch.where(acts, values[:, t], next_value)
        next_advantage = torch.where(acts, advantage, next_advantage)
        carried = torch.where(acts, zero, reward)
    advantages_bt = torch.stack(advantages[::-1], dim=1) if advantages else rewards.clone()  # (B, T)
    return advantages_bt, clean(advantages_bt + values, action)


def token_rewards(trajectory: Trajectory, outcome: float) -> list[float]:
    """Per-token rewards aligned with ``trajectory.response_ids``: ``outcome`` (the episode's
    reward) on the last model token, plus each model call's own reward (``Step.reward``,
    an agent's per-turn reward) on that call's last sampled token. 0 elsewhere.

    A trajectory with no model token has nothing to credit: all 0 (GAE gives it nothing).
    Refused, naming the call: a non-zero reward for a call that produced no token, a call
    whose tokens do not lie on model tokens (a trajectory edited after it was recorded).
    """
    rewards = [0.0] * len(trajectory.response_ids)
    model = [i for i, m in enumerate(trajectory.loss_mask) if m]
    if model:
        rewards[model[-1]] += float(outcome)
    offset = len(trajectory.prompt_ids)
    for i, step in enumerate(trajectory.steps):
        if not step.reward:
            continue
        if step.response_tokens == 0:
            raise ValueError(f"steps[{i}].reward = {step.reward!r}, but model call {i} produced no token to carry it")
        last = step.prompt_tokens - offset + step.response_tokens - 1
        if not 0 <= last < len(rewards) or not trajectory.loss_mask[last]:
            raise ValueError(f"steps[{i}].reward: model call {i}'s last token (response position {last}) is not a "
                             "model token of the trajectory; its steps do not match its tokens")
        rewards[last] += float(step.reward)
    return rewards


@torch.no_grad()
def whiten(advantages: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(A − mean) / (std + eps)`` with mean and std over the batch's action tokens only
    (std Bessel-corrected, as ``grpo``'s); 0 elsewhere. (B, T) -> (B, T)."""
    _check_shapes("advantages", {"advantages": advantages, "mask": mask})
    action = mask.bool()
    advantages = clean(advantages, action)
    count = action.sum().to(advantages.dtype)
    mean = advantages.sum() / count.clamp(min=1)
    centered = clean(advantages - mean, action)
    std = (centered.square().sum() / (count - 1).clamp(min=1)).sqrt()
    return centered / (std + eps)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None,
               aggregation: str = "token_mean") -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's clipped loss ``½ · max((V − R)², (clip(V, V_old ± clip) − R)²)`` per
    action token, aggregated like the policy loss (``losses.aggregate``).

    ``values`` (B, T) carry the gradient; ``old_values`` (B, T) are the critic's values when
    the returns were computed, ``returns`` (B, T) GAE's R; all detached but ``values``.
    ``clip=None`` is the plain ½ (V − R)². Returns the loss and detached token means over
    the actions (whatever ``aggregation`` is): ``value_loss``, ``value_clip_frac`` (tokens
    whose clipped term is strictly the larger, so the clip holds V's gradient at 0) and
    ``returns_mean``.
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be a positive float or None, got {clip!r}")
    _check_shapes("values", {"values": values, "old_values": old_values, "returns": returns, "mask": mask})
    action = mask.bool()
    values = clean(values, action)
    old_values, returns = clean(old_values.detach(), action), clean(returns.detach(), action)
    unclipped = (values - returns).square()
    if clip is None:
        per_token, clipped_more = unclipped, torch.zeros_like(action)
    else:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
        per_token, clipped_more = torch.maximum(unclipped, clipped), clipped > unclipped
    loss = 0.5 * aggregate(per_token, action, aggregation)
    with torch.no_grad():
        metrics = {"value_loss": 0.5 * aggregate(per_token.detach(), action, "token_mean"),
                   "value_clip_frac": aggregate(clipped_more.to(values.dtype), action, "token_mean"),
                   "returns_mean": aggregate(returns, action, "token_mean")}
    return loss, metrics


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 − Var[R − V] / Var[R]`` over the batch's action tokens, a scalar: 1 for a perfect
    critic, 0 for one that predicts a constant, below 0 for one worse than a constant.
    Returns that do not vary leave nothing to explain: 0 there (a NaN would stop the run's
    metrics). (B, T) each -> ()."""
    _check_shapes("returns", {"returns": returns, "values": values, "mask": mask})
    action = mask.bool()
    dtype = _float(values, returns)
    values, returns = clean(values.to(dtype), action), clean(returns.to(dtype), action)
    var_returns = _masked_var(returns, action)
    ratio = _masked_var(returns - values, action) / torch.where(var_returns > 0, var_returns, 1.0)
    return torch.where(var_returns > 0, 1.0 - ratio, torch.zeros((), dtype=dtype, device=values.device))


def _masked_var(x: Tensor, action: Tensor) -> Tensor:
    """Population variance of ``x`` over the set positions of ``action``; x is 0 elsewhere."""
    count = action.sum().to(x.dtype).clamp(min=1)
    mean = x.sum() / count
    return clean(x - mean, action).square().sum() / count
