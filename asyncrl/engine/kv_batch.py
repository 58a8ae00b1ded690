"""The running batch's tensors and the surgery on them between two steps.

Layout: rows are left-padded to one cache length T; a 2-D attention mask hides the
padding and explicit position ids keep each row's positions contiguous. Newcomers are
prefilled together, their cache is left-padded and concatenated to the batch (``merge``);
a finished row leaves with an index-select (``keep_rows``). Newcomers with the same prompt
(the n samples of a GRPO group) share one prefill: ``fork_prefill`` copies its rows, and
``PrefixCache`` keeps recent prompts' rows for requests admitted later. Row i of a
``KVBatch`` is ``Scheduler.running[i]``; which rows come and go is the scheduler's call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from asyncrl.engine.hf_cache import filled_layers, forward_with_cache
from asyncrl.engine.sampling import RowParams
from asyncrl.types import SamplingParams


def left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def prompt_mask(prompt_lengths: list[int], length: int, device: torch.device) -> torch.Tensor:
    """(rows, length) 1 where a left-padded prompt has a token."""
    return torch.tensor([[0] * (length - n) + [1] * n for n in prompt_lengths], device=device)


@dataclass
class Prefill:
    """Prefilled prompts: per layer (keys, values) of shape (rows, heads, T, head_dim), each
    row left-padded to T, and each row's last-position logits (rows, vocab)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor


class KVBatch:
    """The running rows. The last sampled token of each row is not in the cache yet: the
    next decode feeds it (``forward`` makes room for it, ``advance`` books its output)."""

    def __init__(self, cache: DynamicCache, attention_mask: torch.Tensor, last_tokens: torch.Tensor,
                 positions: torch.Tensor, params: list[SamplingParams], rows: RowParams) -> None:
        self.cache = cache
        self.attention_mask = attention_mask  # (B, T) 1 = real token in the cache
        self.last_tokens = last_tokens  # (B,)
        self.positions = positions  # (B,) position id of last_tokens
        self.params = params  # per row: RowParams is rebuilt from them when rows come or go
        self.rows = rows

    def __len__(self) -> int:
        return len(self.params)

    @property
    def width(self) -> int:
        """Columns the next decode attends over, per row (padding included)."""
        return self.attention_mask.shape[1] + 1

    def forward(self, model: PreTrainedModel) -> torch.Tensor:
        """One decode forward: (rows, vocab) logits; the fed last tokens join the cache (grown
        by concatenation: ``static_kv`` is the path that writes in place)."""
        mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(self), 1)], dim=1)
        out = forward_with_cache(model, self.cache, input_ids=self.last_tokens[:, None], attention_mask=mask,
                                 position_ids=self.positions[:, None])
        self.attention_mask = mask
        return out.logits[:, -1]

    def advance(self, tokens: torch.Tensor) -> None:
        """After a decode: the fed tokens are in the cache now, ``tokens`` wait to go in."""
        self.last_tokens, self.positions = tokens, self.positions + 1

    def merge(self, other: KVBatch) -> KVBatch:
        """``other``'s rows after this batch's, both left-padded to the longer cache."""
        length = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        for la, lb in zip(filled_layers(self.cache), filled_layers(other.cache)):
            la.keys = torch.cat([left_pad(la.keys, length, -2), left_pad(lb.keys, length, -2)])
            la.values = torch.cat([left_pad(la.values, length, -2), left_pad(lb.values, length, -2)])
        params = self.params + other.params
        return KVBatch(
            self.cache,
            torch.cat([left_pad(self.attention_mask, length, 1), left_pad(other.attention_mask, length, 1)]),
            torch.cat([self.last_tokens, other.last_tokens]), torch.cat([self.positions, other.positions]),
            params, RowParams(params, self.attention_mask.device),
        )

    def keep_rows(self, keep: list[int]) -> KVBatch | None:
        """Only rows ``keep`` (ascending); None when none is left. Columns that are padding
        in every kept row go too, so a long row leaving shortens everyone's attention."""
        if len(keep) == len(self):
            return self
        if not keep:
            return None
        device = self.attention_mask.device
        index = torch.tensor(keep, device=device)
        mask = self.attention_mask.index_select(0, index)
        first = int((mask.sum(0) > 0).nonzero()[0])
        for layer in filled_layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        params = [self.params[i] for i in keep]
        return KVBatch(self.cache, mask[:, first:], self.last_tokens.index_select(0, index),
                       self.positions.index_select(0, index), params, RowParams(params, device))


def fork_prefill(keys: list[Hashable], fresh_keys: list[Hashable], fresh: Prefill | None,
                 fresh_cache: DynamicCache | None, cached: dict[Hashable, Prefill], length: int,
                 config: PretrainedConfig) -> tuple[DynamicCache, torch.Tensor]:
    """One cache row and one logits row per newcomer (``keys``, in admission order), taken
    from the prompts just prefilled (``fresh``: rows in ``fresh_keys`` order, its forward's
    ``fresh_cache``) or from the prefix cache (``cached``). Returns (cache, logits (rows, vocab)).

    A prompt's prefill depends on its ids and the weights only, so a fork equals a prefill of
    its own up to float noise; after the index-select copy the rows are independent, and one
    fork finishing, aborting or being cancelled leaves the others alone.
    """
    if len(fresh_keys) == len(keys):  # nothing shared: the forward's own tensors, as they are
        assert fresh is not None and fresh_cache is not None
        return fresh_cache, fresh.logits
    sources = [] if fresh is None else [fresh]
    row = {key: i for i, key in enumerate(fresh_keys)}
    for key, prefill in cached.items():  # one row each, after the fresh block
        row[key] = len(row)
        sources.append(prefill)
    index = torch.tensor([row[key] for key in keys], device=sources[0].logits.device)

    def fork(parts: list[torch.Tensor]) -> torch.Tensor:  # one row per newcomer, in admission order
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).index_select(0, index)

    layers = [tuple(fork([left_pad(s.layers[i][j], length, -2) for s in sources]) for j in (0, 1))
              for i in range(len(sources[0].layers))]
    logits = fork([s.logits for s in sources])
    if fresh_cache is None:
        return DynamicCache(layers, config=config), logits
    for layer, (k, v) in zip(filled_layers(fresh_cache), layers):
        layer.keys, layer.values = k, v
    return fresh_cache, logits


class PrefixCache:
    """The last ``capacity`` prefilled prompts' rows (copied, unpadded: the prefill block
    itself is freed), for requests with the same prompt admitted later: a group split over
    admissions by a full batch or by thread timing. Oldest use leaves first; the engine
    clears it on every weight update, so a fork never mixes weights."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Prefill] = OrderedDict()  # one row each

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, key: Hashable) -> Prefill:
        """A hit: its rows, and it becomes the most recently used."""
        self._entries.move_to_end(key)
        return self._entries[key]

    def remember(self, keys: list[Hashable], lengths: list[int], block: Prefill) -> None:
        """Row i of ``block`` (a prompt of ``lengths[i]`` tokens) under ``keys[i]``."""
        if not self.capacity:
            return
        for i, (key, n) in enumerate(zip(keys, lengths)):
            layers = [(k[i:i + 1, :, -n:].clone(), v[i:i + 1, :, -n:].clone()) for k, v in block.layers]
            self._entries[key] = Prefill(layers, block.logits[i:i + 1].clone())
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
