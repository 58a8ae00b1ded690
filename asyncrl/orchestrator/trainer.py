"""One loop for ``sync``, ``one_step_off`` and ``async``: they differ only in η (the gate)
and in what happens to in-flight generation at a weight sync.

Two concurrent activities under one ``asyncio.TaskGroup``:
- the rollout loop: the gate admits a task, n episodes run, the group is scored, filtered
  or put in the buffer;
- the train loop: take B groups, one optimizer step, sync weights, evaluate,
  checkpoint, log.
Where the work runs is the runtime's business (``asyncrl/runtime``): locally the engine
decodes on its own thread and the learner computes on another, so generation and
training overlap in wall-clock time (torch releases the GIL in its kernels); on Ray both
are actors. This loop only sees ``self.rollout`` and ``self.learner``.
"""

from __future__ import annotations

import asyncio
import copy
import random
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    compute_advantages,
    resolve,
)
from asyncrl.config import Config, ConfigError, save_config
from asyncrl.engine import require_engine
from asyncrl.learner import pack
from asyncrl.orchestrator.buffer import GroupBuffer, ReadyGroup
from asyncrl.orchestrator.checkpoint import (
    RUN_STATE_FILE,
    RunState,
    latest_checkpoint,
    rollback_logs,
    rotate,
)
from asyncrl.orchestrator.runlog import RunLog
from asyncrl.orchestrator.staleness import AsyncStalenessGate, StalenessGate
from asyncrl.policy import check_policy, load_policy
from asyncrl.runtime.learner_worker import LearnerWorker, LocalLearner
from asyncrl.runtime.ray_runtime import RayLearner, RayRollout, start_ray
from asyncrl.runtime.rollout_worker import RolloutWorker
from asyncrl.tasks.base import Task
from asyncrl.types import Group
from asyncrl.workflows.registry import build_tasks, build_workflow, check_tokenizer


class TaskStream:
    """Train tasks in a fresh seeded order each epoch. The cursor (epoch, index) and the
    tasks to re-issue (handed out before a resume, never finished) are what a resume needs."""

    def __init__(self, tasks: list[Task], seed: int, epoch: int = 0, index: int = 0,
                 reissue: list[int] | None = None) -> None:
        self.tasks, self.seed = tasks, seed
        self.epoch, self.index = epoch, index
        self.reissue = deque(reissue or [])
        self._order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_index(self) -> int:
        if self.reissue:
            return self.reissue.popleft()
        if self.index == len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._shuffled()
        self.index += 1
        return self._order[self.index - 1]

    def next(self) -> Task:
        return self.tasks[self.next_index()]


class Trainer:
    def __init__(self, cfg: Config) -> None:
        """Everything that can be wrong with the input fails here, before any work."""
        self.cfg = cfg
        if cfg.runtime == "local":  # on Ray the workers' environment is what counts
            require_engine(cfg.engine)
        if cfg.runtime == "ray":  # the learner and workers load the model in their own processes
            self._model, self.tokenizer = None, check_policy(cfg.model)
        else:
            self._model, self.tokenizer = load_policy(cfg.model)
        check_tokenizer(cfg, self.tokenizer)
        self.splits = build_tasks(cfg)
        if not self.splits.train:
            raise ValueError("the task's train split is empty")
        build_workflow(cfg)  # the workers build their own; this refuses a bad one before any work
        for key, registry, kind in (("advantage", ADVANTAGE_ESTIMATORS, "advantage estimator"),
                                    ("policy_loss", POLICY_LOSSES, "policy loss")):
            try:
                resolve(registry, getattr(cfg.algorithm, key), kind)
            except KeyError as exc:
                raise ConfigError(f"algorithm.{key}: {exc.args[0]}") from None
        self.output_dir = Path(cfg.output_dir)
        shared = cfg.mode != "sync"
        half = max(1, (torch.get_num_threads() or 2) // 2)
        self.engine_threads = cfg.rollout.num_threads or (half if shared else None)
        self.learner_threads = cfg.rollout.learner_threads or (half if shared else None)
        self.eta = cfg.staleness
        self.counters = {"groups_filtered": 0, "groups_all_error": 0, "episodes_error": 0}
        self._stop = asyncio.Event()
        self._finished_rewards: list[float] = []
        self._in_flight: dict[int, int] = {}  # start order -> task index, until the group is done
        self.last_checkpoint: Path | None = None
        self._saved_step: int | None = None
        self.resumed_from: RunState | None = None
        checkpoint = latest_checkpoint(self.output_dir / "checkpoints") if cfg.resume else None
        if checkpoint is not None:
            self.resumed_from = RunState.from_json((checkpoint / RUN_STATE_FILE).read_text())
            self.last_checkpoint = checkpoint
        elif cfg.resume:
            print(f"asyncrl: resume=true but no checkpoint under {self.output_dir / 'checkpoints'}; starting fresh",
                  file=sys.stderr)
        self.version = self.resumed_from.step if self.resumed_from else 0  # one optimizer step, one version
        self._restore(self.resumed_from)
        self._owns_ray = start_ray(cfg) if cfg.runtime == "ray" else False  # refuses a layout it cannot place

    def _on_signal(self, main: asyncio.Task) -> None:
        """First signal: finish the step, checkpoint, exit 0. A second one: stop waiting
        (for a worker that never starts, say) and fail with the last good checkpoint."""
        if self._stop.is_set():
            main.cancel("stopped by a second signal")
        self._stop.set()

    async def _start_runtime(self) -> None:
        """The learner (with the checkpoint's state) and the rollout side (with its weights)."""
        checkpoint = self.last_checkpoint if self.resumed_from else None
        if self.cfg.runtime == "ray":
            self.learner = RayLearner(self.cfg)
            weights = None
            if checkpoint is not None:
                await self.learner.call("load_checkpoint", checkpoint)
                weights = await self.learner.publish()
            self.rollout = RayRollout(self.cfg, weights=weights, version=self.version)
            return
        worker = LearnerWorker(self.cfg, model=self._model, tokenizer=self.tokenizer, num_threads=self.learner_threads)
        self.learner = LocalLearner(worker)
        if checkpoint is not None:
            await self.learner.call("load_checkpoint", checkpoint)
        self.rollout = RolloutWorker(self.cfg, model=copy.deepcopy(worker.learner.model), tokenizer=self.tokenizer,
                                     version=self.version, seed=self.cfg.seed + 7919 * self.version,
                                     num_threads=self.engine_threads)
        await self.rollout.start()

    def _restore(self, state: RunState | None) -> None:
        """The gate, buffer and data cursor of a fresh run, or of the checkpoint ``state``."""
        gate = StalenessGate(self.eta, self.cfg.batch_size, self.version)
        if state is None:
            self.stream = TaskStream(self.splits.train, self.cfg.seed)
            self.gate = AsyncStalenessGate(gate)
            self.buffer = GroupBuffer(self.gate, self.eta)
            self._started = self._restarts_before = 0
            return
        groups = state.ready_groups()
        # consumed groups and saved ones hold quota; the re-issued tasks start afresh
        snapshot = {**gate.snapshot(), "accepted": state.step * self.cfg.batch_size + len(groups), "running": 0}
        self.gate = AsyncStalenessGate(StalenessGate.from_snapshot(snapshot))
        self.buffer = GroupBuffer(self.gate, self.eta)
        self.buffer.restore(groups)
        self.buffer.stale_dropped = state.stale_dropped
        self.stream = TaskStream(self.splits.train, self.cfg.seed, state.epoch, state.index, state.reissue)
        self._started = state.started
        self._restarts_before = state.counters.pop("worker_restarts", 0)
        self.counters.update(state.counters)

    # ------------------------------------------------------------------ main
    def run(self) -> Path:
        return asyncio.run(self.run_async())

    async def run_async(self) -> Path:
        """The whole run on the caller's event loop; returns the final checkpoint."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.output_dir / "config.yaml")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # finish the step, checkpoint, exit 0
            loop.add_signal_handler(sig, self._on_signal, asyncio.current_task())
        state = self.resumed_from
        first_step = state.step if state else 0
        self.learner = self.rollout = self.log = None
        try:
            await self._start_runtime()
            if state is not None:
                removed = rollback_logs(self.output_dir, state)
                print(f"asyncrl: resuming from {self.last_checkpoint} (step {state.step}); rolled back rows "
                      f"written after it: {removed}", file=sys.stderr)
            self.log = RunLog(self.cfg, self.output_dir, self.cfg.total_steps, resume_step=state and state.step)
            self.start_time = time.perf_counter() - (state.elapsed_s if state else 0.0)
            if state is None:
                self.log.metrics({"step": 0, "version": 0, **await self._evaluate()})
            async with asyncio.TaskGroup() as tg:
                rollout = tg.create_task(self._rollout_loop())
                last = await self._train_loop(first_step)
                rollout.cancel()
            if (last > first_step or state is None) and self._saved_step != last:
                await self._save(last, self._run_state(last))
            return self.last_checkpoint
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            for part in (self.rollout, self.learner):
                if part is not None:
                    await part.shutdown()
            if self._owns_ray:
                import ray

                ray.shutdown()
            if self.log is not None:
                self.log.close()

    async def _train_loop(self, step: int) -> int:
        while step < self.cfg.total_steps and not self._stop.is_set():
            step += 1
            t0, busy0 = time.perf_counter(), await self.rollout.busy_s()
            trained_version = self.version
            ready = await self._take_unless_stopped(trained_version)
            if ready is None:  # asked to stop while waiting for data: nothing half-done to finish
                return step - 1
            waited = time.perf_counter() - t0
            trajectories, advantages = [], []
            for r in ready:
                for episode, adv in zip(r.group.episodes, r.group.advantages or []):
                    for t in episode.trajectories:
                        staleness = trained_version - t.behavior_version_min
                        if not 0 <= staleness <= self.eta:  # a bug, not a statistic (kept under -O too)
                            raise RuntimeError(f"trajectory of task {r.group.task_id} is {staleness} versions "
                                               f"old at version {trained_version}; the bound is {self.eta}")
                        trajectories.append(t)
                        advantages.append(adv)
            batch = pack(trajectories, advantages, self.tokenizer.pad_token_id or 0)
            sync = step % self.cfg.sync_every == 0
            t_train = self._now()
            on_policy = all(t.behavior_version_max == trained_version for t in trajectories)
            stats = await self.learner.call("train_step", batch, on_policy)
            self.version += 1
            self.log.event("train", t_train, self._now(), step=step)
            if sync:
                t_sync = self._now()
                await self._sync_weights(await self.learner.publish())
                self.log.event("sync", t_sync, self._now(), version=self.version)
            busy = await self.rollout.busy_s() - busy0
            row = self._step_metrics(step, trained_version, ready, trajectories, stats, t0, waited, busy)
            if self.cfg.eval_every and step % self.cfg.eval_every == 0:
                row.update(await self._evaluate())
            self.log.metrics(row)
            self.log.samples(self._sample_rows(step, trained_version, ready))
            if self.cfg.save_every and step % self.cfg.save_every == 0 and step < self.cfg.total_steps:
                await self._save(step, self._run_state(step))
        return step

    async def _take_unless_stopped(self, trained_version: int) -> list[ReadyGroup] | None:
        take = asyncio.ensure_future(self.buffer.take(self.cfg.batch_size, trained_version))
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({take, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if take.done():
            return take.result()
        take.cancel()
        return None

    def _run_state(self, step: int) -> RunState:
        """Taken on the event loop between two awaits, so the buffer and the in-flight set
        are one consistent picture even though rollouts go on while the files are written."""
        buffered = self.buffer.snapshot()
        in_buffer = {g.start_order for g in buffered}
        unfinished = [i for order, i in sorted(self._in_flight.items()) if order not in in_buffer]
        return RunState(step=step, elapsed_s=self._now(), started=self._started, epoch=self.stream.epoch,
                        index=self.stream.index, reissue=list(self.stream.reissue) + unfinished,
                        buffered=RunState.encode_groups(buffered), counters=self._counters(),
                        stale_dropped=self.buffer.stale_dropped)

    async def _save(self, step: int, state: RunState) -> None:
        ckpt_dir = self.output_dir / "checkpoints"
        self.last_checkpoint = await self.learner.call(
            "save_checkpoint", ckpt_dir / f"step_{step}", {"step": step}, {RUN_STATE_FILE: state.to_json()})
        self._saved_step = step
        rotate(ckpt_dir, self.cfg.keep_last)

    def _counters(self) -> dict[str, int]:
        """Since the run began (across resumes)."""
        restarts = getattr(self.rollout, "restarts", 0)
        return {**self.counters, "worker_restarts": self._restarts_before + restarts}

    async def _sync_weights(self, weights: object) -> None:
        """Publish the learner's weights to the engines and open the gate for the new version."""
        mode = self.cfg.partial_rollout if self.cfg.mode == "async" else "off"
        await self.rollout.sync_weights(weights, self.version, mode)
        await self.gate.set_version(self.version)

    # --------------------------------------------------------------- rollout
    async def _rollout_loop(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                await self.gate.acquire()
                self._started += 1
                index = self.stream.next_index()
                self._in_flight[self._started] = index
                tg.create_task(self._run_group(self.splits.train[index], self._started))

    def _now(self) -> float:
        return time.perf_counter() - self.start_time

    async def _run_group(self, task: Task, start_order: int) -> None:
        await self._generate_group(task, start_order)
        del self._in_flight[start_order]  # only now: a cancelled group is re-issued on resume

    async def _generate_group(self, task: Task, start_order: int) -> None:
        started = self._now()
        episodes = await self.rollout.run_group(task, self.cfg.group_size)
        self.log.event("generate", started, self._now(), group=start_order)
        ok = [e for e in episodes if e.status == "ok" and e.trajectories]
        self.counters["episodes_error"] += len(episodes) - len(ok)
        self._finished_rewards += [e.reward for e in ok]  # before filtering: the unbiased view
        rewards = torch.tensor([[e.reward for e in ok]], dtype=torch.float32)
        if not ok:
            self.counters["groups_all_error"] += 1
            await self.gate.release_rejected()
            return
        if self.cfg.algorithm.filter_zero_variance and bool((rewards == rewards[0, 0]).all()):
            self.counters["groups_filtered"] += 1
            await self.gate.release_rejected()
            return
        advantages = compute_advantages(self.cfg.algorithm.advantage, rewards)[0].tolist()
        await self.buffer.put(ReadyGroup(Group(task.id, ok, advantages), start_order))

    # ------------------------------------------------------------ evaluation
    async def _evaluate(self) -> dict[str, float]:
        tasks = self.splits.validation[: self.cfg.eval.num_tasks]
        start = time.perf_counter()
        t_eval = self._now()
        result = await self.rollout.evaluate(tasks)
        self.log.event("eval", t_eval, self._now())
        return {"eval/reward_mean": result.mean_reward, "eval/pass@1": result.pass_at[1],
                "eval/num_errors": result.num_errors, "time/eval": time.perf_counter() - start}

    # --------------------------------------------------------------- metrics
    def _step_metrics(self, step: int, trained_version: int, ready: list[ReadyGroup], trajectories: list,
                      stats: dict[str, float], t0: float, waited: float, busy: float) -> dict[str, Any]:
        wall = time.perf_counter() - t0
        staleness = [trained_version - t.behavior_version_min for t in trajectories]
        rewards = [e.reward for r in ready for e in r.group.episodes]
        tokens = sum(t.num_model_tokens for t in trajectories)
        finished, self._finished_rewards = self._finished_rewards, []
        return {
            "step": step, "version": self.version,
            "reward/mean": sum(rewards) / len(rewards),
            # every episode finished since the last step, filtered groups included
            "rollout/reward_mean": sum(finished) / len(finished) if finished else float("nan"),
            "rollout/episodes": len(finished),
            "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
            "time/step": wall, "time/elapsed": time.perf_counter() - self.start_time,
            "trainer/idle_ratio": waited / wall,
            "rollout/idle_ratio": max(0.0, 1 - busy / wall),
            "throughput/samples_per_s": len(trajectories) / wall, "throughput/tokens_per_s": tokens / wall,
            "rollout/resumed_fraction": sum(t.resumed for t in trajectories) / len(trajectories),
            "rollout/response_tokens_mean": tokens / len(trajectories),
            "buffer/groups_ready": len(self.buffer), "buffer/stale_dropped_total": self.buffer.stale_dropped,
            **{f"rollout/{k}_total": v for k, v in self._counters().items()},
            **stats,
        }

    def _sample_rows(self, step: int, trained_version: int, ready: list[ReadyGroup]) -> list[dict[str, Any]]:
        rows = []
        for r in ready:
            for index, (episode, adv) in enumerate(zip(r.group.episodes, r.group.advantages or [])):
                for t in episode.trajectories:
                    rows.append({
                        "step": step, "task_id": r.group.task_id, "group": r.start_order, "episode": index,
                        "reward": t.reward, "advantage": adv,
                        "behavior_version_min": t.behavior_version_min,
                        "behavior_version_max": t.behavior_version_max, "trained_version": trained_version,
                        "response_tokens": t.num_model_tokens, "finish_reason": t.finish_reason,
                        "resumed": t.resumed, "num_resumes": t.num_resumes,
                        "response": self.tokenizer.decode(t.response_ids, skip_special_tokens=True),
                    })
        return rows
