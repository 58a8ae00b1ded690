"""Packing trajectories into the padded tensors the learner trains on.

Token j of ``prompt + response`` is predicted by the logits at position j - 1, so every
per-token field is laid out on the *target* axis of length L - 1: entry j - 1 describes
the token at position j. Prompt positions and padding have mask 0, like tool tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.algorithms.distill import distill_advantages
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

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop), trimmed to their own longest sequence."""
        length = int(self.attention_mask[start:stop].sum(-1).max())
        return TrainBatch(self.input_ids[start:stop, :length], self.attention_mask[start:stop, :length],
                          self.loss_mask[start:stop, :length - 1], self.behavior_logprobs[start:stop, :length - 1],
                          self.advantages[start:stop] if self.advantages.dim() == 1
                          else self.advantages[start:stop, :length - 1], self.prompt_lengths[start:stop],
                          None if self.versions is None else self.versions[start:stop, :length - 1])

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop) at full width; unlike :meth:`slice`, may be empty (a rank
        of a sharded learner with no rows of a small batch)."""
        return TrainBatch(self.input_ids[start:stop], self.attention_mask[start:stop], self.loss_mask[start:stop],
                          self.behavior_logprobs[start:stop], self.advantages[start:stop],
                          self.prompt_lengths[start:stop], None if self.versions is None else self.versions[start:stop])

    def select(self, index: torch.Tensor) -> TrainBatch:
        """The rows at ``index`` (a 1-D long tensor, possibly empty), at full width."""
        index = index.to(self.input_ids.device)
        return TrainBatch(*(t.index_select(0, index) for t in self._tensors()))

    @staticmethod
    def filler(pad_id: int, device: torch.device) -> TrainBatch:
        """One two-token row that trains nothing (mask 0): what a rank of a sharded learner
        runs when it has fewer micro-batches than the others, which wait for its passes."""
        ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
        zeros = torch.zeros((1, 1), dtype=torch.float32, device=device)
        return TrainBatch(ids, torch.ones_like(ids), zeros, zeros.clone(), torch.zeros(1, device=device),
                          torch.ones(1, dtype=torch.long, device=device))

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(*(t.to(device) for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.loss_mask, self.behavior_logprobs, self.advantages,
                self.prompt_lengths, *(() if self.versions is None else (self.versions,)))


def pack_batch(trajectories: list[Trajectory], advantages: list[float], pad_id: int,
               distill_coef: float = 0.0) -> TrainBatch:
    """One right-padded :class:`TrainBatch` of ``trajectories``, one advantage each; with
    ``distill_coef`` and trajectories that carry ``teacher_logprobs``, per-token advantages
    ``A − coef · (μ − τ)`` on model tokens (``algorithms/distill.py``)."""
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
