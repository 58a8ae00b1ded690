"""Handing freed host memory back to the operating system.

glibc's malloc keeps what a process frees, for reuse. A torch process that frees tensors
of ever-changing sizes on several threads at once (the engine's KV cache grows by one
position a decode step, the learner's activations come and go, each thread allocates from
its own arena) fragments those arenas until the kept memory is rarely reused: resident
memory only climbs, to many times what live tensors hold; trimming as below keeps it near
them. glibc's own knob, a fixed ``M_MMAP_THRESHOLD``, returns memory at every free
instead, but then each larger tensor is a fresh mapping whose pages fault in again, and
the engine reallocates its KV cache every decode step. Trimming now and then is cheap when
there is nothing to give back. The figures: docs/design.md, "Measurements behind choices
in the code".

Trimming between calls does not bound the peak *within* one: glibc raises its mmap threshold
to the size of each mapped block freed (up to 32 MiB), after which every activation below it
comes from the heap, and a training call's heap grew to several times its live tensors
before any trim could run (serve-tinker: a 948-token micro-batch's forward and backward held
+1.5 GB resident for ~0.2 GB live; ``docs/tinker.md``, "Memory"). :func:`mapped_above` fixes
the threshold for the length of a forward pass (serve-tinker: each micro-batch's forward,
and each recomputed layer's in the backward), so the activations, which pile up there, are
mappings the kernel takes back at each free. The backward of a small micro-batch runs from
the heap: its tensors are freed about as fast as they are made, so the heap reuses its
chunks, where a mapping each would fault every page in afresh; a large one's heap still
outgrew its live tensors by hundreds of MB, so its backward is mapped too
(``docs/tinker.md``, "Memory").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import contextlib
import time
from collections.abc import Callable, Iterator

M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the mmap threshold (glibc's ``malloc.h``)."""
DYNAMIC_MMAP_CEILING = 32 << 20
"""The highest mmap threshold glibc's own rule climbs to on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``):
where :func:`mapped_above` leaves it, since a threshold set once is never dynamic again."""


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or ``None`` where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


_SPANS: list[int] = []
"""The thresholds of the :func:`mapped_above` spans now entered, innermost last (a span within
another puts the outer one's back when it ends, not glibc's)."""


@contextlib.contextmanager
def mapped_above(nbytes: int, *, trim: bool = True) -> Iterator[None]:
    """Within: an allocation of ``nbytes`` or more that the heap's free chunks cannot serve
    is its own mapping, unmapped (its pages back to the OS) when freed, so resident memory
    follows the live tensors past what the heap already held (glibc serves from its free
    chunks before it asks the threshold: ``tests/test_memory.py`` starts a fresh process to
    show the difference); on leaving, the threshold is the enclosing span's, or outside
    every span :data:`DYNAMIC_MMAP_CEILING` (what glibc's rule reaches anyway once a process
    has freed a large block: the engine's heap behaves as before) and the heap is trimmed.
    The setting is the process's: the sampling engine's thread allocates under it too while
    it lasts (each decode step's larger tensors then fault their pages in afresh, the
    slowdown ``docs/design.md`` measured), so it is for the span of a forward pass, not for
    good. ``trim=False`` skips the trim on leaving (a span entered once a layer, where a
    trim's pages would only fault in again at the next); within another span it never trims.
    A no-op where the C library has no ``mallopt``."""
    mallopt, malloc_trim = _mallopt(), _malloc_trim()
    if mallopt is None:
        yield
        return
    _SPANS.append(nbytes)
    mallopt(M_MMAP_THRESHOLD, nbytes)
    try:
        yield
    finally:
        _SPANS.pop()
        mallopt(M_MMAP_THRESHOLD, _SPANS[-1] if _SPANS else DYNAMIC_MMAP_CEILING)
        if trim and not _SPANS and malloc_trim is not None:
            malloc_trim(0)


def trim_heap() -> None:
    """Every arena's free pages back to the OS now (a no-op where there is no ``malloc_trim``)."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)


class HeapTrimmer:
    """Gives the process's free heap pages back to the OS, at most once per ``interval_s``.

    Each owner (an engine thread, a learner) keeps its own: ``malloc_trim`` walks every
    thread's arena whoever calls it, so any caller releases what all threads freed."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._trim = _malloc_trim()
        self._last = float("-inf")

    @property
    def is_supported(self) -> bool:
        return self._trim is not None

    def trim(self, *, force: bool = False) -> bool:
        """Trim if ``interval_s`` has passed since the last trim (or ``force``); returns
        whether it did."""
        now = time.monotonic()
        if self._trim is None or (not force and now - self._last < self.interval_s):
            return False
        self._trim(0)
        self._last = now
        return True
