"""When a run's policy versions are scored, and on what.

Two ways, chosen by ``cfg.background_eval`` (``one_step_off`` and ``async`` by default):
- **beside training**: a task in the run's task group, on an evaluation replica loaded
  with the weights of the version asked for, so training does not wait;
- **blocking**: now, on the rollout engines, which serve the last synced version (the
  train loop syncs before such an evaluation, so it scores its own step's version).

Invariants: every evaluation is of one named version (``eval/version`` in its row); a
stop cancels a blocking one (its row is then written without it) and every background one
(user code may hang in one); a failure in any surfaces through the run's task group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from asyncrl.algorithms.finite import check_rewards
from asyncrl.config import Config
from asyncrl.orchestrator.metrics import eval_metrics
from asyncrl.orchestrator.runlog import RunLog
from asyncrl.orchestrator.stopping import StopControl
from asyncrl.runtime import LearnerHandle, RolloutHandle, Weights
from asyncrl.tasks import Task
from asyncrl.types import Episode


class RunEvaluations:
    def __init__(self, cfg: Config, validation: list[Task], stop: StopControl, now: Callable[[], float],
                 seen: Callable[[Episode, int, int], None]) -> None:
        """``seen(episode, step, version)``: each evaluation episode as it finishes (its
        errors, its row in ``eval_samples.jsonl``)."""
        self.cfg, self.validation, self._stop, self._now, self._seen = cfg, validation, stop, now, seen
        self._background: set[asyncio.Task] = set()

    def start(self, tasks: asyncio.TaskGroup, learner: LearnerHandle, rollout: RolloutHandle, log: RunLog) -> None:
        """Bound to a run's task group and handles, once the runtime is up."""
        self._tasks, self._learner, self._rollout, self._log = tasks, learner, rollout, log

    def due(self, step: int) -> bool:
        """Whether ``step``'s version is scored: every ``eval_every`` steps, and the last."""
        return step == self.cfg.total_steps or bool(self.cfg.eval_every and step % self.cfg.eval_every == 0)

    def needs_sync(self, step: int) -> bool:
        """Whether the engines must serve ``step``'s version first: a blocking evaluation
        scores what they serve, and a step's evaluation is of that step's version."""
        return self.due(step) and not self.cfg.background_eval

    def cancel_background(self) -> None:
        for task in list(self._background):
            task.cancel()

    async def of(self, step: int, version: int, served_version: int,
                 weights: Weights | None = None) -> asyncio.Future[dict[str, Any]]:
        """The ``eval/*`` keys of ``step``'s ``version``, as a future. Beside training: on a
        replica loaded with ``weights`` (published now when the caller has none); blocking:
        on the engines, which hold ``served_version``."""
        if self.cfg.background_eval:
            if weights is None and step > 0:
                weights = await self._learner.publish()
            task = self._tasks.create_task(self._evaluate(step, version, weights))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return task
        task = self._tasks.create_task(self._evaluate(step, served_version, None))
        stop = asyncio.ensure_future(self._stop.wait())
        try:  # a blocking evaluation, unless a stop cuts it short (its row is then written without it)
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        return task

    async def _evaluate(self, step: int, version: int, weights: Weights | None) -> dict[str, Any]:
        tasks, t_eval = self.validation[: self.cfg.eval.num_tasks], self._now()
        result = await self._rollout.evaluate(tasks, version=version, weights=weights,
                                              on_episode=lambda episode: self._seen(episode, step, version))
        for episode in result.episodes:
            if episode.status == "ok":
                check_rewards([episode.reward], max_abs=self.cfg.algorithm.max_abs_reward, task_id=episode.task_id,
                              step=step)
        self._log.event("eval", t_eval, self._now(), step=step, version=version)
        return eval_metrics(result, version, self._now() - t_eval)
