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

import fcntl
import math
import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

Side = Literal["engine", "learner"]
SIDES: tuple[Side, Side] = ("engine", "learner")
WHOLE_WHEN_ALONE: dict[str, tuple[Side, ...]] = {"split": (), "colocated": SIDES, "colocated_learner": ("learner",),
                                                  "turns": SIDES}
"""Per ``rollout.thread_sharing``: the sides that take every core while the other is idle
(the runtime's :class:`CoreBudget` and the planner's model both read it here)."""


@dataclass(frozen=True)
class CoreBudget:
    """The rule of ``rollout.thread_sharing: colocated``, pure. A side (of ``whole``) wants every
    one of the ``cores`` when its counterpart has been idle for at least ``grace_s``, else its share of
    the split (``engine``, ``learner``: the counts ``split`` would hold always); it gets what
    it wants of the cores the other holds not — never more threads than cores in all — and
    0, wait, when the other holds them all (it gives one back at its next boundary).

    Why whole cores to one side, and never a thread more than cores: on two cores a third
    torch thread made both sides slower (docs/scaling.md: each op's two-thread barrier then
    waits for a descheduled thread), and generation gains little from a second core while
    the learner gains most of it, so what pays is the learner with both while the engine
    waits on the staleness gate, and the engine with both while the learner waits for a
    batch. ``grace_s``: a side idle for less than this is between two pieces of work (the
    engine between a group's end and the next admission), not idle, so the other does not
    take every core for one micro-batch only to give one back at once."""

    cores: int
    engine: int
    """The engine's share while both work; 0 (``rollout.thread_sharing: turns``): it waits
    whenever the learner works, and the learner's share is every core."""
    learner: int
    whole: tuple[Side, ...] = SIDES
    """The sides that take every core while the other is idle (``colocated``: both;
    ``colocated_learner``: the learner only, the engine keeping its share)."""
    grace_s: float = 0.05
    max_wait_s: float = 30.0
    """A side that has waited this long for a core (the other stuck inside one long op, or,
    in ``turns``, a learner step this long) computes on its share, at least one thread,
    anyway, and the wait is counted."""

    def __post_init__(self) -> None:
        yields = self.engine == 0 and self.learner == self.cores >= 1
        if not yields and (not 1 <= self.engine <= self.cores or not 1 <= self.learner <= self.cores):
            raise ValueError(f"a core budget needs 1 <= engine, learner <= cores (or engine 0 and learner = "
                             f"cores: turns); got {self}")

    def share(self, side: Side) -> int:
        return self.engine if side == "engine" else self.learner

    def fallback(self, side: Side) -> int:
        """Threads for a side that has waited ``max_wait_s``, or put back on its share while
        idle: its share, and one where that is 0 (a thread computes with one at least)."""
        return max(1, self.share(side))

    def threads(self, side: Side, other_idle_for: float | None, other_holds: int) -> int:
        """torch threads for ``side`` now (0: wait); ``other_idle_for``: seconds since the
        other side went idle, ``None`` while it works; ``other_holds``: threads it computes
        with now (0 while idle or waiting)."""
        idle = other_idle_for is not None and other_idle_for >= self.grace_s
        want = self.cores if idle and side in self.whole else self.share(side)
        return max(0, min(want, self.cores - other_holds))


# per side: idle since (CLOCK_MONOTONIC; NaN: working), threads held, seconds at every core,
# switches of count, seconds waited for a core
_SLOTS = (("idle_since", "d"), ("holds", "q"), ("all_cores_s", "d"), ("switches", "q"), ("waited_s", "d"))
_CELL_BYTES = 8 * len(_SLOTS) * len(SIDES)
WAIT_POLL_S = 0.002
"""How often a side waiting for a core looks again (the other gives one back at its next boundary)."""


class ThreadBudget:
    """Where the two sides of :class:`CoreBudget` meet: a small shared memory cell (an
    anonymous memory file, so a learner in its own process maps it through the descriptor
    it is handed: :meth:`attach`) holding each side's state, each slot written only by its
    own side. A side's claim — read the other's state, write its own count — is made under
    an exclusive ``flock`` on its own open description of the file (so it excludes the other
    side whether that is a thread of this process or another process): two sides can never
    both see the other holding nothing and both take every core.

    A side calls :meth:`working` at each of its boundaries (the engine before each decode or
    prefill step, the learner before each micro-batch's forward and backward): that claims
    its count by the rule, waiting while the other holds every core, sets the calling
    thread's torch threads, and counts the seconds spent at every core, the switches and the
    waits; :meth:`idle` when it stops (the engine with nothing to decode, the learner when a
    call returns), which gives its cores back and puts the thread on its share again.
    ``CLOCK_MONOTONIC`` is system-wide on Linux, so the processes' clocks agree.
    :meth:`counters` reads both sides' totals for the step's row."""

    def __init__(self, rule: CoreBudget, fd: int | None = None) -> None:
        """``fd``: a cell made by another process (:meth:`attach`); ``None``: a new one."""
        self.rule = rule
        self._new = fd is None
        if fd is None:
            fd = os.memfd_create("asyncrl-core-budget", os.MFD_CLOEXEC)
            os.ftruncate(fd, _CELL_BYTES)
        self.fd = fd
        self._map = mmap.mmap(fd, _CELL_BYTES)
        if self._new:
            now = time.monotonic()
            for side in SIDES:  # both idle until they first work
                self._put(side, "idle_since", now)
        self._locks: dict[Side, int] = {}  # each side's own open description of the cell, to flock
        self._since: dict[Side, float] = {}  # per side (its own process): when its current count began
        self._count: dict[Side, int] = {}

    @classmethod
    def attach(cls, rule: CoreBudget, fd: int) -> ThreadBudget:
        return cls(rule, fd)

    # ------------------------------------------------------------------ the cell
    def _offset(self, side: Side, name: str) -> int:
        i = [n for n, _ in _SLOTS].index(name)
        return 8 * (i * len(SIDES) + SIDES.index(side))

    def _get(self, side: Side, name: str) -> Any:
        kind = dict(_SLOTS)[name]
        return struct.unpack_from(f"={kind}", self._map, self._offset(side, name))[0]

    def _put(self, side: Side, name: str, value: Any) -> None:
        kind = dict(_SLOTS)[name]
        struct.pack_into(f"={kind}", self._map, self._offset(side, name), value)

    def _add(self, side: Side, name: str, value: Any) -> None:
        self._put(side, name, self._get(side, name) + value)

    @contextmanager
    def _claiming(self, side: Side) -> Iterator[None]:
        fd = self._locks.get(side)
        if fd is None:
            fd = self._locks[side] = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _close_interval(self, side: Side, now: float) -> None:
        """Count the seconds since this side's last boundary, if it spent them at every core."""
        since = self._since.get(side)
        if since is not None and self._count.get(side) == self.rule.cores:
            self._add(side, "all_cores_s", now - since)

    def _set_count(self, side: Side, count: int) -> None:
        if self._count.get(side, count) != count:
            self._add(side, "switches", 1)
        self._count[side] = count
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)

    # ------------------------------------------------------------------ the two verbs
    def working(self, side: Side) -> int:
        """Claim ``side``'s cores by the rule and set the calling thread's torch threads to them."""
        other = SIDES[1 - SIDES.index(side)]
        now = started = time.monotonic()
        self._close_interval(side, now)
        self._since.pop(side, None)
        self._put(side, "idle_since", math.nan)  # working from here: the other keeps to its share
        while True:
            with self._claiming(side):
                idle_since = self._get(other, "idle_since")
                count = self.rule.threads(side, None if math.isnan(idle_since) else now - idle_since,
                                          self._get(other, "holds"))
                if count == 0 and now - started >= self.rule.max_wait_s:
                    count = self.rule.fallback(side)
                self._put(side, "holds", count)
            if count:
                break
            time.sleep(WAIT_POLL_S)
            now = time.monotonic()
        if now > started:
            self._add(side, "waited_s", now - started)
        self._set_count(side, count)
        self._since[side] = now
        return count

    def idle(self, side: Side) -> None:
        """``side`` stops: its cores are free, and after the grace the other may take them
        all. Idle already (the engine's loop wakes for a weight load with nothing to decode):
        nothing changes, so the grace counts from when it stopped working."""
        if side not in self._since:
            return
        now = time.monotonic()
        self._close_interval(side, now)
        self._since.pop(side)
        self._put(side, "holds", 0)
        self._put(side, "idle_since", now)
        self._set_count(side, self.rule.fallback(side))

    def counters(self) -> dict[str, float]:
        """Each side's totals so far: seconds computed with every core, switches of count,
        seconds waited for a core."""
        return {f"{side}_{name}": float(self._get(side, name)) for side in SIDES
                for name in ("all_cores_s", "switches", "waited_s")}

    def close(self) -> None:
        for fd in self._locks.values():
            os.close(fd)
        self._locks.clear()
        self._map.close()
        os.close(self.fd)
