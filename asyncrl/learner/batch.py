"""Packing trajectories into the padded tensors the learner trains on.

Token j of ``prompt + response`` is predicted by the logits at position j - 1, so every
per-token field is laid out on the *target* axis of length L - 1: entry j - 1 describes
the token at position j. Prompt positions and padding have mask 0, like tool tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.algorithms.distill import distill_advantages
from asyncrl.algorithms.gae import token_rewards
from asyncrl.types import NO_VERSION, Trajectory


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, L) right-padded with pad_id
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L-1) 1 where the target is a model token
    behavior_logprobs: torch.Tensor  # (B, L-1) μ from the engine, 0 elsewhere
    advantages: torch.Tensor  # (B,), or (B, L-1) per token (on-policy distillation: algorithms/distill.py)
    prompt_lengths: torch.Tensor  # (B,) long: row i's prompt is input_ids[i, :prompt_lengths[i]]
    # (B, L-1) long: the version that sampled each model token (NO_VERSION elsewhere), from
    # which the learner's engine–learner mismatch by lag (algorithms/mismatch.py); None: not measured
    versions: torch.Tensor | None = None
    # (B, L-1) float: each token's reward (algorithm.advantage: gae; algorithms/gae.token_rewards), from
    # which the learner's critic makes the per-token advantages when the batch trains; None: no critic
    rewards: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop), trimmed to their own longest sequence."""
        length = int(self.attention_mask[start:stop].sum(-1).max())
        return self._map(lambda t: t[start:stop, :length] if t is self.input_ids or t is self.attention_mask
                         else t[start:stop] if t.dim() == 1 else t[start:stop, :length - 1])

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop) at full width; unlike :meth:`slice`, may be empty (a rank
        of a sharded learner with no rows of a small batch)."""
        return self._map(lambda t: t[start:stop])

    def select(self, index: torch.Tensor) -> TrainBatch:
        """The rows at ``index`` (a 1-D long tensor, possibly empty), at full width."""
        index = index.to(self.input_ids.device)
        return self._map(lambda t: t.index_select(0, index))

    @staticmethod
    def filler(pad_id: int, device: torch.device) -> TrainBatch:
        """One two-token row that trains nothing (mask 0): what a rank of a sharded learner
        runs when it has fewer micro-batches than the others, which wait for its passes."""
        ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
        zeros = torch.zeros((1, 1), dtype=torch.float32, device=device)
        return TrainBatch(ids, torch.ones_like(ids), zeros, zeros.clone(), torch.zeros(1, device=device),
                          torch.ones(1, dtype=torch.long, device=device))

    def to(self, device: torch.device) -> TrainBatch:
        return self._map(lambda t: t.to(device))

    def with_advantages(self, advantages: torch.Tensor) -> TrainBatch:
        """This batch with ``advantages`` ((B,) or (B, L-1)) in place of its own."""
        return dataclasses.replace(self, advantages=advantages)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """``fn`` of every tensor field (each indexed by row first); an absent one stays None."""
        def optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return TrainBatch(fn(self.input_ids), fn(self.attention_mask), fn(self.loss_mask), fn(self.behavior_logprobs),
                          fn(self.advantages), fn(self.prompt_lengths), optional(self.versions), optional(self.rewards))


def pack_batch(trajectories: list[Trajectory], advantages: list[float], pad_id: int,
               distill_coef: float = 0.0, *, outcomes: bool = False) -> TrainBatch:
    """One right-padded :class:`TrainBatch` of ``trajectories``, one advantage each; with
    ``distill_coef`` and trajectories that carry ``teacher_logprobs``, per-token advantages
    ``A − coef · (μ − τ)`` on model tokens (``algorithms/distill.py``). ``outcomes``
    (``algorithm.advantage: gae``): each of ``advantages`` is its trajectory's outcome reward,
    put on its last model token as the batch's ``rewards`` (:func:`reward_tensor`); the
    advantages are then the learner's to compute (0 here)."""
    if outcomes:
        batch = pack_batch(trajectories, [0.0] * len(trajectories), pad_id)
        return dataclasses.replace(batch, rewards=reward_tensor(trajectories, advantages, batch.input_ids.shape[1]))
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    length = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    b = len(trajectories)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    loss_mask = torch.zeros((b, length - 1), dtype=torch.float32)
    behavior = torch.zeros((b, length - 1), dtype=torch.float32)
    versions = torch.full((b, length - 1), NO_VERSION, dtype=torch.long)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        attention_mask[i, :p + r] = 1
        loss_mask[i, p - 1:p + r - 1] = torch.tensor(t.loss_mask, dtype=torch.float32)
        behavior[i, p - 1:p + r - 1] = torch.tensor(t.logprobs, dtype=torch.float32)
        versions[i, p - 1:p + r - 1] = torch.tensor(t.versions, dtype=torch.long)
    per_sequence = torch.tensor(advantages, dtype=torch.float32)
    return TrainBatch(input_ids, attention_mask, loss_mask, behavior,
                      _distilled(trajectories, per_sequence, behavior, loss_mask, distill_coef),
                      torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.long), versions)


def reward_tensor(trajectories: list[Trajectory], outcomes: list[float], length: int) -> torch.Tensor:
    """Each token's reward on the target axis (B, length - 1): trajectory i's outcome on its
    last model token and each of its model calls' own reward (``Step.reward``) on that
    call's last token (``algorithms/gae.token_rewards``), 0 elsewhere. Every trajectory of a
    multi-trajectory episode carries the episode's outcome, as it carries the episode's
    advantage under a group-relative estimator; a call's reward lies in its own trajectory."""
    out = torch.zeros((len(trajectories), length - 1), dtype=torch.float32)
    for i, (t, outcome) in enumerate(zip(trajectories, outcomes, strict=True)):
        p, r = len(t.prompt_ids), len(t.response_ids)
        out[i, p - 1:p + r - 1] = torch.tensor(token_rewards(t, outcome), dtype=torch.float32)
    return out


def teacher_tensor(trajectories: list[Trajectory], length: int) -> torch.Tensor:
    """The teachers' logprobs on the target axis (B, length - 1), 0 where there are none."""
    out = torch.zeros((len(trajectories), length - 1), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        if t.teacher_logprobs is None:
            raise ValueError(f"trajectory {i} of the batch has no teacher logprobs, but distillation is on")
        p, r = len(t.prompt_ids), len(t.response_ids)
        out[i, p - 1:p + r - 1] = torch.tensor(t.teacher_logprobs, dtype=torch.float32)
    return out


def _distilled(trajectories: list[Trajectory], advantages: torch.Tensor, behavior: torch.Tensor,
               loss_mask: torch.Tensor, coef: float) -> torch.Tensor:
    if not coef:
        return advantages
    teacher = teacher_tensor(trajectories, behavior.shape[1] + 1)
    return distill_advantages(advantages, behavior, teacher, loss_mask, coef)
