"""How the engine thread and the learner share the CPU's cores
(``rollout.thread_sharing: colocated``): the side working alone takes them all, both
working split them. :class:`CoreBudget` is the rule, pure; :class:`ThreadBudget` the cell
the two sides meet in — the engine's thread in this process, the learner's thread here or
in its own process (``learner.process``) — and where each sets its own torch threads.

torch's intra-op thread count is per OS thread (an OpenMP team each), which is why each
side can hold its own count and change it at its own boundaries; the engine's thread and
the learner's may even live in two processes. Why the switch pays, and what it measured:
docs/scaling.md, "Where generation and training run".
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

Side = Literal["engine", "learner"]
SIDES: tuple[Side, Side] = ("engine", "learner")


@dataclass(frozen=True)
class CoreBudget:
    """The rule of ``rollout.thread_sharing: colocated``, pure: a side whose counterpart has
    been idle for at least ``grace_s`` computes with all ``cores``; otherwise with its share
    of the split (``engine`` + ``learner`` threads, the counts ``split`` would use always).

    Why whole cores to one side and never more threads than cores in all: on two cores a
    third torch thread made both sides slower (docs/scaling.md), and generation gains little
    from a second core while the learner gains most of it, so what pays is the learner having
    both while the engine waits on the staleness gate, and the engine both while the learner
    waits for a batch. ``grace_s``: a side idle for less than this is taken as between two
    pieces of work (the engine between a group's end and the next admission), not as idle,
    so the other does not grab every core for one micro-batch only to share them at once."""

    cores: int
    engine: int
    learner: int
    grace_s: float = 0.05

    def __post_init__(self) -> None:
        if min(self.cores, self.engine, self.learner) < 1 or max(self.engine, self.learner) > self.cores:
            raise ValueError(f"a core budget needs 1 <= engine, learner <= cores; got {self}")

    def threads(self, side: Side, other_idle_for: float | None) -> int:
        """torch threads for ``side`` now; ``other_idle_for``: seconds since the other side
        went idle, ``None`` while it works."""
        if other_idle_for is not None and other_idle_for >= self.grace_s:
            return self.cores
        return self.engine if side == "engine" else self.learner


_CELL = struct.Struct("=2d2d2q")  # per side: idle since (monotonic; NaN: working), seconds at all cores, switches
_SLOT_F, _SLOT_Q = struct.Struct("=d"), struct.Struct("=q")  # one side's slot of the cell


class ThreadBudget:
    """Where the two sides of :class:`CoreBudget` meet: each side's state in a small shared
    memory cell (an anonymous memory file, so a learner in its own process maps it through
    the descriptor it is handed: :meth:`attach`), each slot written only by its own side,
    so no lock is needed; a stale read costs one boundary at the old count.

    A side calls :meth:`working` at each of its boundaries (the engine before each decode or
    prefill step, the learner before each micro-batch's forward and backward): that marks it
    working, sets the calling thread's torch threads by the rule and counts the seconds spent
    at all cores and the switches between counts; :meth:`idle` when it stops (the engine
    with nothing to decode, the learner when a call returns), which puts the thread back on
    its split count. ``CLOCK_MONOTONIC`` is system-wide on Linux, so the processes' clocks
    agree. :meth:`counters` reads both sides' totals for the step's row."""

    def __init__(self, rule: CoreBudget, fd: int | None = None) -> None:
        """``fd``: a cell made by another process (:meth:`attach`); ``None``: a new one."""
        self.rule = rule
        if fd is None:
            fd = os.memfd_create("asyncrl-thread-budget", os.MFD_CLOEXEC)
            os.ftruncate(fd, _CELL.size)
            self.fd = fd
            self._map = mmap.mmap(fd, _CELL.size)
            now = time.monotonic()
            self._write(now, now, 0.0, 0.0, 0, 0)  # both idle until they first work
        else:
            self.fd = fd
            self._map = mmap.mmap(fd, _CELL.size)
        self._since: dict[Side, float] = {}  # per side (its own process): when its current count began
        self._count: dict[Side, int] = {}

    @classmethod
    def attach(cls, rule: CoreBudget, fd: int) -> ThreadBudget:
        return cls(rule, fd)

    def _read(self) -> tuple[Any, ...]:
        return _CELL.unpack_from(self._map, 0)

    def _write(self, *values: Any) -> None:
        _CELL.pack_into(self._map, 0, *values)

    def _set(self, side: Side, *, idle_since: float, add_s: float, switched: bool) -> None:
        """Write this side's own slots only (the other side writes its own meanwhile)."""
        i = SIDES.index(side)
        values = self._read()
        _SLOT_F.pack_into(self._map, 8 * i, idle_since)
        _SLOT_F.pack_into(self._map, 16 + 8 * i, values[2 + i] + add_s)
        _SLOT_Q.pack_into(self._map, 32 + 8 * i, values[4 + i] + int(switched))

    def _close_interval(self, side: Side, now: float) -> float:
        """Seconds since this side's last boundary, if it spent them at all cores."""
        since = self._since.get(side)
        return now - since if since is not None and self._count.get(side) == self.rule.cores else 0.0

    def working(self, side: Side) -> int:
        """Mark ``side`` working and set the calling thread's torch threads by the rule."""
        now = time.monotonic()
        other_since = self._read()[1 - SIDES.index(side)]
        count = self.rule.threads(side, None if math.isnan(other_since) else now - other_since)
        before = self._count.get(side)
        self._set(side, idle_since=math.nan, add_s=self._close_interval(side, now),
                  switched=before is not None and count != before)
        if count != torch.get_num_threads():
            torch.set_num_threads(count)
        self._since[side], self._count[side] = now, count
        return count

    def idle(self, side: Side) -> None:
        """Mark ``side`` idle: the other may take every core after the grace. Idle already
        (the engine's loop wakes for a weight load with nothing to decode): nothing changes,
        so the grace counts from when it stopped working."""
        if side not in self._since:
            return
        now = time.monotonic()
        split = self.rule.engine if side == "engine" else self.rule.learner
        before = self._count.get(side)
        self._set(side, idle_since=now, add_s=self._close_interval(side, now),
                  switched=before is not None and before != split)
        if before is not None and torch.get_num_threads() != split:
            torch.set_num_threads(split)
        self._since.pop(side, None)
        self._count[side] = split

    def counters(self) -> dict[str, float]:
        """Each side's totals so far: seconds computed with all cores, switches of count."""
        values = self._read()
        return {f"{side}_all_cores_s": values[2 + i] for i, side in enumerate(SIDES)} | {
            f"{side}_switches": float(values[4 + i]) for i, side in enumerate(SIDES)}

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)
