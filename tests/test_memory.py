"""Memory: freed heap pages go back to the OS, and the shipped agent example stays within
its bound (asyncrl/heap.py says what grew without them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from asyncrl.bench.child import train_in_child
from asyncrl.config import load_config
from asyncrl.heap import HeapTrimmer

SEARCH_AGENT = "examples/search_agent/async.yaml"
PEAK_BOUND_MB = 1500
"""The agent example's peak resident memory (the trainer process). This test's three steps
reached 3.2 GB before the learner's token budget and the heap trimming, 0.9 GB after; the
12-step run 7.6 GB before, 1.1 GB after."""


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
    # a trim is cheap: 0.04-0.19 s measured with other jobs on both cores (load ≈ 5); the bound
    # is generous for a loaded machine
    assert took < 3.0 and len(kept) == 500


MAPPED_CHILD = """
import sys
from asyncrl.heap import mapped_above

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

def freed_mb():
    pairs = [(b"x" * (2 << 20), b"y" * (64 << 10)) for _ in range(64)]  # 2 MiB + a 64 KiB survivor each
    kept = [small for _, small in pairs]
    before = rss_mb()
    del pairs
    return before - rss_mb() + 0 * len(kept)

with mapped_above(1 << 20):
    inside = freed_mb()
    with mapped_above(1 << 20, trim=False):  # a span within a span: a recomputed layer's within a backward's
        pass
    nested = freed_mb()
print(inside, nested, freed_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, read back from /proc")
def test_within_mapped_above_large_blocks_go_back_at_free_and_after_it_the_heap_keeps_them():
    """2 MiB blocks, each followed by a 64 KiB survivor, then the blocks freed, in a fresh
    process (a heap's free chunks serve an allocation before any threshold is asked, so it
    must start without any). Within ``mapped_above(1 MiB)`` each block is its own mapping,
    unmapped when freed: the 128 MiB leave at once, also after a span within it has ended
    (it puts the outer span's threshold back, not glibc's). After it (threshold back at 32
    MiB) the same blocks come from the heap, and the survivors keep the freed holes resident."""
    out = subprocess.run([sys.executable, "-c", MAPPED_CHILD], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    inside, nested, outside = map(float, out.split())
    assert inside > 120, f"only {inside:.0f} of 128 MiB of mapped blocks went back at free"
    assert nested > 120, f"only {nested:.0f} of 128 MiB went back after an inner span ended: it reset the threshold"
    assert outside < 40, f"{outside:.0f} MiB went back at free with the heap's threshold: nothing to show"


@pytest.mark.slow
def test_search_agent_example_peak_memory(tmp_path):
    """A short run of the shipped agent config in a child process, learner forced to train
    (``filter_zero_variance=false``: whatever the policy scores, every step runs the full
    batch through the learner), peak resident memory under the bound. This process holds
    1.6 GB meanwhile: the figure must be the child's own, whatever the process that starts
    it holds (``ru_maxrss`` read 4.4 GB for a 0.9 GB run after the suite had loaded a real
    model; asyncrl/bench/child.py)."""
    pytest.importorskip("openai")
    pytest.importorskip("bm25s")
    cfg = load_config(SEARCH_AGENT, [f"output_dir={tmp_path / 'run'}", "total_steps=3", "eval_every=0",
                                     "eval.num_tasks=8", "eval.samples_per_task=1",
                                     "algorithm.filter_zero_variance=false"])
    ballast = torch.ones(400_000_000)  # 1.6 GB, every page written
    peak = train_in_child(cfg, tmp_path / "config.yaml")
    del ballast
    assert peak < PEAK_BOUND_MB, f"peak resident memory {peak:.0f} MB"
