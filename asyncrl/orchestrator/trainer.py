"""One loop for ``sync``, ``one_step_off`` and ``async``: they differ only in η (the gate)
and in what a weight sync does to generation under way.

Concurrent activities under one ``asyncio.TaskGroup``, so a failure in any stops all:
- the rollout loop: the gate admits a task, n episodes run, the group is scored, filtered
  or put in the buffer;
- the train loop: take B groups, one optimizer step, sync weights, evaluate, log,
  call hooks, checkpoint;
- evaluations running beside training (``one_step_off``/``async``), each on the
  version it was asked for;
- the watchdog, which stops a run that cannot make progress.
Where the work runs is the runtime's business (``asyncrl.runtime.start``); this module
sees only a learner handle and a rollout handle.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl import chat_format
from asyncrl.algorithms.finite import check_rewards
from asyncrl.config import Config, save_config
from asyncrl.learner import pack_batch
from asyncrl.orchestrator.buffer import ReadyGroup, trainable
from asyncrl.orchestrator.checkpoint import RUN_STATE_FILE, RunState, rollback_logs, rotate, starting_point
from asyncrl.orchestrator.hooks import HookEvent, HookName
from asyncrl.orchestrator.metrics import StepTimes, eval_metrics, sample_rows, step_row
from asyncrl.orchestrator.preflight import preflight
from asyncrl.orchestrator.rollout_loop import RolloutLoop
from asyncrl.orchestrator.runlog import RunLog
from asyncrl.orchestrator.stopping import StopControl
from asyncrl.orchestrator.watchdog import Watchdog
from asyncrl.runtime import Weights, start
from asyncrl.types import Episode


class Trainer:
    def __init__(self, cfg: Config) -> None:
        """Everything that can be wrong with the input fails here, before any work."""
        self.cfg, self.output_dir = cfg, Path(cfg.output_dir)
        checkpoint = starting_point(self.output_dir, cfg.resume)
        checked = preflight(cfg, "train")
        self.tokenizer, self._model, self.splits, self.hooks = (checked.tokenizer, checked.model, checked.splits,
                                                                checked.hooks)
        self.max_staleness = cfg.effective_max_staleness
        self.watchdog = Watchdog(cfg.watchdog)
        self._stop = StopControl()
        self.last_checkpoint: Path | None = checkpoint
        self._saved_step: int | None = None
        self.save_seconds: dict[int, float] = {}  # each checkpoint save's wall time, by step (off a benchmark's clock)
        state = RunState.from_json((checkpoint / RUN_STATE_FILE).read_text()) if checkpoint else None
        self.resumed_from = state
        self.step = self.version = state.step if state else 0  # one optimizer step makes one version
        self._served_version = self.version  # what the rollout engines hold
        self.rollouts = RolloutLoop(cfg, self.splits.train, self.version, self.watchdog, state)
        self._restarts_before = state.counters.pop("worker_restarts", 0) if state else 0
        self.watchdog.counts.update(state.counters if state else {})
        self._epochs_reported = self.rollouts.stream.epochs_handed_out
        self._evaluations: set[asyncio.Task] = set()  # background ones running

    # ------------------------------------------------------------- control
    def run(self) -> Path:
        """The whole run in a fresh event loop; returns the final checkpoint. Any thread."""
        return asyncio.run(self.run_async())

    @property
    def interrupted(self) -> bool:
        """The run ended early because it was asked to stop (a signal, :meth:`stop`, a hook)."""
        return self._stop.is_set() and self.step < self.cfg.total_steps

    def banner(self) -> str:
        """What a run is about to do, said before it starts."""
        c, state = self.cfg, self.resumed_from
        partial = c.effective_partial_rollout
        evals = f"every {c.eval_every} steps" if c.eval_every else "before the first and after the last step"
        return "\n".join([
            f"asyncrl train → {self.output_dir}" + (f" (resuming from step {state.step})" if state else ""),
            f"  mode {c.mode}, η = {self.max_staleness}, partial rollouts: {partial}; runtime {c.runtime}, "
            f"engine {c.engine}, weight sync {c.weight_sync.method}",
            f"  model {c.model.path}; task {c.task.name} ({len(self.splits.train)} train, "
            f"{min(c.eval.num_tasks, len(self.splits.validation))} validation tasks scored)",
            f"  {c.total_steps} steps × {c.batch_size} groups × {c.group_size} samples; evaluation {evals}"
            + (" (beside training)" if c.background_eval else ""),
            *([f"  {template}"] if (template := self._template_note()) else []),
            "  Ctrl-C finishes the step, saves a checkpoint and stops (resume with resume=true)"])

    def _template_note(self) -> str | None:
        """What asyncrl renders in place of the chat template (tools on a model whose template
        has none), so a user sees it before the first step rather than in the samples."""
        if self.tokenizer.chat_template is None or not self.cfg.workflow.use_chat_template:
            return None
        return chat_format.describe(chat_format.probe(self.tokenizer))

    def stop(self) -> None:
        """Finish the current step, checkpoint and return, as a first Ctrl-C does. Safe from
        any thread, and from a hook."""
        self._stop.request()

    # ---------------------------------------------------------------- main
    async def run_async(self) -> Path:
        """The whole run on the caller's event loop; returns the final checkpoint."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.output_dir / "config.yaml")
        state, first_step = self.resumed_from, self.step
        print(self.banner(), file=sys.stderr, flush=True)
        with self._stop.installed():
            async with start(self.cfg, model=self._model, tokenizer=self.tokenizer, version=self.version,
                             checkpoint=self.last_checkpoint if state else None) as runtime:
                self._model = None  # the runtime holds the weights now
                self.learner, self.rollout, self.weight_sync = runtime.learner, runtime.rollout, runtime.weight_sync
                if state is not None:
                    removed = rollback_logs(self.output_dir, state)
                    print(f"asyncrl: resuming from {self.last_checkpoint} (step {state.step}); rolled back rows "
                          f"written after it: {removed}", file=sys.stderr)
                self.log = RunLog(self.cfg, self.output_dir, resume_step=state and state.step)
                self.start_time = time.perf_counter() - (state.elapsed_s if state else 0.0)
                try:
                    last = await self._loops(evaluate_first=state is None)
                    if (last > first_step or state is None) and self._saved_step != last:
                        await self._save(last)
                    self.wall_s = self._now()
                finally:
                    self.log.close()
        return self.last_checkpoint

    async def _loops(self, evaluate_first: bool) -> int:
        try:
            async with asyncio.TaskGroup() as self._tasks:
                side = [self._tasks.create_task(self.watchdog.watch(self._show_starved))]
                if evaluate_first:
                    self.log.step({"step": 0, "version": self.version}, await self._evaluation(0))
                side.append(self._tasks.create_task(self.rollouts.run(
                    self.rollout, self._now, lambda episode: self._seen(episode, "train"),
                    lambda start, end, order: self.log.event("generate", start, end, group=order))))
                last = await self._train_loop()
                if self._stop.is_set():  # a stop waits for no evaluation (user code may hang in one), and
                    side[0].cancel()  # the watchdog does not turn it into a failure while it saves
                    for task in list(self._evaluations):
                        task.cancel()
                await self.log.flushed()
                for task in side:
                    task.cancel()
            return last
        except BaseExceptionGroup as group:  # the first failure, with its own traceback, not a group
            first = next((e for e in _leaves(group) if not isinstance(e, asyncio.CancelledError)), None)
            if first is None:
                raise
            raise first from first.__cause__

    async def _train_loop(self) -> int:
        while self.step < self.cfg.total_steps and not self._stop.is_set():
            t0, busy0 = time.perf_counter(), await self.rollout.busy_s()
            groups = await self._take_unless_stopped()
            if groups is None:  # asked to stop while waiting for data: nothing half-done to finish
                break
            waited = time.perf_counter() - t0
            trained_version, step = self.version, self.step + 1
            trajectories, advantages = trainable(groups, trained_version, self.max_staleness)
            t_train = self._now()
            on_policy = all(t.behavior_version_max == trained_version for t in trajectories)
            actor = await self.learner.train_step(pack_batch(trajectories, advantages, self.tokenizer.pad_token_id or 0),
                                                  on_policy)
            self.step, self.version = step, self.version + 1
            self.log.event("train", t_train, self._now(), step=step)
            weights = await self._sync_weights(actor) if step % self.cfg.sync_every == 0 else None
            busy = await self.rollout.busy_s() - busy0
            times = StepTimes(time.perf_counter() - t0, waited, busy, self._now())
            buffer = self.rollouts.buffer
            # the window's fraction and the group counts are read together, before any await
            filtered_window, counters = self.watchdog.starvation.fraction, self._counters()
            counters.update(await self.rollout.gateway_counts())
            row = step_row(step, self.version, trained_version, groups, trajectories, actor, times,
                           self.rollouts.take_finished_rewards(), counters,
                           {"groups_ready": len(buffer), "stale_dropped_total": buffer.stale_dropped},
                           filtered_fraction_window=filtered_window)
            row["rollout/errors_unlogged_total"] = self.log.errors_unlogged  # failed attempts past errors.jsonl's cap
            self.log.samples(sample_rows(step, trained_version, groups, self._decode))
            due = step == self.cfg.total_steps or (self.cfg.eval_every and step % self.cfg.eval_every == 0)
            self.log.step(row, await self._evaluation(step, weights) if due else None)
            await self._hook("on_step_end", row)
            while self._epochs_reported < self.rollouts.stream.epochs_handed_out:
                await self._hook("on_epoch_end", row, epoch=self._epochs_reported)
                self._epochs_reported += 1
            if self.cfg.save_every and step % self.cfg.save_every == 0 and step < self.cfg.total_steps:
                await self._save(step)
        return self.step

    async def _take_unless_stopped(self) -> list[ReadyGroup] | None:
        take = asyncio.ensure_future(self.rollouts.buffer.take(self.cfg.batch_size, self.version))
        stop = asyncio.ensure_future(self._stop.wait())
        self.watchdog.waiting(True)
        try:
            await asyncio.wait({take, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.watchdog.waiting(False)
            stop.cancel()
        if take.done():
            return take.result()
        take.cancel()
        return None

    async def _sync_weights(self, actor: dict[str, float]) -> Weights | None:
        """Send the learner's weights to the engines (``weight_sync.method``; every engine's
        version is checked) and open the gate for the new version. Returns the published
        snapshot, if the method made one, for an evaluation of this version."""
        t_sync = self._now()
        weights = await self.weight_sync.sync(self.version, self.cfg.effective_partial_rollout)
        await self.rollouts.gate.set_version(self.version)
        self._served_version = self.version
        self.log.event("sync", t_sync, self._now(), version=self.version, method=self.weight_sync.method)
        await self._hook("on_policy_updated", actor)
        return weights

    async def _hook(self, name: HookName, metrics: dict[str, Any], epoch: int | None = None) -> None:
        await self.hooks.call(HookEvent(name, self.step, self.version, metrics, self, epoch))

    def _show_starved(self, status: str | None) -> None:
        self.log.bar.set_description(f"train[{self.cfg.mode}]" + (f" STARVED ({status})" if status else ""))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _now(self) -> float:
        return time.perf_counter() - self.start_time

    # ------------------------------------------------- checkpoints (a hook may ask)
    async def save(self) -> Path:
        if self._saved_step != self.step:
            await self._save(self.step)
        return self.last_checkpoint

    async def _save(self, step: int) -> None:
        start = time.perf_counter()
        await self.log.flushed()  # the rows up to ``step``, evaluations included, are on disk first
        state = RunState(step=step, elapsed_s=self._now(), counters=self._counters(), **self.rollouts.snapshot())
        ckpt_dir = self.output_dir / "checkpoints"
        self.last_checkpoint = await self.learner.save_checkpoint(ckpt_dir / f"step_{step}", {"step": step},
                                                                  {RUN_STATE_FILE: state.to_json()})
        self._saved_step = step
        rotate(ckpt_dir, self.cfg.keep_last, newest=self.last_checkpoint)
        self.save_seconds[step] = time.perf_counter() - start

    def _counters(self) -> dict[str, int]:
        """Since the run began (across resumes)."""
        return {**self.watchdog.counts, "worker_restarts": self._restarts_before + self.rollout.restarts}

    def _seen(self, episode: Episode, phase: str) -> None:
        self.watchdog.episode(episode, phase)
        self.log.errors(self.step, phase, episode)

    # ------------------------------------------------------------ evaluation
    async def evaluate(self) -> dict[str, Any]:
        """The current version scored now (for a hook); on the timeline, not in metrics.jsonl.
        ``{}`` when a stop cut it short."""
        evaluation = await self._evaluation(self.step)
        await asyncio.wait({evaluation})
        return {} if evaluation.cancelled() else evaluation.result()

    async def _evaluation(self, step: int, weights: Weights | None = None) -> asyncio.Future[dict[str, Any]]:
        """The ``eval/*`` keys of ``step``'s version, as a future. In the background (a task
        beside training) on an evaluation replica loaded with that version's weights;
        otherwise now, on the rollout engines, which serve the last synced version."""
        if self.cfg.background_eval:
            if weights is None and step > 0:
                weights = await self.learner.publish()
            task = self._tasks.create_task(self._evaluate(step, self.version, weights))
            self._evaluations.add(task)
            task.add_done_callback(self._evaluations.discard)
            return task
        task = self._tasks.create_task(self._evaluate(step, self._served_version, None))
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
        tasks, t_eval = self.splits.validation[: self.cfg.eval.num_tasks], self._now()
        result = await self.rollout.evaluate(tasks, version=version, weights=weights,
                                             on_episode=lambda e: self._seen(e, "eval"))
        for episode in result.episodes:
            if episode.status == "ok":
                check_rewards([episode.reward], max_abs=self.cfg.algorithm.max_abs_reward, task_id=episode.task_id,
                              step=step)
        self.log.event("eval", t_eval, self._now(), step=step, version=version)
        return eval_metrics(result, version, self._now() - t_eval)


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        yield from _leaves(exc) if isinstance(exc, BaseExceptionGroup) else (exc,)
