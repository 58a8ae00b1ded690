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
report counts the threads abandoned in user code (``asyncrl/threads.py``) and says how
many of the failures ran past ``workflow.timeout_s`` (the most recent one's error says
what it waited for and what the engine's queue held: ``asyncrl/rollout/deadline.py``).
And it shows what the model said: the last groups that were filtered or failed are
written to ``filtered_samples.jsonl`` and a few of their answers and rewards quoted, since
``samples.jsonl`` holds only trained groups and is empty when none ever was.

A third way is slower and quieter: groups are still accepted, but so few among the
filtered ones that each trained group costs tens of generated ones (a policy collapsed
onto one answer, every sample scoring the same). :class:`StarvationGuard` says so on
the progress bar and in a warning, and past a second limit stops the run the same way.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from asyncrl.config import WatchdogConfig
from asyncrl.threads import abandoned_total, in_user_code
from asyncrl.types import Episode


UNSCORED_KEPT = 16
"""The last groups filtered or failed that a stop writes to ``filtered_samples.jsonl``."""
UNSCORED_FILE = "filtered_samples.jsonl"
QUOTED_GROUPS, QUOTED_SAMPLES, QUOTED_CHARS = 3, 4, 100
"""What a stop's message quotes of them: groups, answers of each, characters of each."""


class WatchdogStop(RuntimeError):
    """The run cannot make progress; the message says why, with the evidence."""


class StarvationGuard:
    """Whether zero-variance filtering starves the learner: the filtered fraction of the
    last ``window`` finished groups, against a warning and a stopping limit.

    Filtering as such is healthy (the Countdown example drops most of its groups all run:
    docs/results.md); starvation is a policy whose samples all score the same, collapsed onto one
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

    def __init__(self, cfg: WatchdogConfig, clock: Callable[[], float] | None = None,
                 output_dir: Path | None = None) -> None:
        """``output_dir``: the run's, where a stop writes ``filtered_samples.jsonl``."""
        self.cfg, self.clock, self.output_dir = cfg, clock or loop_time, output_dir
        self.counts = {"episodes_error": 0, "groups_filtered": 0, "groups_all_error": 0, "groups_accepted": 0}
        self.recent: deque[str] = deque(maxlen=cfg.window)  # each episode: "ok", "failed" or "timed_out"
        self.unscored: deque[dict[str, Any]] = deque(maxlen=UNSCORED_KEPT)  # groups filtered or failed
        self.last_error: tuple[str, str] | None = None  # (where, traceback)
        self._last_accept: float | None = None  # none yet: the wait counts from its own start
        self._waiting_since: float | None = None
        self.starvation = StarvationGuard(cfg.starvation_window, cfg.starvation_warn_fraction,
                                          cfg.starvation_stop_fraction)

    # -- what happened ------------------------------------------------------
    def episode(self, episode: Episode, phase: str) -> None:
        failed = episode.status == "error"
        self.recent.append("ok" if not failed else "timed_out" if episode.errors and episode.errors[-1].timed_out
                           else "failed")
        self.counts["episodes_error"] += failed
        if phase == "train" and not failed:
            self.starvation.reward(episode.reward)
        if episode.errors:
            last = episode.errors[-1]
            self.last_error = (f"{phase} episode of task {episode.task_id}, attempt {last.attempt}",
                               last.traceback or last.exception)

    def group(self, outcome: str, episodes: Sequence[Episode] = ()) -> None:
        """``accepted``, ``filtered`` (all rewards equal) or ``all_error``; the group's
        ``episodes`` of one not accepted are kept (the last ``UNSCORED_KEPT``) for a stop."""
        self.counts[f"groups_{outcome}"] += 1
        if outcome != "accepted" and episodes:
            self.unscored.append({"task_id": episodes[0].task_id, "outcome": outcome,
                                  "samples": [_sample(e) for e in episodes]})
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
        failed = sum(outcome != "ok" for outcome in self.recent)
        if len(self.recent) == w.window and failed > w.max_error_rate * w.window:
            timed_out = self.recent.count("timed_out")
            return (f"{failed} of the last {w.window} episodes failed (watchdog.max_error_rate={w.max_error_rate})"
                    + (f"; {timed_out} of them ran past their deadline, workflow.timeout_s (time without progress: "
                       "waits for an engine call that moves, queued at a working engine or receiving tokens, are "
                       "not counted): the most recent error below says what it waited for and what the engine's "
                       "queue held" if timed_out else ""))
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
                    + f"\nwhat to do: read what the policy answers ({UNSCORED_FILE}, below); make the reward one "
                    "a trivial answer cannot earn, or lower optim.lr, and start again or resume from the last good "
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
        lines += self._quoted()
        if self.last_error is not None:
            where, trace = self.last_error
            lines += [f"most recent error ({where}):", trace.rstrip()]
        return "\n".join(lines)

    def _quoted(self) -> list[str]:
        """A few answers of the last groups not trained, with their rewards."""
        if not self.unscored:
            return []
        where = (f"all {len(self.unscored)} in {self.output_dir / UNSCORED_FILE}" if self.output_dir is not None
                 else f"the last {len(self.unscored)} kept")
        lines = [f"what the model answered in the last groups not trained ({where}):"]
        for group in list(self.unscored)[-QUOTED_GROUPS:]:
            lines.append(f"  task {group['task_id']} ({group['outcome']}):")
            for sample in group["samples"][:QUOTED_SAMPLES]:
                answer = sample["answer"]
                said = (repr(answer if len(answer) <= QUOTED_CHARS else answer[:QUOTED_CHARS] + "…")
                        if answer is not None else f"({sample['response_tokens']} tokens, no text kept)")
                got = (f"reward {sample['reward']:g}" if sample["status"] == "ok" else
                       f"failed: {sample['error']}")
                lines.append(f"    {got}, {sample['finish_reason']}: {said}")
        return lines

    def write_unscored(self) -> Path | None:
        """The kept groups not trained, one JSON object each, to ``filtered_samples.jsonl``
        in the run's directory (replaced: they are the ones that led to this stop)."""
        if self.output_dir is None or not self.unscored:
            return None
        path = self.output_dir / UNSCORED_FILE
        path.write_text("".join(json.dumps(group) + "\n" for group in self.unscored))
        return path

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
                self.write_unscored()
                raise WatchdogStop(self.report(reason))


def _sample(episode: Episode) -> dict[str, Any]:
    """What a stop shows of one episode: its answer (a single-turn reply, or a multi-turn
    episode's last assistant message) and reward, or why it failed."""
    answer = episode.metadata.get("response")
    if answer is None:
        replies = [m for m in episode.metadata.get("messages") or () if m.get("role") == "assistant"]
        answer = replies[-1].get("content") if replies else None
    last = episode.errors[-1] if episode.status == "error" and episode.errors else None
    return {"reward": episode.reward, "status": episode.status, "finish_reason": episode.finish_reason,
            "answer": None if answer is None else str(answer),
            "response_tokens": len(episode.trajectories[-1].response_ids) if episode.trajectories else 0,
            "error": last.exception.splitlines()[0] if last is not None and last.exception else None}
