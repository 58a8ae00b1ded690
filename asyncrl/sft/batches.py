"""Which conversations train together, and the loss over their assistant tokens.

A step's loss is the mean over all of the step's assistant tokens (each token counts
once, whatever conversation it is in), so each micro-batch's summed loss is divided by
the whole step's token count before its backward: any cut of the step into micro-batches
accumulates the same gradient as one forward over the whole step, up to float rounding
(``tests/test_sft_conversations.py`` checks it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncrl.learner.learner import micro_batch_bounds
from asyncrl.seeding import derive_seed
from asyncrl.sft.render import Example

IGNORE = -100  # a label no token has: cross_entropy skips it


@dataclass(frozen=True)
class Batch:
    """Rows padded on the right to the longest. (B, T) each."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor  # the id where the model is trained to write it, IGNORE elsewhere


def step_order(num_examples: int, batch_size: int, *, epochs: int, seed: int) -> list[list[int]]:
    """The example indices of each optimizer step: per epoch a permutation seeded by
    (``seed``, epoch), cut into ``batch_size`` pieces (the last may be smaller). A pure
    function of its arguments, so a run repeats itself."""
    steps = []
    for epoch in range(epochs):
        order = list(range(num_examples))
        random.Random(derive_seed(seed, "sft-order", epoch)).shuffle(order)
        steps += [order[i:i + batch_size] for i in range(0, num_examples, batch_size)]
    return steps


def micro_batches(examples: list[Example], *, max_rows: int, max_tokens: int | None) -> list[list[Example]]:
    """The step's examples sorted by length and cut into micro-batches of at most
    ``max_rows`` rows and ``max_tokens`` padded positions: similar lengths share a
    micro-batch, so little of it is padding."""
    ordered = sorted(examples, key=lambda e: len(e.ids))
    bounds = micro_batch_bounds([len(e.ids) for e in ordered], max_rows=max_rows, max_tokens=max_tokens)
    return [ordered[start:stop] for start, stop in bounds]


def collate(examples: list[Example], pad_id: int) -> Batch:
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.ids)
        ids[row, :n] = torch.tensor(e.ids)
        attention[row, :n] = 1
        labels[row, :n] = torch.where(torch.tensor(e.mask, dtype=torch.bool), torch.tensor(e.ids), IGNORE)
    return Batch(ids, attention, labels)


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ -log p(label) over the labelled positions, each predicted from the one before it.
    logits (B, T, V), labels (B, T) -> a scalar, float32 whatever the logits' dtype."""
    predicted = logits[:, :-1].float()  # (B, T-1, V): position t predicts token t + 1
    target = labels[:, 1:]  # (B, T-1)
    return F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def trained_tokens(examples: list[Example]) -> int:
    """Tokens the loss counts: the mask's ones, but the first position (nothing predicts it)."""
    return sum(sum(e.mask[1:]) for e in examples)
