"""Memory: freed heap pages go back to the OS (asyncrl/heap.py says what grew without it)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from asyncrl.heap import HeapTrimmer


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_trimmer_is_rate_limited_unless_forced():
    heap = HeapTrimmer(interval_s=60.0)
    if not heap.is_supported:
        assert not heap.trim(force=True)
        return
    assert heap.trim() and not heap.trim()  # the first call trims; the next within the interval does not
    assert heap.trim(force=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, read back from /proc")
def test_trim_returns_freed_memory_that_glibc_keeps():
    """Blocks below glibc's mmap threshold freed between survivors stay resident: the heap
    cannot shrink past the survivors. A trim hands the holes back."""
    blocks = [torch.ones(16_000) for _ in range(4000)]  # 64 KB each, ~250 MB
    kept = blocks[::8]  # a survivor every 512 KB pins the heap
    del blocks
    before = _rss_mb()
    start = time.perf_counter()
    assert HeapTrimmer().trim(force=True)
    took = time.perf_counter() - start
    assert before - _rss_mb() > 150, "the ~220 MB freed between survivors stayed resident"
    assert took < 1.0 and len(kept) == 500
