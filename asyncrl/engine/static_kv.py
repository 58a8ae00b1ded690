"""The running batch in KV buffers allocated once, so that no decode step reallocates the
cache and a step's shapes can stay put for a captured graph (``step_capture.py``).

Why: a ``DynamicCache`` grows by concatenation, so every decode step copies every layer's
whole cache into a new tensor: host work and allocator traffic that dominate a small model's
step on a GPU. Here each layer owns one (rows, heads, columns, head_dim) buffer per keys and
values; a decode writes its one new column in place (``SlotLayer.update``).

Layout, as ``kv_batch``'s: rows are left-padded to one cache length T; row i's tokens fill
columns [start_i, T) of its buffer row and the next decode writes column T for every row.
A row's columns are contiguous, so no mask is stored: the step rebuilds it on the device
from ``starts`` and the write column (start_i ≤ col ≤ T). The host keeps T and the starts
as plain ints, so no surgery between steps reads the device (no host synchronisation).

Surgery between steps: newcomers (a prefilled ``KVBatch``) are copied into free rows,
right-aligned at T (the running rows move right first when a newcomer's prompt is longer);
finished rows leave by a gather of the kept rows to the top, dropping columns that are
padding in every kept row. The buffers grow (doubling their columns, copied once) only when
a row outgrows them; growing drops the captured graphs, which hold the old addresses.
Memory: ``max_rows`` rows from the first step (a full batch's), times the longest row's
columns rounded up to a power of two.

Invariant: every attended buffer value is finite. Rows past the live ones (a bucket's
padding) keep start 0, so their mask is never empty (an empty softmax row is NaN, and a NaN
written into the buffer would poison any later row that reuses it, as 0 × NaN = NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from asyncrl.engine.hf_cache import filled_layers, forward_with_cache
from asyncrl.engine.kv_batch import KVBatch
from asyncrl.engine.sampling import RowParams, to_device
from asyncrl.types import SamplingParams

# The attention implementations that take a prepared 4-D mask as we build it: a boolean one
# (sdpa) or an additive float one (eager). Others (flash attention, ...) decode with the
# dynamic cache.
MASK_KINDS = {"sdpa": "bool", "eager": "additive"}


def bucket(n: int, cap: int) -> int:
    """The smallest power of two ≥ ``n``, at most ``cap``: a captured step exists per bucket,
    so a batch of 5 rows runs the 8-row graph (3 rows of padding) instead of a capture per size."""
    return min(cap, 1 << max(0, n - 1).bit_length())


def static_unsupported(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot decode from static buffers, or None when it can."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in MASK_KINDS:
        return f"its attention implementation {attention!r} is not one of {sorted(MASK_KINDS)}"
    layers = DynamicCache(config=model.config).layers
    kinds = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
    if kinds:  # sliding windows, linear attention, ...: their own cache rules
        return f"its cache has layers other than full attention ({', '.join(sorted(kinds))})"
    return None


@dataclass
class Window:
    """What the next forward reads and writes: ``rows`` × ``columns`` of every buffer, and
    the column it writes (a device tensor, so a captured step reads it at replay)."""

    rows: int
    columns: int
    column: torch.Tensor  # (1,) long
    written: int = 0  # columns before the write one: the cache length a model may ask for


class SlotLayer(DynamicLayer):
    """One layer's cache as a window of buffers allocated once: ``update`` writes the step's
    keys and values at the window's column, in place, and returns the window (the model
    attends over it, masked)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, window: Window) -> None:
        super().__init__()
        self.buffer_keys, self.buffer_values, self.window = keys, values, window
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = keys[:0], values[:0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        w = self.window
        keys = self.buffer_keys[:w.rows, :, :w.columns]
        values = self.buffer_values[:w.rows, :, :w.columns]
        keys.index_copy_(2, w.column, key_states)  # (rows, heads, 1, head_dim) into column T
        values.index_copy_(2, w.column, value_states)
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.window.written

    def get_max_length(self) -> int:
        return self.buffer_keys.shape[2]


class StaticKV:
    """The running rows in buffers allocated once (rows: ``max_rows``; columns: grown by
    doubling). Row i is ``Scheduler.running[i]``; the same verbs as ``KVBatch``."""

    def __init__(self, model: PreTrainedModel, max_rows: int, *, bucketed: bool) -> None:
        self.model = model
        self.max_rows = max_rows
        self.bucketed = bucketed  # pad rows and columns to buckets: shapes a captured step can replay
        self.mask_kind = MASK_KINDS[model.config._attn_implementation]
        self.device = next(model.parameters()).device
        self.window = Window(0, 0, torch.zeros(1, dtype=torch.long, device=self.device))
        self.cache: DynamicCache | None = None
        self.generation = 0  # bumped when the buffers are reallocated: captured steps hold their addresses
        # the step's inputs, at fixed addresses: row i's last token, its position id, its first column
        self.last_tokens = torch.zeros(max_rows, 1, dtype=torch.long, device=self.device)
        self.position_ids = torch.zeros(max_rows, 1, dtype=torch.long, device=self.device)
        self.starts = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.columns = torch.arange(0, device=self.device)
        self.reset()

    def reset(self) -> StaticKV:
        """No rows (the buffers stay)."""
        self.n, self.length = 0, 0  # live rows; T, the next decode's write column
        self.row_starts: list[int] = []
        self.params: list[SamplingParams] = []
        self.rows = RowParams([], self.device)
        return self

    def __len__(self) -> int:
        return self.n

    @property
    def positions(self) -> torch.Tensor:
        """(n,) the position id of each row's last token (the one the next decode feeds)."""
        return self.position_ids[:self.n, 0]

    @property
    def width(self) -> int:
        """Columns the next decode attends over, per row (padding included)."""
        return self.length + 1

    def _buffers(self) -> DynamicCache:
        """The cache of buffers: ``_ensure`` makes it before the first decode."""
        if self.cache is None:
            raise RuntimeError("StaticKV has no buffers before its first merge or prepare")
        return self.cache

    def _slots(self) -> list[SlotLayer]:
        return cast("list[SlotLayer]", self._buffers().layers)  # the layers _ensure put there

    # ------------------------------------------------------------- surgery
    @torch.inference_mode()  # the buffers are inference tensors (made in a step): touched only in that mode
    def merge(self, other: KVBatch, lengths: list[int]) -> StaticKV:
        """``other``'s rows (newcomers just prefilled; ``lengths`` their prompts' tokens) after
        the running ones, right-aligned at T."""
        m, span = len(other), other.attention_mask.shape[1]
        if self.n + m > self.max_rows:
            raise ValueError(f"{self.n} + {m} rows do not fit the {self.max_rows} the buffers hold")
        self._ensure(max(span, self.length) + 1, other)
        if span > self.length:
            self._shift(span - self.length)
        n, end = self.n, self.length
        for layer, new in zip(self._slots(), filled_layers(other.cache)):
            layer.buffer_keys[n:n + m, :, end - span:end] = new.keys
            layer.buffer_values[n:n + m, :, end - span:end] = new.values
        self.row_starts += [end - k for k in lengths]
        self.last_tokens[n:n + m, 0] = other.last_tokens
        self.position_ids[n:n + m, 0] = other.positions
        self.n += m
        self.params = self.params + other.params
        self.rows = RowParams(self.params, self.device)
        self._upload_starts()
        return self

    @torch.inference_mode()  # also called between steps (a cancelled caller's row)
    def keep_rows(self, keep: list[int]) -> StaticKV | None:
        """Only rows ``keep`` (ascending), gathered to the top; None when none is left.
        Columns that are padding in every kept row go too."""
        if len(keep) == self.n:
            return self
        if not keep:
            self.reset()
            return None
        first = min(self.row_starts[i] for i in keep)
        k, end = len(keep), self.length
        # rows before the first that leaves stay where they are, unless columns go too
        stay = 0 if first else next((j for j, i in enumerate(keep) if i != j), k)
        if stay < k:  # else only the last rows left: nothing moves
            index = to_device(keep[stay:], torch.long, self.device)
            for layer in self._slots():
                for buffer in (layer.buffer_keys, layer.buffer_values):
                    buffer[stay:k, :, :end - first] = buffer[index, :, first:end]
            self.last_tokens[stay:k] = self.last_tokens[index]
            self.position_ids[stay:k] = self.position_ids[index]
        self.row_starts = [self.row_starts[i] - first for i in keep]
        self.n, self.length = k, end - first
        self.params = [self.params[i] for i in keep]
        self.rows = RowParams(self.params, self.device)
        self._upload_starts()
        return self

    def _shift(self, by: int) -> None:
        """The running rows' columns move right by ``by`` (a newcomer's prompt is longer than T)."""
        self._ensure(self.length + by + 1)
        n, end = self.n, self.length
        if n:
            for layer in self._slots():
                for buffer in (layer.buffer_keys, layer.buffer_values):
                    buffer[:n, :, by:by + end] = buffer[:n, :, :end].clone()
        self.row_starts = [s + by for s in self.row_starts]
        self.length = end + by

    def _upload_starts(self) -> None:
        self.starts.zero_()  # padding rows attend from column 0: never an empty mask
        if self.n:
            self.starts[:self.n] = to_device(self.row_starts, torch.long, self.device)

    def _ensure(self, columns: int, like: KVBatch | None = None) -> None:
        """Buffers of at least ``columns`` columns, the live rows' contents kept. The first
        ones take each layer's heads, head size and dtype from ``like``'s prefill (what the
        model's attention produces, whatever its config calls them)."""
        have = 0 if self.cache is None else self._slots()[0].buffer_keys.shape[2]
        if columns <= have:
            return
        size = max(2 * have, bucket(columns, 1 << 62), 64)
        if self.cache is not None:
            shapes = [(layer.buffer_keys, layer.buffer_values) for layer in self._slots()]
        else:
            assert like is not None, "the first buffers are shaped by a prefill"
            shapes = [(layer.keys, layer.values) for layer in filled_layers(like.cache)]
        layers = []
        for keys_like, values_like in shapes:
            keys = keys_like.new_zeros(self.max_rows, keys_like.shape[1], size, keys_like.shape[3])
            values = values_like.new_zeros(self.max_rows, values_like.shape[1], size, values_like.shape[3])
            if self.cache is not None and self.length:
                keys[:, :, :self.length] = keys_like[:, :, :self.length]
                values[:, :, :self.length] = values_like[:, :, :self.length]
            layers.append(SlotLayer(keys, values, self.window))
        cache = DynamicCache(config=self.model.config)
        cache.layers = list(layers)  # a new list of the element type transformers declares (lists are invariant)
        self.cache = cache
        self.columns = torch.arange(size, device=self.device)
        self.generation += 1

    # ------------------------------------------------------------- decode
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of the next decode: exact, or bucketed for a captured step."""
        if not self.bucketed:
            return self.n, self.length + 1
        columns = self._slots()[0].buffer_keys.shape[2]  # ≥ 64: short rows share one bucket
        return bucket(self.n, self.max_rows), bucket(max(self.length + 1, 64), columns)

    def prepare(self) -> tuple[int, int]:
        """Room and the write column for the next decode; returns its (rows, columns)."""
        self._ensure(self.length + 1)
        self.window.column.fill_(self.length)  # a device write, no host wait
        self.window.written = self.length
        return self.shape()

    def forward(self, rows: int, columns: int) -> torch.Tensor:
        """One decode forward over the first ``rows`` × ``columns``: (rows, vocab) logits. Reads
        only tensors at fixed addresses and the two ints, so it can be captured per shape."""
        self.window.rows, self.window.columns = rows, columns
        cols = self.columns[:columns]
        mask = (cols[None, :] >= self.starts[:rows, None]) & (cols[None, :] <= self.window.column)  # (rows, columns)
        mask = mask[:, None, None, :]  # (rows, 1, 1, columns): one query per row
        if self.mask_kind == "additive":
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill(~mask, torch.finfo(dtype).min)
        out = forward_with_cache(self.model, self._buffers(), input_ids=self.last_tokens[:rows],
                                 position_ids=self.position_ids[:rows], attention_mask=mask)
        return out.logits[:, -1]

    def advance(self, tokens: torch.Tensor) -> None:
        """After a decode: the fed tokens are in the buffers, ``tokens`` (n,) wait to go in."""
        self.last_tokens[:self.n, 0] = tokens
        self.position_ids[:self.n, 0] += 1
        self.length += 1
