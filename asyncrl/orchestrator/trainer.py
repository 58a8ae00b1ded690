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
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from asyncrl.config import Config, changed_settings, run_settings
from asyncrl.jsonl import last_row
from asyncrl.orchestrator.announce import banner, finished_note, resume_note, run_tool_format, save_run_config
from asyncrl.orchestrator.checkpoint import RunState, resume_point, rollback_logs
from asyncrl.orchestrator.evaluations import RunEvaluations
from asyncrl.orchestrator.hooks import HookEvent, HookName
from asyncrl.orchestrator.invariants import InvariantWatch, Limits
from asyncrl.orchestrator.metrics import eval_sample_row, sample_rows, text_decoder
from asyncrl.orchestrator.preflight import preflight
from asyncrl.orchestrator.rollout_loop import RolloutLoop
from asyncrl.orchestrator.run_checkpoints import RunCheckpoints
from asyncrl.orchestrator.run_counters import RunCounters
from asyncrl.orchestrator.runlog import RunLog
from asyncrl.orchestrator.step_meter import RolloutSide, StepMeter, Trained
from asyncrl.orchestrator.stopping import StopControl, first_failure_raised
from asyncrl.orchestrator.train_steps import TrainSteps, engine_computes_as_learner  # noqa: F401 (importable here)
from asyncrl.orchestrator.watchdog import Watchdog
from asyncrl.runtime import RuntimeStarter, Weights, one_torch_thread, start
from asyncrl.tasks.base import TaskSplits
from asyncrl.types import Episode
from asyncrl.weight_sync.delivery import DeliveryCheck, WeightsNotDelivered


class Trainer:
    def __init__(self, cfg: Config, runtime: RuntimeStarter = start, splits: TaskSplits | None = None) -> None:
        """Everything that can be wrong with the input fails here, before any work.
        ``runtime``: what starts the learner and rollout handles (``asyncrl.runtime.start``;
        ``asyncrl plan`` passes simulated ones, and no weights are loaded then). ``splits``:
        from ``check_inputs`` where it ran already (the CLI, before torch loads)."""
        self._start_runtime = runtime
        self.cfg, self.output_dir = cfg, Path(cfg.output_dir)
        checkpoint, state, in_flight = resume_point(self.output_dir, cfg.resume, cfg.learner_kind)
        # a resume: the settings that differ from those the run last trained with, and whether
        # anything is left to train (a finished run: run() says so and writes nothing)
        self.changed_settings = changed_settings(run_settings(self.output_dir) or {}, cfg) if state else {}
        self.finished = state is not None and state.step >= cfg.total_steps
        with one_torch_thread():  # the model loads here: no OpenMP team on the caller's thread
            checked = preflight(cfg, "train" if runtime is start else "plan", splits)
        self.tokenizer, self._model, self.splits, self.hooks = (checked.tokenizer, checked.model, checked.splits,
                                                                checked.hooks)
        # the teacher's sampled logprobs against its scores (pre-flight): in this process's first row
        self._teacher_check = checked.teacher_check.row() if checked.teacher_check else {}
        self.watchdog = Watchdog(cfg.watchdog, output_dir=self.output_dir)
        self._stop = StopControl()
        self.checkpoints = RunCheckpoints(cfg, self.output_dir, checkpoint)
        self.save_seconds = self.checkpoints.seconds  # each save's time, by step (a benchmark takes it off its clock)
        self.resumed_from: RunState | None = state
        self.step = state.step if state else 0  # optimizer steps taken; each made one version
        self.rollouts = RolloutLoop(cfg, self.splits.train, self.version, self.watchdog, state, in_flight)
        self.counters = RunCounters(cfg, state, self.watchdog)
        self._epochs_reported = self.rollouts.stream.epochs_handed_out
        self._tool_format = run_tool_format(cfg, self.tokenizer)  # samples' tool_calls, read as the gateway reads
        self._decode = text_decoder(self.tokenizer)  # a sample's text
        self.evaluations = RunEvaluations(cfg, self.splits.validation, self._stop, self._now, self._seen_eval)

    @property
    def last_checkpoint(self) -> Path | None:
        """The run's newest checkpoint: the one it resumed from until it saves one."""
        return self.checkpoints.last

    def run(self) -> Path | None:
        """The whole run in a fresh event loop; returns the final checkpoint (None: none kept). Any thread."""
        return asyncio.run(self.run_async())

    @property
    def interrupted(self) -> bool:
        """The run ended early because it was asked to stop (a signal, :meth:`stop`, a hook)."""
        return self._stop.is_set() and self.step < self.cfg.total_steps

    def stop(self) -> None:
        """Finish the current step, checkpoint and return, as a first Ctrl-C does. Safe from
        any thread, and from a hook."""
        self._stop.request()

    @property
    def version(self) -> int:
        """The learner's policy version: one optimizer step makes one version, so it is the
        step count, kept once (the gate's and the engines' versions follow it by sync)."""
        return self.step

    async def run_async(self) -> Path | None:
        """The whole run on the caller's event loop; returns the final checkpoint (None: none kept)."""
        if self.finished and self.resumed_from is not None:  # a resume with nothing to train: said, no file touched
            print(finished_note(self.cfg, self.resumed_from.step, self.changed_settings), file=sys.stderr, flush=True)
            return self.last_checkpoint
        self.output_dir.mkdir(parents=True, exist_ok=True)
        state, first_step = self.resumed_from, self.step
        print(banner(self.cfg, self.resumed_from, self.splits, self.tokenizer), file=sys.stderr, flush=True)
        save_run_config(self.cfg, self.resumed_from, self.changed_settings)
        with self._stop.installed():
            async with self._start_runtime(self.cfg, model=self._model, tokenizer=self.tokenizer, version=self.version,
                             checkpoint=self.last_checkpoint if state else None) as runtime:
                self._model = None  # the runtime holds the weights now
                self.learner, self.rollout, self.weight_sync = runtime.training()
                self.delivery = DeliveryCheck.for_config(self.learner, self.rollout, self.tokenizer, self.cfg)
                self.train_steps = TrainSteps.for_run(
                    self.cfg, self.rollouts.buffer, self.learner, self.rollout, self.tokenizer.pad_token_id or 0,
                    self._stop, self.watchdog, self._now, lambda start, end, step: self.log.event("train", start, end,
                                                                                                  step=step))
                if state is not None:  # resumed: from a checkpoint
                    print(resume_note(cast(Path, self.last_checkpoint), state.step,
                                      rollback_logs(self.output_dir, state), self.rollouts.replay_note()),
                          file=sys.stderr)
                self.log = RunLog(self.cfg, self.output_dir, resume_step=state.step if state else None)
                self.log.errors_unlogged = self.counters.errors_unlogged_before
                # each invariant's first break said once, live, above the bar (asyncrl doctor checks the whole run)
                limits = Limits.from_config(self.cfg.model_dump(), self.rollouts.gate.max_staleness)
                self.invariants = InvariantWatch(limits, lambda line: tqdm.write(line, file=sys.stderr),
                                                 prev=last_row(self.output_dir / "metrics.jsonl") if state else None)
                self.start_time = _clock() - (state.elapsed_s if state else 0.0)
                self.checkpoints.restart_clock()
                try:
                    await self._loops(evaluate_first=state is None, first_step=first_step)
                    self.wall_s = self._now()
                finally:
                    self.log.close()
                    await self.rollouts.close()
        return self.last_checkpoint

    async def _loops(self, evaluate_first: bool, first_step: int) -> int:
        """Training, with the rollout loop beside it, until the last step or a stop; then the
        final checkpoint, taken while the rollouts still run so that the episodes under way
        are in it (``in_flight.jsonl``), and only then the rollouts are cancelled."""
        with first_failure_raised():
            async with asyncio.TaskGroup() as tasks:
                self.evaluations.start(tasks, self.learner, self.rollout, self.log)
                # once a stop is asked, a learner call under way gets the stop's grace to return
                # (watchdog.learner_stop_grace_s), not its whole deadline: a hung step must not hold a first Ctrl-C
                side = [tasks.create_task(self.watchdog.watch(self.log.starved)),
                        tasks.create_task(self._stop.then(self.learner.stop_soon))]
                if evaluate_first:
                    self.log.step({"step": 0, "version": self.version}, await self._evaluation(0))
                side.append(tasks.create_task(self.rollouts.run(
                    self.rollout, self._now, lambda episode: self._seen(episode, "train"),
                    lambda start, end, order: self.log.event("generate", start, end, group=order))))
                side.append(tasks.create_task(self.log.failed()))  # a row written in a callback that failed
                last = await self._train_loop()
                if self._stop.is_set():  # a stop waits for no evaluation (user code may hang in one), and
                    side[0].cancel()  # the watchdog does not turn it into a failure while it saves
                    self.evaluations.cancel_background()
                await self.log.flushed()
                if last > first_step or evaluate_first:
                    await self._save_kept(last)
                for task in side:
                    task.cancel()
            return last

    async def _train_loop(self) -> int:
        """Each step: take B groups and train on them, sync the weights, log the step (with
        its evaluation), call the hooks, checkpoint when due."""
        while self.step < self.cfg.total_steps and not self._stop.is_set():
            meter, trained_version, step = await StepMeter.started(self.rollout), self.version, self.step + 1
            trained = await self.train_steps.train(trained_version, step)
            if trained is None:  # asked to stop while waiting for data: nothing half-done to finish
                break
            self.step = step
            due, synced = self.evaluations.due(step), self._sync_due(step)
            # the rollout side is read before the sync opens the gate to the next version: after
            # it, how many of that version's episodes have finished is a matter of timing, and
            # a sync run and an async η = 0 run would log different rows for the same samples
            rollout_side = await self._rollout_side()
            weights = await meter.timed_sync(self._sync_weights(trained.actor)) if synced else None
            # apart from time/weight_sync: the delivery check's own seconds are time/delivery_check
            try:
                delivered = await self.delivery.after_sync(self.version) if synced else {}
            except WeightsNotDelivered as undelivered:  # the step's row first: the run's files name the step
                failed = {"weight_sync/probe_max_abs_diff": undelivered.probe_max_abs_diff}
                self._log_step(step, trained_version, trained,
                               {**await self._row(meter, step, trained_version, trained, rollout_side), **failed})
                raise
            row = {**await self._row(meter, step, trained_version, trained, rollout_side), **delivered}
            self._log_step(step, trained_version, trained, row, await self._evaluation(step, weights) if due else None)
            await self._after_step(step, row)
        return self.step

    def _log_step(self, step: int, trained_version: int, trained: Trained, row: dict[str, Any],
                  evaluation: asyncio.Future[dict[str, Any]] | None = None) -> None:
        self.log.samples(sample_rows(step, trained_version, trained.groups, self._decode, self._tool_format))
        self.log.step(row, evaluation)

    async def _rollout_side(self) -> RolloutSide:
        """The rollout side's part of a step's row: episodes finished since the last step,
        group counters, the buffer, read together before any await; then the gateway's counts."""
        side = self.rollouts.side(self.counters.now(self.rollout.restarts, self.log.errors_unlogged))
        return replace(side, counters=self.counters.continued(side.counters, await self.rollout.gateway_counts()))

    async def _row(self, meter: StepMeter, step: int, trained_version: int, trained: Trained,
                   side: RolloutSide) -> dict[str, Any]:
        row = await meter.row(step, self.version, trained_version, trained, self._now(), side.finished_rewards,
                              side.counters, side.buffer, side.filtered_window, self.log.errors_unlogged)
        row.update(self._teacher_check)
        self._teacher_check = {}
        return row

    async def _after_step(self, step: int, row: dict[str, Any]) -> None:
        self.invariants.observe(row)
        await self._hook("on_step_end", row)
        while self._epochs_reported < self.rollouts.stream.epochs_handed_out:
            await self._hook("on_epoch_end", row, epoch=self._epochs_reported)
            self._epochs_reported += 1
        if due := self.checkpoints.due(step):
            await self._save(step, interim=due == "interim")

    def _sync_due(self, step: int) -> bool:
        """Every ``sync_every`` steps; and, whatever ``sync_every``, after the last step (the
        engines end serving the final policy) and before an evaluation of what the engines
        serve. An extra sync only makes samples fresher: the gate's bound holds."""
        return step % self.cfg.sync_every == 0 or step == self.cfg.total_steps or self.evaluations.needs_sync(step)

    async def _sync_weights(self, actor: dict[str, float]) -> Weights | None:
        """Send the learner's weights to the engines (``weight_sync.method``; every engine's
        version is checked) and open the gate for the new version. Returns the published
        snapshot, if the method made one, for an evaluation of this version."""
        t_sync = self._now()
        weights = await self.weight_sync.sync(self.version, self.cfg.effective_partial_rollout)
        await self.rollouts.gate.set_version(self.version)  # the version the engines serve: the gate's
        self.log.event("sync", t_sync, self._now(), version=self.version, method=self.weight_sync.method)
        await self._hook("on_policy_updated", actor)
        return weights

    async def _hook(self, name: HookName, metrics: dict[str, Any], epoch: int | None = None) -> None:
        await self.hooks.call(HookEvent(name, self.step, self.version, metrics, self, epoch))

    def _now(self) -> float:
        return _clock() - self.start_time

    async def save(self) -> Path:
        """A kept checkpoint of the current step, now (for a hook); its path."""
        await self._save_kept(self.step)
        return cast(Path, self.last_checkpoint)  # just saved

    async def _save_kept(self, step: int) -> None:
        if not self.checkpoints.mark_kept(step):  # not saved yet (as interim: it is kept now)
            await self._save(step)

    async def _save(self, step: int, interim: bool = False) -> None:
        await self.checkpoints.save(step, self.learner, self._checkpoint_contents, interim)

    async def _checkpoint_contents(self, step: int, interim: bool) -> tuple[RunState, list[dict[str, Any]]]:
        """What a checkpoint holds beyond the learner's state: the run state, and the journals of
        the episodes under way that a restart continues; once the rows up to ``step`` are on disk."""
        await self.log.flushed()  # evaluations' included
        journals, gateway = await self.rollout.in_flight(), await self.rollout.gateway_counts()
        counts = self.counters.continued(self.counters.now(self.rollout.restarts, self.log.errors_unlogged), gateway)
        state = RunState(step=step, elapsed_s=self._now(), counters=counts, interim=interim, **self.rollouts.snapshot())
        return state, self.rollouts.journals_to_keep(journals, state.reissue)

    def _seen(self, episode: Episode, phase: str) -> None:
        self.counters.episode(episode, phase)
        self.log.errors(self.step, phase, episode)

    def _seen_eval(self, episode: Episode, step: int, version: int) -> None:
        """An evaluation episode of ``step``'s ``version``, recorded as it finishes."""
        self._seen(episode, "eval")
        self.log.eval_samples([eval_sample_row(episode, version, self._decode, self._tool_format, step=step)])

    async def evaluate(self) -> dict[str, Any]:
        """The current version scored now (for a hook); on the timeline, not in metrics.jsonl.
        ``{}`` when a stop cut it short."""
        evaluation = await self._evaluation(self.step)
        await asyncio.wait({evaluation})
        return {} if evaluation.cancelled() else evaluation.result()

    async def _evaluation(self, step: int, weights: Weights | None = None) -> asyncio.Future[dict[str, Any]]:
        """The ``eval/*`` keys of ``step``'s version, as a future (``evaluations.py``: beside
        training, or now on the engines, which serve the last synced version)."""
        return await self.evaluations.of(step, self.version, self.rollouts.gate.version, weights)


def _clock() -> float:
    """The event loop's clock: every time a run measures is on it, so on a simulated clock
    (``asyncrl plan``: ``asyncrl/plan/virtual_clock.py``) the metrics are in simulated seconds."""
    return asyncio.get_running_loop().time()

