"""What a run counts since it began, across resumes.

A process counts from 0; the checkpoint holds what the run had counted before it. Each
count lives where it arises, and this class adds the checkpoint's part back:

- the watchdog's (episodes and groups; judge calls when the judge is asked by URL): the
  checkpoint's are put back into the watchdog at start, so its limits see the whole run;
- the rollout workers' (worker restarts, the gateway's counts): each process's own, the
  checkpoint's added when a row or a checkpoint reads them (:meth:`continued`);
- the run log's failed attempts past ``errors.jsonl``'s cap: the log starts from the
  checkpoint's (:attr:`errors_unlogged_before`).

Invariant: every ``rollout/*_total`` a row logs continues across a resume; none restarts at 0.
"""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.frozen.judge import uses_judge
from asyncrl.orchestrator.checkpoint import RunState
from asyncrl.orchestrator.metrics import judge_calls
from asyncrl.orchestrator.watchdog import Watchdog
from asyncrl.types import Episode


class RunCounters:
    def __init__(self, cfg: Config, state: RunState | None, watchdog: Watchdog) -> None:
        counted = dict(state.counters) if state else {}
        self._restarts_before = counted.pop("worker_restarts", 0)
        self._before = counted  # the rollout workers' and the log's counts continue from these
        self.errors_unlogged_before = counted.get("errors_unlogged", 0)
        self.watchdog = watchdog
        watchdog.counts.update(counted)
        # rollout/judge_calls_total, rollout/judge_failures_total: what asyncrl doctor checks the judge by
        self._judged_by_url = bool(cfg.judge.url) and uses_judge(cfg.task.reward_fn)

    def episode(self, episode: Episode, phase: str) -> None:
        """A finished episode (``phase``: train or eval), into the watchdog's counts (and its
        judgement of progress); its judge calls and failures, when the judge is asked by URL."""
        self.watchdog.episode(episode, phase)
        if self._judged_by_url:
            for key, n in zip(("judge_calls", "judge_failures"), judge_calls(episode), strict=True):
                self.watchdog.counts[key] = self.watchdog.counts.get(key, 0) + n

    def now(self, restarts: int, errors_unlogged: int) -> dict[str, int]:
        """Since the run began: the watchdog's counts, the worker restarts (``restarts``:
        this process's) and the failed attempts past ``errors.jsonl``'s cap (the log's)."""
        return {**self.watchdog.counts, "worker_restarts": self._restarts_before + restarts,
                "errors_unlogged": errors_unlogged}

    def continued(self, counters: dict[str, int], gateway: dict[str, int]) -> dict[str, int]:
        """``counters`` (:meth:`now`) and the rollout workers' ``gateway`` counts, each of
        those added to what the checkpoint held."""
        return {**counters, **{k: self._before.get(k, 0) + v for k, v in gateway.items()}}
