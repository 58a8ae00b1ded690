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
counts, so the cause is on the screen and not only in ``errors.jsonl``. An agent or
reward function that hangs is the first kind: each timeout is an error episode, and the
report counts the threads abandoned in user code (``asyncrl/threads.py``).

A third way is slower and quieter: groups are still accepted, but so few among the
filtered ones that each trained group costs tens of generated ones (a policy collapsed
onto one answer, every sample scoring the same). :class:`StarvationGuard` says so on
the progress bar and in a warning, and past a second limit stops the run the same way.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter, deque
from collections.abc import Callable

from tqdm import tqdm

from asyncrl.config import WatchdogConfig
from asyncrl.threads import abandoned_total, in_user_code
from asyncrl.types import Episode


class WatchdogStop(RuntimeError):
    """The run cannot make progress; the message says why, with the evidence."""


class StarvationGuard:
    """Whether zero-variance filtering starves the learner: the filtered fraction of the
    last ``window`` finished groups, against a warning and a stopping limit.

    Filtering as such is healthy (the Countdown example drops ~69 % of its groups all
    run); starvation is a policy whose samples all score the same, collapsed onto one
    answer or saturated, so each trained group costs 1 / (1 - fraction) generated ones
    and a step takes minutes. Pure counting, no clock: fed group by group, tested on
    synthetic streams. An episode of starvation begins when the fraction passes the
    warning limit and ends only after a whole window of groups under it, so a fraction
    that wavers about the limit warns once.
    """

    def __init__(self, window: int, warn_fraction: float, stop_fraction: float) -> None:
        self.window, self.warn_fraction, self.stop_fraction = window, warn_fraction, stop_fraction
        self.recent: deque[bool] = deque(maxlen=window)  # True = the group was filtered
        self.filtered = 0  # of ``recent``
        self.rewards: deque[float] = deque(maxlen=window)  # the latest training episodes'
        self.starved = False  # within an episode of starvation
        self.episodes = 0  # episodes of starvation begun: one warning each
        self._calm = 0  # groups in a row under the warning limit, within an episode

    def group(self, filtered: bool) -> None:
        if len(self.recent) == self.window:
            self.filtered -= self.recent[0]
        self.recent.append(filtered)
        self.filtered += filtered
        over = self._over(self.warn_fraction)
        if over and not self.starved:
            self.starved, self.episodes = True, self.episodes + 1
        if self.starved:
            self._calm = 0 if over else self._calm + 1
            self.starved = self._calm < self.window

    def reward(self, value: float) -> None:
        """A finished training episode's reward (what the cause is told from)."""
        self.rewards.append(value)

    @property
    def fraction(self) -> float:
        """Filtered over the last ``window`` groups, or over all so far before there are that many."""
        return self.filtered / len(self.recent) if self.recent else 0.0

    @property
    def must_stop(self) -> bool:
        return self._over(self.stop_fraction)

    def _over(self, limit: float) -> bool:
        return len(self.recent) == self.window and self.fraction > limit

    def status(self) -> str:
        """For the progress bar."""
        return f"{self.fraction:.0%} of groups filtered"

    def evidence(self, limit: str) -> str:
        """What starves the learner, with the counts; ``limit`` names the limit passed."""
        n, filtered = len(self.recent), self.filtered
        cost = f"{n / (n - filtered):.0f} generated per group trained" if filtered < n else "not one trained"
        lines = [f"the learner is starved: {filtered} of the last {n} groups were filtered, more than {limit} "
                 f"({cost})",
                 "likely cause: every sample of a group scores the same, a policy collapsed onto one answer "
                 "(one that earns a partial reward, say) or saturated (always right, or always wrong)"]
        if self.rewards:
            (value, count), = Counter(self.rewards).most_common(1)
            low, high = min(self.rewards), max(self.rewards)
            lines.append(f"all of the last {count} training episodes scored {value:g}" if low == high else
                         f"of the last {len(self.rewards)} training episodes {count} scored {value:g} "
                         f"(rewards from {low:g} to {high:g})")
        return "\n".join(lines)


def loop_time() -> float:
    """The running event loop's clock (a simulated one under ``asyncrl plan``), else the
    monotonic clock a standard loop uses."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class Watchdog:
    """Counts what happens to episodes and groups (the ``rollout/*_total`` metrics come
    from here) and judges, from those counts, whether the run can still make progress."""

    def __init__(self, cfg: WatchdogConfig, clock: Callable[[], float] | None = None) -> None:
        self.cfg, self.clock = cfg, clock or loop_time
        self.counts = {"episodes_error": 0, "groups_filtered": 0, "groups_all_error": 0, "groups_accepted": 0}
        self.recent: deque[bool] = deque(maxlen=cfg.window)  # True = the episode failed
        self.last_error: tuple[str, str] | None = None  # (where, traceback)
        self._last_accept: float | None = None  # none yet: the wait counts from its own start
        self._waiting_since: float | None = None
        self.starvation = StarvationGuard(cfg.starvation_window, cfg.starvation_warn_fraction,
                                          cfg.starvation_stop_fraction)

    # -- what happened ------------------------------------------------------
    def episode(self, episode: Episode, phase: str) -> None:
        failed = episode.status == "error"
        self.recent.append(failed)
        self.counts["episodes_error"] += failed
        if phase == "train" and not failed:
            self.starvation.reward(episode.reward)
        if episode.errors:
            last = episode.errors[-1]
            self.last_error = (f"{phase} episode of task {episode.task_id}, attempt {last.attempt}",
                               last.traceback or last.exception)

    def group(self, outcome: str) -> None:
        """``accepted``, ``filtered`` (all rewards equal) or ``all_error``."""
        self.counts[f"groups_{outcome}"] += 1
        if outcome == "accepted":
            self._last_accept = self.clock()
        if outcome != "all_error":  # failures are the error rule's to judge
            self.starvation.group(outcome == "filtered")

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
            since = self._waiting_since if self._last_accept is None else max(self._waiting_since, self._last_accept)
            stalled = self.clock() - since
            if stalled > w.stall_s:
                why = ("every group was filtered because all its samples scored the same"
                       if self.counts["groups_filtered"] and not self.counts["groups_all_error"] else
                       "no group was accepted")
                return f"the learner waited {stalled:.0f} s for data and {why} (watchdog.stall_s={w.stall_s:g})"
        if self.starvation.must_stop:
            return (self.starvation.evidence(f"watchdog.starvation_stop_fraction={w.starvation_stop_fraction:g}")
                    + "\nwhat to do: read what the policy answers (samples.jsonl); make the reward one a trivial "
                    "answer cannot earn, or lower optim.lr, and start again or resume from the last good "
                    "checkpoint (below); watchdog.starvation_stop_fraction=1 lets a run go on starved")
        return None

    def report(self, reason: str) -> str:
        c = self.counts
        lines = [f"stopped by the watchdog: {reason}",
                 f"counts: {c['episodes_error']} episodes failed, {c['groups_all_error']} groups with every "
                 f"episode failed, {c['groups_filtered']} groups filtered (all rewards equal), "
                 f"{c['groups_accepted']} groups accepted"]
        abandoned = abandoned_total()  # this process's pools (a Ray worker's are its own)
        if abandoned:
            lines.append(f"{abandoned} calls of blocking user code (agent, reward function) ran past their timeout "
                         f"and were abandoned on their threads; {len(in_user_code())} threads are in user code now")
        if self.last_error is not None:
            where, trace = self.last_error
            lines += [f"most recent error ({where}):", trace.rstrip()]
        return "\n".join(lines)

    async def watch(self, show_starved: Callable[[str | None], None] = lambda status: None,
                    interval_s: float = 0.5) -> None:
        """Runs beside the loops; raising here fails the run's task group. ``show_starved``
        gets the bar's note while the learner is starved, None once it is not."""
        warned, shown = self.starvation.episodes, None
        while True:
            await asyncio.sleep(interval_s)
            guard = self.starvation
            if guard.episodes > warned:
                warned = guard.episodes
                evidence = guard.evidence(f"watchdog.starvation_warn_fraction={guard.warn_fraction:g}")
                tqdm.write(f"asyncrl: warning: {evidence}\nthe run stops past "
                           f"watchdog.starvation_stop_fraction={guard.stop_fraction:g}", file=sys.stderr)
            status = guard.status() if guard.starved else None
            if status != shown:
                shown = status
                show_starved(status)
            reason = self.verdict()
            if reason is not None:
                raise WatchdogStop(self.report(reason))
