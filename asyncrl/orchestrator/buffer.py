"""The group buffer between rollouts and the learner.

Hands the learner the oldest-started ready groups first, and never a trajectory older
than η: a group that aged past the bound while it waited (out-of-order completion) is
dropped here and its quota released to the gate (see ``staleness.py`` for why the gate
alone cannot promise the age).

A batch is its groups in start order, and start order is the task stream's order (a
re-issued task after a resume aside). At η = 0 that makes a batch independent of the
order groups finish in: the gate lets at most B groups hold quota beyond those trained,
so when B are ready none is running, and each rejected group was replaced by the next
task of the stream; the batch is the shortest stretch of the stream holding B accepted
groups, in stream order — exactly ``mode=sync``'s. With per-episode seeds
(``asyncrl/seeding.py``) that makes ``mode=async`` with ``max_staleness=0`` train on
``mode=sync``'s samples (``tests/test_reproducible.py``). At η > 0 which groups are
ready when the learner asks is timing, and so is a batch.

A group that would age past η, and how none does (``stale_groups``)
-----------------------------------------------------------------
The gate's proof needs groups consumed in start order, and at η > 0 they are not: the
learner takes what is ready, so a slow group (long responses) can watch younger ones fill
batch after batch until it is too old, and is dropped. With ``stale_groups: drop`` that
is what happens (counted: ``buffer/stale_dropped_total``, with their trajectories and
tokens); it throws away generation, and the slowest — the longest — groups first, which
biases training towards short responses. With ``stale_groups: wait`` (the default) the
learner takes groups earliest deadline first (a group's deadline is the last version it
is fresh for: its oldest token's version + η; a group still generating has at least the
version it started under, so its deadline is at least that + η) and waits before a batch
that would leave some group no step to be trained in fresh: for every deadline D, the
groups due by D — ready or still generating — must fit in the slots the steps up to D
have left. Why such a batch always comes (B groups a step; the invariant, at the start of
step t: for every D ≥ t at most (D − t + 1)·B groups not consumed or rejected are due by
D):

- at t = 0 every group started under version 0, so is due at η or later, and the gate
  admits at most (η + 1)·B;
- once every group due by D has landed or been filtered, taking earliest deadlines first
  takes min(B, due by D) of them, which leaves at most (D − t)·B by the invariant: a wait
  ends, because groups generating land or are filtered;
- so after step t at most (D − t)·B are left due by each D < t + η, and no group admitted
  during step t (under version t) is due before t + η; for D ≥ t + η the gate bounds the
  count itself: groups started under versions ≤ D − η number at most (D + 1)·B (its count
  argument), and the (t + 1)·B consumed by then were all started under versions ≤ t, so
  at most (D − t)·B = (D − (t + 1) + 1)·B are left. The invariant holds at step t + 1.

(A deadline the buffer sees is never earlier than the one argued with: a group registers
the version when it begins generating, at least the one it was admitted under, and its
tokens are no older.) It costs the learner a wait where ``drop`` would have trained
younger groups and thrown the old one away. The age check stays: a group that went
stale anyway (an episode replayed from before a resume carries older tokens than its
restart; a resume with a smaller η) is dropped and counted, and ``trainable`` still
stops the run on one older than η.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import cached_property

from asyncrl.orchestrator.staleness import AsyncStalenessGate, check_staleness
from asyncrl.types import NO_VERSION, Group, Trajectory


@dataclass
class ReadyGroup:
    group: Group
    start_order: int  # the gate admitted groups in this order

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for e in self.group.episodes for t in e.trajectories]

    @cached_property
    def oldest_version(self) -> int:
        """The oldest policy version any of its model tokens came from (a ready group's
        tokens no longer change; the buffer's ordering asks for it often). A trajectory
        with no model token has no version and is not trained (``trainable``): it does not
        count, or every group holding one would look stale forever and be dropped; a group
        with no model token at all is ``NO_VERSION``, dropped as stale."""
        return min((t.behavior_version_min for t in self.trajectories if t.num_model_tokens), default=NO_VERSION)

    @property
    def model_tokens(self) -> int:
        return sum(t.num_model_tokens for t in self.trajectories)


STALE_GROUPS = ("wait", "drop")


class GroupBuffer:
    def __init__(self, gate: AsyncStalenessGate, stale_groups: str = "wait") -> None:
        """``stale_groups``: ``wait`` or ``drop`` (the module's docstring). η and B are the
        gate's (``max_staleness``, ``gate.groups_per_step``), asked, never copied."""
        if stale_groups not in STALE_GROUPS:
            raise ValueError(f"stale_groups must be one of {STALE_GROUPS}, got {stale_groups!r}")
        self.gate = gate
        self.stale_groups = stale_groups
        self.stale_dropped = 0
        self.counts: dict[str, int] = dict.fromkeys(BUFFER_COUNTS, 0)
        """``rollout/<name>_total``: the rollout loop shares the watchdog's counters here."""
        self._ready: list[ReadyGroup] = []
        self._running: dict[int, int] = {}  # start order -> the oldest version its tokens can have
        self._taken: tuple[int, int] = (-1, 0)  # (trained version, groups taken for it so far)
        self._first_taken = False  # the learner has taken a batch, or the run resumed (hold_to_first_batch)
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._ready)

    @property
    def max_staleness(self) -> int | float:
        """η, the gate's."""
        return self.gate.max_staleness

    @property
    def max_lag(self) -> int:
        """The age bound every check uses, ``ceil(η)``: the gate's."""
        return self.gate.max_lag

    def running(self, start_order: int, version: int) -> None:
        """A group starts generating, and none of its tokens will be older than ``version``
        (the engines hold at least the gate's version): the learner may wait for it."""
        self._running[start_order] = version

    async def put(self, ready: ReadyGroup) -> None:
        await self.gate.accept()
        async with self._changed:
            self._running.pop(ready.start_order, None)
            self._ready.append(ready)
            self._changed.notify_all()

    async def reject(self, start_order: int) -> None:
        """A running group was filtered or every episode failed: its quota goes back to the
        gate, and a learner waiting on it is told."""
        await self.gate.release_rejected()
        async with self._changed:
            self._running.pop(start_order, None)
            self._changed.notify_all()

    def snapshot(self) -> list[ReadyGroup]:
        """The groups waiting now (for a checkpoint)."""
        return list(self._ready)

    def restore(self, groups: list[ReadyGroup]) -> None:
        """Groups saved with a checkpoint; the restored gate already counts them as accepted.
        A resumed run has trained: no first-batch hold (``hold_to_first_batch``)."""
        self._ready.extend(groups)
        self._first_taken = True

    async def hold_to_first_batch(self) -> None:
        """Until the learner takes its first batch, wait while one batch's groups (B) hold
        quota; after it (or in a resumed run), return at once. Why: at the start the gate
        admits (1 + η)·B groups at once, and an engine decoding them all together finishes
        the first batch — the one the idle learner waits for — only with the others (the
        figures: docs/design.md, "The schedule"). Generating ahead pays once the learner has work; before
        that it only delays it. Filtered and stale-dropped groups give their quota back, so
        the batch still fills; the rule only lowers the gate's limit, so its bounds hold.

        Groups started past the run's last step are not held back: the final checkpoint
        keeps them in flight, and a resume with a larger ``total_steps`` continues them."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._first_taken or self.gate.started < self.gate.groups_per_step)

    async def take(self, n: int, trained_version: int) -> list[ReadyGroup]:
        """Wait for ``n`` groups fresh enough to train version ``trained_version`` on (with
        ``stale_groups: wait``, and for a batch that leaves every group a fresh step)."""
        async with self._changed:
            waited = False
            while True:
                stale = [g for g in self._ready if trained_version - g.oldest_version > self.max_lag]
                for group in stale:
                    self._ready.remove(group)
                    self.stale_dropped += 1
                    self.counts["stale_dropped_trajectories"] += len(group.trajectories)
                    self.counts["stale_dropped_tokens"] += group.model_tokens
                    await self.gate.release_rejected(was_accepted=True)
                if stale:
                    self._changed.notify_all()  # their quota is free: hold_to_first_batch's waiter
                if len(self._ready) >= n:
                    if self.stale_groups == "drop":
                        self._ready.sort(key=lambda g: g.start_order)
                    else:  # earliest deadline first; at η = 0 every deadline is the same: start order
                        self._ready.sort(key=lambda g: (g.oldest_version, g.start_order))
                    if self.stale_groups == "drop" or self._leaves_each_a_fresh_step(n, trained_version):
                        version, before = self._taken
                        self._taken = (trained_version, (before if version == trained_version else 0) + n)
                        taken, self._ready = self._ready[:n], self._ready[n:]
                        self._first_taken = True
                        self._changed.notify_all()  # hold_to_first_batch's waiter
                        return taken
                    if not waited:
                        waited = True
                        self.counts["deadline_waits"] += 1
                await self._changed.wait()

    def _leaves_each_a_fresh_step(self, n: int, trained_version: int) -> bool:
        """Whether taking the first ``n`` ready groups (earliest deadline first) leaves every
        other group — ready, or generating with a deadline not yet past — a step at which it
        is still fresh: for each deadline D, those due by D fit in the slots left to the
        steps up to D (this step's after this take, B a step after it). A deadline that no
        choice can meet (more groups due than slots, however chosen) is no reason to wait."""
        eta, per_step, t = self.max_lag, self.gate.groups_per_step, trained_version
        version, before = self._taken
        left_now = max(0, per_step - (before if version == t else 0) - n)  # this step's slots after this take
        taken = [g.oldest_version + eta for g in self._ready[:n]]
        due = [g.oldest_version + eta for g in self._ready[n:]]
        due += [v + eta for v in self._running.values() if v + eta >= t]
        for deadline in sorted(set(due)):
            slots = left_now + (deadline - t) * per_step
            pending = sum(d <= deadline for d in due)
            if pending > slots and pending + sum(d <= deadline for d in taken) - n <= slots:
                return False  # a batch with more of the groups due by then would save them
        return True


BUFFER_COUNTS = ("stale_dropped_trajectories", "stale_dropped_tokens", "deadline_waits")
"""What the buffer counts besides ``stale_dropped``: the trajectories and model tokens of the
groups dropped as stale (their mean length against the trained ones' is the bias a drop
makes), and the takes that waited for a group that would otherwise have gone stale."""


def trainable(groups: list[ReadyGroup], trained_version: int,
              max_staleness: int) -> tuple[list[Trajectory], list[float]]:
    """The trajectories of ``groups`` with their episodes' advantages, each checked to be
    at most ``max_staleness`` versions old at ``trained_version`` (the learner's side of
    the bound: anything older is a bug upstream, and stops the run). A trajectory with no
    model token (only prompt or tool tokens) has nothing to train and no version: it is
    left out, and counted in the step's ``rollout/untrainable_episodes``. Every episode
    has its advantage, or this raises naming the group: a group short of advantages
    would otherwise train partly, silently."""
    trajectories, advantages = [], []
    for g in groups:
        scored = g.group.advantages or []
        if len(scored) != len(g.group.episodes):
            raise ValueError(f"the group of task {g.group.task_id} holds {len(g.group.episodes)} episodes and "
                             f"{len(scored)} advantages: the rollout loop scores every episode of a group before "
                             "it is buffered, so this group was put in unscored or cut after scoring (a bug upstream)")
        for episode, advantage in zip(g.group.episodes, scored, strict=True):
            for t in episode.trajectories:
                if not t.num_model_tokens:
                    continue
                check_staleness(trained_version, t.behavior_version_min, max_staleness,
                                f"a trajectory of task {g.group.task_id}")
                trajectories.append(t)
                advantages.append(advantage)
    return trajectories, advantages
