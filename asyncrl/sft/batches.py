"""Which conversations train together, and the loss over their assistant tokens.

A step's loss is the mean over all of the step's assistant tokens (each token counts
once, whatever conversation it is in), so each micro-batch's summed loss is divided by
the whole step's token count before its backward: any cut of the step into micro-batches
accumulates the same gradient as one forward over the whole step, up to float rounding
(``tests/test_sft_conversations.py`` checks it).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from asyncrl.config import ConfigError
from asyncrl.learner import core
from asyncrl.learner.core import micro_batch_bounds
from asyncrl.seeding import derive_seed
from asyncrl.sft.data import Conversation
from asyncrl.sft.render import Example, build_examples


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


def trainable_examples(tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], max_length: int,
                       say: Callable[[str], None]) -> list[Example]:
    """``conversations`` rendered and masked (``render.build_examples``), those left with no
    assistant token dropped; what was cut at ``max_length`` or dropped is said through
    ``say``. Raises ``ConfigError`` when conversations were given and none is left."""
    built = build_examples(tokenizer, conversations, max_length)
    kept = [e for e in built if trained_tokens([e])]
    cut = sum(e.truncated for e in built)
    if not conversations:
        return kept
    lengths = sorted(len(e.ids) for e in built)
    sources = ", ".join(sorted({c.source.rsplit(":", 1)[0] for c in conversations}))
    say(f"asyncrl sft: {len(kept)} conversations from {sources}, "
        f"{sum(trained_tokens([e]) for e in kept)} assistant tokens of {sum(lengths)}, "
        f"length median {lengths[len(lengths) // 2]} max {lengths[-1]}"
        + (f"; {cut} cut at data.max_length={max_length}" if cut else "")
        + (f", {len(built) - len(kept)} dropped with no assistant token left" if len(kept) < len(built) else ""))
    if not kept:
        raise ConfigError(f"no conversation of {sources} has an assistant token within "
                          f"data.max_length={max_length}: raise it")
    return kept
