"""The rollout side of the orchestrator: the gate admits a task, its n episodes run on the
rollout handle, the group is scored and either filtered (its quota released) or put in
the buffer for the learner. It owns what a checkpoint must keep of this side: the data
cursor, the groups handed out and not finished, the groups generated and not trained."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.algorithms import compute_advantages
from asyncrl.algorithms.finite import check_advantages, check_rewards
from asyncrl.config import Config
from asyncrl.frozen.client import FrozenModel, FrozenModelError
from asyncrl.frozen.teacher import score_group
from asyncrl.orchestrator.buffer import BUFFER_COUNTS, GroupBuffer, ReadyGroup
from asyncrl.orchestrator.checkpoint import RunState
from asyncrl.orchestrator.staleness import AsyncStalenessGate, StalenessGate
from asyncrl.orchestrator.step_meter import RolloutSide
from asyncrl.orchestrator.task_sampler import SAMPLER_COUNTS, TaskSampler, group_outcome
from asyncrl.orchestrator.task_stream import Draw, TaskStream
from asyncrl.orchestrator.watchdog import Watchdog
from asyncrl.runtime import RolloutHandle
from asyncrl.tasks.base import Task
from asyncrl.types import Episode, Group

TEACHER_FAILURES_IN_A_ROW = 8


def teacher_of(cfg: Config) -> FrozenModel | None:
    t = cfg.teacher
    if not t.url:
        return None
    return FrozenModel("teacher", t.url, model=t.model, api_key=t.api_key, max_concurrency=t.max_concurrency,
                       timeout_s=t.timeout_s, retries=t.retries)


class RolloutLoop:
    def __init__(self, cfg: Config, tasks: list[Task], version: int, watchdog: Watchdog,
                 state: RunState | None = None, in_flight: list[dict[str, Any]] | None = None) -> None:
        """A fresh loop at ``version``, or the one checkpointed in ``state``, whose episodes
        under way (``in_flight``: their journals) continue when their tasks are re-issued."""
        self.cfg, self.tasks, self.watchdog = cfg, tasks, watchdog
        self.replays: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}  # (task id, draw) -> sample -> journal
        for journal in in_flight or []:
            key = journal["key"]
            self.replays.setdefault((key["task_id"], key["draw"]), {})[key["sample"]] = journal
        eta = cfg.effective_max_staleness
        self.started = 0  # groups admitted so far: the start order of the next fresh one is started + 1
        self.in_flight: dict[int, Draw] = {}  # start order -> its draw, until the group is done
        self.finished_rewards: list[float] = []  # every episode's since the last step, filtered ones too
        self.teacher = teacher_of(cfg)  # on-policy distillation's frozen teacher, or None
        self.teacher_failures_in_a_row = 0
        if state is None:
            self.gate = AsyncStalenessGate(StalenessGate(eta, cfg.batch_size, version))
            self.buffer = GroupBuffer(self.gate)
            self.stream = TaskStream(tasks, cfg.seed)
        else:  # consumed and saved groups hold quota; re-issued tasks take it again when they start
            groups = state.ready_groups()
            accepted = state.step * cfg.batch_size + len(groups)
            self.gate = AsyncStalenessGate(StalenessGate.resumed(eta, cfg.batch_size, version, accepted))
            self.buffer = GroupBuffer(self.gate)
            self.buffer.restore(groups)
            self.buffer.stale_dropped = state.stale_dropped
            self.started = state.started
            self.stream = TaskStream(tasks, cfg.seed, state.epoch, state.index, state.reissue)
        self._count_drops_and_sample()

    async def run(self, rollout: RolloutHandle, now: Callable[[], float], on_episode: Callable[[Episode], None],
                  on_generated: Callable[[float, float, int], None]) -> None:
        """Until cancelled. ``on_episode``: every finished episode (errors, watchdog);
        ``on_generated(start, end, start_order)``: a group's generation, on ``now``'s clock."""
        async with asyncio.TaskGroup() as tg:
            while True:
                await self.buffer.hold_to_first_batch()
                await self.gate.acquire()
                draw = self.stream.next_draw()
                order = draw.order
                if order is None:  # a fresh one; a re-issued one keeps its place in the start order
                    self.started += 1
                    order = self.started
                    draw = draw._replace(order=order)
                self.in_flight[order] = draw
                task = self.tasks[draw.index]
                replay = self.replays.pop((task.id, draw.epoch), None)
                tg.create_task(self._group(rollout, task, draw.epoch, order, now, on_episode, on_generated,
                                           replay))

    async def _group(self, rollout: RolloutHandle, task: Task, epoch: int, start_order: int, now: Callable[[], float],
                     on_episode: Callable[[Episode], None], on_generated: Callable[[float, float, int], None],
                     replay: dict[int, dict[str, Any]] | None = None) -> None:
        started = now()
        if not replay:  # the learner may wait for it (buffer.py); replayed tokens can be older than now
            self.buffer.running(start_order, self.gate.version)
        episodes = await rollout.run_group(task, self.cfg.group_size, epoch, replay)
        on_generated(started, now(), start_order)
        for episode in episodes:
            on_episode(episode)
        ok = [e for e in episodes if e.status == "ok" and e.trajectories]
        step = self.gate.version + 1  # the step being prepared
        algorithm = self.cfg.algorithm
        # what the estimator gets per episode: with a critic the outcome alone (each turn's own reward
        # reaches the learner on its own token, in Step.reward); otherwise the episode's total
        scores = [e.reward if algorithm.uses_critic else e.total_reward for e in ok]
        check_rewards([e.total_reward for e in ok], max_abs=algorithm.max_abs_reward, task_id=task.id, step=step)
        self.finished_rewards += [e.reward for e in ok]  # before filtering: the unbiased view
        if ok:
            self._outcome(self.in_flight[start_order].index, [e.reward for e in ok])
        rewards = torch.tensor([scores], dtype=torch.float32)
        same = bool((rewards == rewards[0, 0]).all()) if ok else True
        # with a teacher every token teaches (its distillation term), and with a critic every token has
        # its own advantage (the values differ), so equal rewards filter nothing there
        filters = algorithm.filter_zero_variance and self.teacher is None and not algorithm.uses_critic
        if not ok or (filters and same):
            self.watchdog.group("filtered" if ok else "all_error", episodes)
            await self.buffer.reject(start_order)
        elif self.teacher is not None and not await self._distill(ok, task):
            await self.buffer.reject(start_order)
        else:
            computed = compute_advantages(self.cfg.algorithm.advantage, rewards)[0]
            check_advantages(computed, estimator=self.cfg.algorithm.advantage, task_id=task.id, step=step)
            advantages = computed.tolist() if self.cfg.teacher.with_reward or self.teacher is None else [0.0] * len(ok)
            self.watchdog.group("accepted")
            await self.buffer.put(ReadyGroup(Group(task.id, ok, advantages), start_order))
        del self.in_flight[start_order]  # only now: a cancelled group is re-issued on resume

    async def close(self) -> None:
        """The teacher's connections, once the loop has stopped."""
        if self.teacher is not None:
            await self.teacher.close()

    async def _distill(self, ok: list[Episode], task: Task) -> bool:
        """The teacher's logprobs of the group's sampled tokens (one batched call, here on the
        rollout side while other groups generate). A failed call drops the group and is
        counted (``rollout/teacher_failures_total``); ``TEACHER_FAILURES_IN_A_ROW`` of them
        stop the run, naming the teacher: a teacher that is gone would starve it."""
        assert self.teacher is not None
        try:
            await score_group(self.teacher, [t for e in ok for t in e.trajectories])
        except FrozenModelError as exc:
            self.watchdog.counts["teacher_failures"] = self.watchdog.counts.get("teacher_failures", 0) + 1
            self.teacher_failures_in_a_row += 1
            if self.teacher_failures_in_a_row >= TEACHER_FAILURES_IN_A_ROW:
                raise FrozenModelError(f"{exc} — {self.teacher_failures_in_a_row} groups in a row (the last task "
                                       f"{task.id}); stopping: check the teacher server") from None
            return False
        self.teacher_failures_in_a_row = 0
        return True

    def _outcome(self, index: int, rewards: list[float]) -> None:
        """A task's group scored: counted if every sample scored the same, and told to the sampler."""
        outcome = group_outcome(rewards, self.cfg.eval.success_threshold)
        if outcome != "mixed":
            self.watchdog.counts[f"groups_{outcome}"] += 1
        if self.stream.sampler is not None:
            self.stream.sampler.observe(index, outcome)

    def _count_drops_and_sample(self) -> None:
        """The buffer's and the sampler's counts join the watchdog's (``rollout/<name>_total``,
        kept across a resume), and ``task.sampler`` and ``stale_groups`` take effect."""
        counts = self.watchdog.counts
        for name in (*BUFFER_COUNTS, *SAMPLER_COUNTS):
            counts.setdefault(name, 0)
        self.buffer.counts, self.buffer.stale_groups = counts, self.cfg.stale_groups
        sampler = self.cfg.task.sampler
        if sampler.name == "adaptive":
            self.stream.sampler = TaskSampler(self.cfg.seed, sampler.window, sampler.min_probability, counts)

    def replay_note(self) -> str:
        """What a resume does with the episodes that were under way, said at the start.

        Of those, only the ones that had generated a token continue from the checkpoint:
        the others were queued, and start afresh as if never begun. The note counts the
        first kind as the rollout workers do, so that once their groups have finished
        ``rollout/replayed_episodes_total`` and ``rollout/replayed_tokens_total`` have grown
        by its figures (they count since the run began, across resumes; a user's agent that
        diverges is counted there too)."""
        journals = [j for samples in self.replays.values() for j in samples.values()]
        tokens = [sum(len(s["token_ids"]) for s in j["segments"]) for j in journals]
        begun = sum(1 for n in tokens if n)
        if not begun:
            return ("no episode under way at the checkpoint had generated a token"
                    + (f" ({len(journals)} were queued and start afresh)" if journals else ""))
        queued = (f"; the other {len(journals) - begun}, queued without a token, start afresh"
                  if len(journals) > begun else "")
        agent = (" A user's agent replays as long as it asks for what it asked before; from its first different "
                 "call it samples afresh (counted in rollout/replay_diverged_total)."
                 if self.cfg.workflow.name == "openai_agent" else "")
        return (f"{len(journals)} episodes were under way at the checkpoint: {begun} continue from the "
                f"{sum(tokens):,} tokens they had generated (replayed, not sampled again; cut-off replies resume with "
                f"their partial tokens; counted in rollout/replayed_episodes_total and rollout/replayed_tokens_total "
                f"as their groups finish){queued}.{agent}")

    def journals_to_keep(self, journals: list[dict[str, Any]], reissue: list[Draw]) -> list[dict[str, Any]]:
        """Of the workers' journals (``RolloutHandle.in_flight``), those of the groups a
        checkpoint re-issues (``reissue``, from :meth:`snapshot`), with the replays not yet
        started: what a restart continues. A group finished meanwhile is in the buffer or
        trained, and its journals go."""
        wanted = {(self.tasks[d.index].id, d.epoch) for d in reissue}
        waiting = [j for key, samples in self.replays.items() if key in wanted for j in samples.values()]
        return [j for j in journals if (j["key"]["task_id"], j["key"]["draw"]) in wanted] + waiting

    def side(self, counters: dict[str, int]) -> RolloutSide:
        """This side's part of a step's row, read at once (no await between the parts): the
        starvation window's filtered fraction, ``counters``, every episode's reward finished
        since the last step, the buffer."""
        held = {"groups_ready": len(self.buffer), "stale_dropped_total": self.buffer.stale_dropped}
        return RolloutSide(self.watchdog.starvation.fraction, counters, self.take_finished_rewards(), held)

    def take_finished_rewards(self) -> list[float]:
        finished, self.finished_rewards = self.finished_rewards, []
        return finished

    def snapshot(self) -> dict[str, Any]:
        """This side's part of a :class:`RunState`. Taken on the event loop between two
        awaits, so the buffer and the in-flight set are one consistent picture even though
        rollouts go on while the checkpoint is written."""
        buffered = self.buffer.snapshot()
        in_buffer = {g.start_order for g in buffered}
        unfinished = [draw for order, draw in sorted(self.in_flight.items()) if order not in in_buffer]
        return {"started": self.started, "epoch": self.stream.epoch, "index": self.stream.index,
                "reissue": [*self.stream.reissue, *unfinished], "buffered": RunState.encode_groups(buffered),
                "stale_dropped": self.buffer.stale_dropped}
