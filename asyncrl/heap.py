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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


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
