"""Staleness gate: decides when the rollout side may start another task group.

The rule
--------
A group may start only while ``started < (v + 1) * B + E`` with ``E = floor(η · B)``,
where ``v`` is the learner's current (published) version, ``B`` the groups consumed per
optimizer step and ``η`` the maximum staleness, a non-negative real (η = 0 is
synchronous/on-policy, η = 1 is one-step-off, η = 0.5 lets half a batch come from the
previous version). ``started`` counts groups that were started and not filtered out:
groups in flight plus groups completed and accepted, whether still in the buffer or
already consumed by the learner. For an integer η, ``E = η · B`` and the limit is
``(η + v + 1) * B``; η = 0 gives ``(v + 1) * B``, exactly ``sync``. ``E`` is computed on
η as an exact fraction (``modes.staleness_fraction``), so no float error moves it.

Why this bounds staleness (the age)
-----------------------------------
Number the groups that are kept (never rejected) 0, 1, 2, ... in the order they
were started. The learner consumes B groups per step, so when groups are
consumed in start order, kept group ``i`` is consumed by the step that trains
version ``floor(i / B)``. Every kept group started before group ``i`` was in
flight or accepted when ``i`` started, so it was counted in ``started`` then;
hence ``i <= started < (v_s + 1) * B + E`` where ``v_s`` is the version at
which ``i`` started, i.e. ``i <= (v_s + 1) * B + E - 1``. So
``floor(i / B) - v_s <= 1 + floor((E - 1) / B) = ceil(E / B) <= ceil(η)``
(for integers, ``floor((E - 1) / B) + 1 = ceil(E / B)``; and ``E / B <= η``). At
η = 0 the lag is 0; for 0 < η <= 1 it is at most 1. ``ceil(η)`` is the *age* bound
(``max_lag``): every check of a sample's age uses it, never η itself.

Why this bounds the off-policy share (the count)
------------------------------------------------
This one holds under any completion order and any rule for which groups a step
takes. Call a group of the step that trains version ``k`` off-policy when it
started before version ``k`` (a group started at ``v_s >= k`` has no token older
than ``k``: the engines hold at least the gate's version). Consider the moment the
version moves to ``k``. Every kept group started before then holds quota at that
moment (it is running, in the buffer or consumed, and is never rejected), and
``started`` never exceeds the limit (``on_start`` checks it, and the limit only
grows; a resume with a smaller η is the exception, until versions catch up), so at
most the limit at version ``k - 1``, ``k * B + E``, kept groups were ever started
before version ``k``. The ``k * B`` groups consumed by the steps before version
``k``'s are among them (each was started before it was consumed, before version
``k`` existed). That leaves at most ``E = floor(η · B)`` for the step that trains
``k`` (and the later ones together): for η in (0, 1), at most ``floor(η · B)`` of a
batch's B groups come from the previous version, the other ones are on-policy. For
η >= 1, ``E >= B`` and the count says nothing the age does not. "Version" here is the
gate's, the one the engines were given; it is the learner's whenever weights sync
every step, the only ``sync_every`` an η below 1 allows.

Why rejection must release quota
--------------------------------
A group that is filtered (all rewards equal -> zero advantage, too stale, all
episodes errored) will never be consumed. If it kept counting as started, the
learner would wait for B kept groups that can never be started: the run
stalls. So ``on_reject`` decrements ``started`` whether the group was still
running or already accepted into the buffer.

What the gate does not guarantee
--------------------------------
Groups complete out of order: a slow group started at ``v_s`` can land in the
buffer after many younger groups were consumed, and the age argument (which needs
start-order consumption) no longer holds for it; the count still does. The gate
bounds the *count*; the buffer must assert the *age*: it checks each trajectory's version
against the learner's and drops (calling ``on_reject(was_accepted=True)``, which
releases the quota) any older than ``ceil(η)``.

The core ``StalenessGate`` is plain counters, no asyncio, so it can be tested
without a model or an event loop; ``AsyncStalenessGate`` adds waiting.

The definitions
---------------
η per mode, a trajectory's staleness and the partial-rollout mode a schedule really uses
are pure definitions and live on the ground floor, in ``asyncrl/modes.py``: the config,
the runtime and the report need them without the gate.
"""

from __future__ import annotations

import asyncio

from asyncrl.modes import off_policy_groups, staleness_fraction, staleness_lag, trajectory_staleness

__all__ = ["AsyncStalenessGate", "StalenessError", "StalenessGate", "check_staleness"]


class StalenessError(RuntimeError):
    """A trajectory older than ``ceil(η)`` reached the learner: a bug in the gate or buffer."""


def check_staleness(trained_version: int, behavior_version_min: int, max_staleness: int, what: str) -> int:
    """The staleness of ``what``; raises when it is outside ``[0, max_staleness]``, the age
    bound (the gate's ``max_lag``, ``ceil(η)``). A sample older than that is a bug, not a
    statistic, so this is not an ``assert`` (it must hold under ``-O``)."""
    age = trajectory_staleness(trained_version, behavior_version_min)
    if not 0 <= age <= max_staleness:
        raise StalenessError(f"{what} is {age} versions old at version {trained_version}; the bound is "
                             f"{max_staleness}")
    return age


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class StalenessGate:
    """Counts started groups against the quota ``(v + 1) * B + floor(η · B)``.

    Lifecycle of one group: ``on_start`` -> ``on_accept`` or ``on_reject()``;
    an accepted group may later be dropped by the buffer with
    ``on_reject(was_accepted=True)``. Consumption by the learner is *not*
    reported here: a consumed group still counts as started (it used its
    quota), and only ``on_version`` grows the quota. Misuse (more accepts or
    rejects than there are groups in that state, version going backwards)
    raises instead of silently going negative, because a wrong count either
    stalls the run or lets staleness exceed its bound.
    """

    __slots__ = ("_max_staleness", "_groups_per_step", "_extra", "_version", "_running", "_accepted", "_rejected")

    def __init__(self, max_staleness: float, groups_per_step: int, version: int = 0) -> None:
        staleness_fraction(max_staleness)  # a non-negative number, or a ValueError naming it
        self._max_staleness = max_staleness
        self._groups_per_step = _check_int("groups_per_step", groups_per_step, 1)
        self._extra = off_policy_groups(max_staleness, groups_per_step)
        self._version = _check_int("version", version, 0)
        self._running = 0
        self._accepted = 0
        self._rejected = 0

    # -- read-only state -------------------------------------------------
    @property
    def max_staleness(self) -> float:
        """η as configured (an int stays an int)."""
        return self._max_staleness

    @property
    def max_lag(self) -> int:
        """``ceil(η)``: the most versions a trained token may be old (the module's proof).
        Every age check (the buffer's deadlines, the learner's assertion) asks this."""
        return staleness_lag(self._max_staleness)

    @property
    def off_policy_groups(self) -> int:
        """``floor(η · B)``: the most groups of one step started before the version it trains."""
        return self._extra

    @property
    def groups_per_step(self) -> int:
        return self._groups_per_step

    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        """Groups started and not yet accepted or rejected."""
        return self._running

    @property
    def accepted(self) -> int:
        """Groups accepted and not later rejected (in the buffer or consumed)."""
        return self._accepted

    @property
    def rejected(self) -> int:
        """Cumulative rejections (informational: they no longer count as started)."""
        return self._rejected

    @property
    def started(self) -> int:
        """Groups holding quota: running + accepted."""
        return self._running + self._accepted

    @property
    def limit(self) -> int:
        """``(v + 1) * B + floor(η · B)``: the most groups that may hold quota at version v
        (``(η + v + 1) * B`` for an integer η)."""
        return (self._version + 1) * self._groups_per_step + self._extra

    @property
    def capacity(self) -> int:
        """How many more groups may start now; clamped at 0 (a resume with a
        smaller η can leave ``started`` above the limit)."""
        return max(0, self.limit - self.started)

    def can_start(self) -> bool:
        return self.capacity > 0

    # -- transitions -----------------------------------------------------
    def on_start(self) -> None:
        """Take one unit of quota. Callers must check ``can_start`` first."""
        if not self.can_start():
            raise RuntimeError(
                f"no staleness capacity: started={self.started} limit={self.limit} (version={self._version})"
            )
        self._running += 1

    def on_accept(self) -> None:
        """A running group completed and was kept; it keeps its quota."""
        if self._running <= 0:
            raise RuntimeError("on_accept with no running group")
        self._running -= 1
        self._accepted += 1

    def on_reject(self, was_accepted: bool = False) -> None:
        """A group was filtered/dropped and releases its quota.

        ``was_accepted=False``: a running group ended and was filtered before
        acceptance. ``was_accepted=True``: an accepted group still in the
        buffer was dropped (e.g. too stale). Rejecting a group the learner has
        already consumed is a caller bug the gate cannot detect.
        """
        if was_accepted:
            if self._accepted <= 0:
                raise RuntimeError("on_reject(was_accepted=True) with no accepted group")
            self._accepted -= 1
        else:
            if self._running <= 0:
                raise RuntimeError("on_reject() with no running group")
            self._running -= 1
        self._rejected += 1

    def on_version(self, version: int) -> None:
        """The learner published ``version``; repeats are allowed, going back is not."""
        version = _check_int("version", version, 0)
        if version < self._version:
            raise ValueError(f"version went backwards: {self._version} -> {version}")
        self._version = version

    # -- resume ----------------------------------------------------------
    @classmethod
    def resumed(cls, max_staleness: float, groups_per_step: int, version: int, accepted: int) -> StalenessGate:
        """The gate of a run resumed from a checkpoint at ``version``: ``accepted`` groups
        hold quota (those its steps consumed and those saved in its buffer) and none is
        running. The groups in flight at the checkpoint died with the process; keeping
        their quota would be exactly the leak that stalls a run. Their tasks are re-issued
        and take quota again when they start. A resume with a smaller η can leave
        ``started`` above the limit: capacity is then 0 until versions catch up."""
        gate = cls(max_staleness, groups_per_step, version)
        gate._accepted = _check_int("accepted", accepted, 0)
        return gate

    def __repr__(self) -> str:
        return (
            f"StalenessGate(η={self._max_staleness}, B={self._groups_per_step}, v={self._version}, "
            f"running={self._running}, accepted={self._accepted}, capacity={self.capacity})"
        )


class AsyncStalenessGate:
    """A ``StalenessGate`` that rollout tasks can wait on.

    Every change that can grow capacity (a rejection, a new version) notifies
    all waiters; each re-checks under the lock. ``acquire`` takes quota only
    after its wait returns, with no await in between, so a waiter cancelled
    while waiting never holds quota.
    """

    def __init__(self, gate: StalenessGate) -> None:
        self.gate = gate
        self._cond = asyncio.Condition()

    @property
    def version(self) -> int:
        """The version the gate admits for: the last one the engines were given."""
        return self.gate.version

    @property
    def max_staleness(self) -> int | float:
        """η: held by the gate alone; the buffer and the learner's check ask it here."""
        return self.gate.max_staleness

    @property
    def groups_per_step(self) -> int:
        return self.gate.groups_per_step

    @property
    def max_lag(self) -> int:
        """``ceil(η)``, the age bound (the gate's)."""
        return self.gate.max_lag

    @property
    def started(self) -> int:
        """Groups holding quota (running or accepted), the gate's."""
        return self.gate.started

    async def acquire(self) -> None:
        """Wait until a group may start, then count it as started (running)."""
        async with self._cond:
            await self._cond.wait_for(self.gate.can_start)
            self.gate.on_start()

    async def accept(self) -> None:
        """A running group was kept. Does not change capacity, so no notify."""
        self.gate.on_accept()

    async def release_rejected(self, was_accepted: bool = False) -> None:
        """A group was filtered/dropped: release its quota and wake waiters."""
        async with self._cond:
            self.gate.on_reject(was_accepted)
            self._cond.notify_all()

    async def set_version(self, version: int) -> None:
        """The learner published ``version``: the quota grows, wake waiters."""
        async with self._cond:
            self.gate.on_version(version)
            self._cond.notify_all()
