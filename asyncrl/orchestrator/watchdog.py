"""The watchdog: a run that cannot make progress stops loudly instead of sitting still.

Two ways a run goes nowhere, both seen by users of every system in this field:
- episodes keep failing (a reward function that always raises, a dead tool service):
  the error rate over the last ``watchdog.window`` episodes exceeds
  ``watchdog.max_error_rate``;
- no group is ever accepted (every group filtered because all samples scored the same,
  or generation hangs): the learner has waited ``watchdog.stall_s`` seconds for data
  with no group accepted meanwhile. Time spent training or in a blocking evaluation
  does not count: only waiting does.
Either way the run fails (exit 1) with the most recent episode traceback and the
counts, so the cause is on the screen and not only in ``errors.jsonl``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from asyncrl.config import WatchdogConfig
from asyncrl.types import Episode


class WatchdogStop(RuntimeError):
    """The run cannot make progress; the message says why, with the evidence."""


class Watchdog:
    """Counts what happens to episodes and groups (the ``rollout/*_total`` metrics come
    from here) and judges, from those counts, whether the run can still make progress."""

    def __init__(self, cfg: WatchdogConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.clock = cfg, clock
        self.counts = {"episodes_error": 0, "groups_filtered": 0, "groups_all_error": 0, "groups_accepted": 0}
        self.recent: deque[bool] = deque(maxlen=cfg.window)  # True = the episode failed
        self.last_error: tuple[str, str] | None = None  # (where, traceback)
        self._last_accept = clock()
        self._waiting_since: float | None = None

    # -- what happened ------------------------------------------------------
    def episode(self, episode: Episode, phase: str) -> None:
        failed = episode.status == "error"
        self.recent.append(failed)
        self.counts["episodes_error"] += failed
        if episode.errors:
            last = episode.errors[-1]
            self.last_error = (f"{phase} episode of task {episode.task_id}, attempt {last.attempt}",
                               last.traceback or last.exception)

    def group(self, outcome: str) -> None:
        """``accepted``, ``filtered`` (all rewards equal) or ``all_error``."""
        self.counts[f"groups_{outcome}"] += 1
        if outcome == "accepted":
            self._last_accept = self.clock()

    def waiting(self, waiting: bool) -> None:
        """The learner starts (True) or stops (False) waiting for groups."""
        self._waiting_since = self.clock() if waiting else None

    # -- the judgement ------------------------------------------------------
    def verdict(self) -> str | None:
        """Why the run must stop, or None."""
        w = self.cfg
        if len(self.recent) == w.window and sum(self.recent) > w.max_error_rate * w.window:
            return (f"{sum(self.recent)} of the last {w.window} episodes failed "
                    f"(watchdog.max_error_rate={w.max_error_rate})")
        if self._waiting_since is not None:
            stalled = self.clock() - max(self._waiting_since, self._last_accept)
            if stalled > w.stall_s:
                why = ("every group was filtered because all its samples scored the same"
                       if self.counts["groups_filtered"] and not self.counts["groups_all_error"] else
                       "no group was accepted")
                return f"the learner waited {stalled:.0f} s for data and {why} (watchdog.stall_s={w.stall_s:g})"
        return None

    def report(self, reason: str) -> str:
        c = self.counts
        lines = [f"stopped by the watchdog: {reason}",
                 f"counts: {c['episodes_error']} episodes failed, {c['groups_all_error']} groups with every "
                 f"episode failed, {c['groups_filtered']} groups filtered (all rewards equal), "
                 f"{c['groups_accepted']} groups accepted"]
        if self.last_error is not None:
            where, trace = self.last_error
            lines += [f"most recent error ({where}):", trace.rstrip()]
        return "\n".join(lines)

    async def watch(self, interval_s: float = 0.5) -> None:
        """Runs beside the loops; raising here fails the run's task group."""
        while True:
            await asyncio.sleep(interval_s)
            reason = self.verdict()
            if reason is not None:
                raise WatchdogStop(self.report(reason))
