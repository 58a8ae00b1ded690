"""Which conversations train together, and the loss over their assistant tokens.

A step's loss is the mean over all of the step's assistant tokens (each token counts
once, whatever conversation it is in), so each micro-batch's summed loss is divided by
the whole step's token count before its backward: any cut of the step into micro-batches
accumulates the same gradient as one forward over the whole step, up to float rounding
(``tests/test_sft_conversations.py`` checks it).
"""

from __future__ import annotations

import random

from asyncrl.learner import core
from asyncrl.learner.learner import micro_batch_bounds
from asyncrl.seeding import derive_seed
from asyncrl.sft.render import Example


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


def collate(examples: list[Example], pad_id: int) -> core.Batch:
    """The training core's supervised batch (``core.collate``): labels the ids where the mask
    is 1, ``core.IGNORE`` elsewhere."""
    return core.collate([(e.ids, [i if m else core.IGNORE for i, m in zip(e.ids, e.mask)]) for e in examples],
                        pad_id)


def trained_tokens(examples: list[Example]) -> int:
    """Tokens the loss counts: the mask's ones, but the first position (nothing predicts it)."""
    return sum(sum(e.mask[1:]) for e in examples)
