"""The decode step run eagerly, compiled, or replayed from CUDA graphs, one per shape.

Why: a small model's decode step on a GPU is launch-bound — hundreds of kernel launches,
each a few microseconds of host work, for a few milliseconds of device work. A CUDA graph
records the launches of one forward once and replays them with one call. It records
addresses, not values, so everything the step reads must live at a fixed address:
``StaticKV``'s buffers and input tensors, and the model's parameters — which is why
``TorchEngine.update_weights`` copies into the existing parameters and never swaps them.

One graph per (rows, columns) bucket (``static_kv.bucket``), captured when the bucket is
first used and dropped when the buffers are reallocated (their ``generation`` changes).
Sampling stays outside the graph (it runs eagerly on the device): per-row parameters and
the engine's generator change between steps, and a graph would freeze the generator's state.

``compile`` hands the same step to ``torch.compile`` (any device; on the CPU too).
A capture that fails falls back to the eager step for the rest of the engine's life,
with a warning that names the error: a model whose forward cannot be captured still decodes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch

from asyncrl.engine.static_kv import StaticKV, static_unsupported

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Capture = Literal["off", "graphs", "compile"]


class StepRunner:
    """``runner(kv)``: the next decode's logits (n, vocab) for ``kv``'s live rows."""

    def __init__(self, kv: StaticKV, capture: Capture) -> None:
        if capture == "graphs" and kv.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, and the engine's model is on {kv.device}: "
                             f"use capture='off' or 'compile'")
        self.kv = kv
        self.capture: Capture = capture
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._generation = -1
        self._pool: torch.cuda._POOL_HANDLE | None = None  # torch's type for a graph memory pool
        self._compiled: Callable[[int, int], torch.Tensor] | None = None
        if capture == "compile":
            self._compiled = torch.compile(kv.forward)

    def __call__(self) -> torch.Tensor:
        kv = self.kv
        rows, columns = kv.prepare()
        if self.capture == "graphs":
            try:
                logits = self._replay(rows, columns)
            except RuntimeError as exc:  # a forward that cannot be captured: decode eagerly from now on
                warnings.warn(f"asyncrl: the engine could not capture its decode step in a CUDA graph ({exc!r}); "
                              f"it decodes without graphs", RuntimeWarning, stacklevel=2)
                self.capture, self._graphs = "off", {}
                logits = kv.forward(rows, columns)
        elif self._compiled is not None:
            logits = self._compiled(rows, columns)
        else:
            logits = kv.forward(rows, columns)
        return logits[:len(kv)]

    def _replay(self, rows: int, columns: int) -> torch.Tensor:
        if self._generation != self.kv.generation:  # new buffers: the old graphs point at freed memory
            self._graphs.clear()
            self._generation = self.kv.generation
        entry = self._graphs.get((rows, columns))
        if entry is None:
            entry = self._graphs[(rows, columns)] = self._capture(rows, columns)
        graph, logits = entry
        graph.replay()
        return logits

    def _capture(self, rows: int, columns: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (lazy initialisations, cuBLAS workspaces), then record.
        Both write the same keys and values at the same column the replay then writes: the
        capture changes nothing a step reads."""
        forward = self.kv.forward
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(rows, columns)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the learner may be computing on this device from its own thread meanwhile
        # (colocated); the default (global) mode would fail its calls during the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = forward(rows, columns)
        return graph, logits


KVCache = Literal["auto", "dynamic", "static"]
# kv_cache="auto" on each device type: static buffers where they were measured no slower
# than the dynamic cache (docs/engine.md, "The decode path on a GPU")
STATIC_BY_DEFAULT = {"cuda": True, "cpu": False}


def decode_runner(model: PreTrainedModel, max_rows: int, kv_cache: KVCache,
                  capture: Capture | Literal["auto"]) -> StepRunner | None:
    """The static decode path for ``model``, or None for the dynamic cache (``kv_batch``).

    ``kv_cache="auto"``: static where the model allows it (``static_unsupported``) and the
    device's entry in ``STATIC_BY_DEFAULT`` says so; ``capture="auto"``: CUDA graphs on a
    CUDA device with the static cache, else none."""
    device = next(model.parameters()).device
    why_not = static_unsupported(model)
    if kv_cache == "static" and why_not:
        raise ValueError(f"kv_cache='static' cannot serve this model: {why_not}; use kv_cache='dynamic'")
    static = kv_cache == "static" or (kv_cache == "auto" and why_not is None
                                       and STATIC_BY_DEFAULT.get(device.type, False))
    if capture == "auto":
        capture = "graphs" if static and device.type == "cuda" else "off"
    if not static:
        if capture != "off":
            raise ValueError(f"capture={capture!r} needs the static KV cache, and this engine decodes with the "
                             f"dynamic one ({why_not or 'kv_cache=' + repr(kv_cache)}): use capture='off'")
        return None
    return StepRunner(StaticKV(model, max_rows, bucketed=capture != "off"), capture)
