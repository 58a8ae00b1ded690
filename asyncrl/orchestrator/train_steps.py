"""One optimizer step's training: take the step's B groups from the buffer, check each is
fresh enough, pack them and hand them to the learner, batched or streamed.

Where staleness is enforced on the learner's side: every group passes
``buffer.trainable`` at the version being trained, whichever way the step is fed, so the
learner never trains a token older than η versions (the gate upstream makes that check
pass; this one would fail loudly if it did not).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from asyncrl.config import Config
from asyncrl.learner import TrainBatch, pack_batch
from asyncrl.orchestrator.buffer import GroupBuffer, ReadyGroup, trainable
from asyncrl.orchestrator.step_meter import Trained, learner_call
from asyncrl.orchestrator.stopping import StopControl
from asyncrl.orchestrator.watchdog import Watchdog
from asyncrl.policy import resolve_device
from asyncrl.runtime import LearnerHandle, RolloutHandle

T = TypeVar("T")


def engine_computes_as_learner(cfg: Config) -> bool:
    """Whether the engine's logprobs are the learner's at the same version, to float32
    rounding: no weight noise, the engine in the weights' dtype, and the learner not under
    bf16 autocast (``learner.autocast``; unset means bf16 on CUDA). Only then may an on-policy
    batch take π_prox := μ and skip the recompute; otherwise the correction and the masks
    would never see the engine–learner mismatch on the trained version's tokens."""
    autocast = cfg.learner.autocast == "bfloat16" or (
        cfg.learner.autocast is None and resolve_device(cfg.model.device).type == "cuda")
    return not cfg.rollout.engine_weight_noise and cfg.engine_dtype == cfg.model.dtype and not autocast


class TrainSteps:
    def __init__(self, buffer: GroupBuffer, learner: LearnerHandle, rollout: RolloutHandle, *, batch_size: int,
                 pad_token_id: int, stop: StopControl, watchdog: Watchdog,
                 on_train: Callable[[float, float, int], None], now: Callable[[], float],
                 engine_exact: bool = True, distill_coef: float = 0.0) -> None:
        """``on_train(start, end, step)``: each learner call's span, for the timeline.
        ``engine_exact``: the engine's logprobs are the learner's at the same version (to
        float rounding), so an on-policy batch may take π_prox := μ and skip the recompute;
        ``False`` (``rollout.engine_weight_noise``, or ``rollout.dtype`` other than
        ``model.dtype``) recomputes always, or the correction and the masks would never see
        the engine–learner mismatch on the tokens of the trained version. ``distill_coef``:
        on-policy distillation's weight (``teacher.coef``; 0 = off)."""
        self.buffer, self.learner, self.rollout = buffer, learner, rollout
        self.batch_size, self.pad_token_id = batch_size, pad_token_id
        self._stop, self._watchdog, self._on_train, self._now = stop, watchdog, on_train, now
        self.engine_exact, self.distill_coef = engine_exact, distill_coef
        self.streaming = False  # learner.streaming: each group handed to the learner as it is taken
        self.outcomes = False  # algorithm.advantage: gae: groups carry outcome rewards (the critic does the rest)

    @classmethod
    def for_run(cls, cfg: Config, buffer: GroupBuffer, learner: LearnerHandle, rollout: RolloutHandle,
                pad_token_id: int, stop: StopControl, watchdog: Watchdog, now: Callable[[], float],
                on_train: Callable[[float, float, int], None]) -> TrainSteps:
        """A run's, from its config: B, the recompute rule (:func:`engine_computes_as_learner`),
        the distillation weight, batched or streamed."""
        steps = cls(buffer, learner, rollout, batch_size=cfg.batch_size, pad_token_id=pad_token_id, stop=stop,
                    watchdog=watchdog, on_train=on_train, now=now, engine_exact=engine_computes_as_learner(cfg),
                    distill_coef=cfg.teacher.coef if cfg.teacher.url else 0.0)
        steps.streaming = cfg.learner.streaming
        steps.outcomes = cfg.algorithm.uses_critic
        return steps

    async def train(self, version: int, step: int) -> Trained | None:
        """The step's training at ``version``: :meth:`streamed` or :meth:`batched`."""
        return await (self.streamed if self.streaming else self.batched)(version, step)

    async def batched(self, version: int, step: int) -> Trained | None:
        """Wait for the step's B groups, then one ``train_step`` on them all. None when a
        stop came first (nothing half-done)."""
        t0 = self._now()
        groups = await self._take_unless_stopped(self.batch_size, version)
        if groups is None:
            return None
        trained = Trained(waited_s=self._now() - t0)
        trained.actor = await self._learn(trained, step,
                                          self.learner.train_step(*self._batch(trained, groups, version)))
        return trained

    async def streamed(self, version: int, step: int) -> Trained | None:
        """``learner.streaming``: forward and backward (``accumulate``) on every group ready
        now, up to the step's B, while the others generate; then on each as it comes (or
        all that came meanwhile); the optimizer step (``finish_step``) once B are in. The
        buffer picks the groups of each take by its own rule, as for a batched step's one
        take (it counts the takes of a version); each passes the same staleness check at
        ``version``; the rows list the step's groups in start order. Asked to stop while
        waiting, it puts the groups taken back in the buffer (a checkpoint keeps them
        untrained, as it would have had they waited there) and their gradients are dropped."""
        trained = Trained()
        while len(trained.groups) < self.batch_size:
            t0 = self._now()
            want = min(self.batch_size - len(trained.groups), max(1, len(self.buffer)))
            groups = await self._take_unless_stopped(want, version)
            trained.waited_s += self._now() - t0
            if groups is None:
                self.buffer.restore(trained.groups)
                return None
            await self._learn(trained, step, self.learner.accumulate(*self._batch(trained, groups, version)))
        trained.actor = await self._learn(trained, step, self.learner.finish_step())
        trained.groups.sort(key=lambda g: g.start_order)
        return trained

    def _batch(self, trained: Trained, groups: list[ReadyGroup], version: int) -> tuple[TrainBatch, bool]:
        """``groups``, each checked fresh enough to train ``version`` on (``trainable``) and
        added to ``trained``, packed; and whether ``version`` sampled every token of them
        (then π_prox = μ, and the learner skips its recompute)."""
        trajectories, advantages = trainable(groups, version, self.buffer.max_lag)
        trained.groups += groups
        trained.trajectories += trajectories
        on_policy = self.engine_exact and all(t.behavior_version_max == version for t in trajectories)
        return pack_batch(trajectories, advantages, self.pad_token_id, self.distill_coef,
                          outcomes=self.outcomes), on_policy

    async def _learn(self, trained: Trained, step: int, call: Awaitable[T]) -> T:
        """A learner call of ``step``, timed into ``trained`` (``step_meter.learner_call``) and on the timeline."""
        start = self._now()
        out = await learner_call(self.rollout, trained, call)
        self._on_train(start, self._now(), step)
        return out

    async def _take_unless_stopped(self, n: int, version: int) -> list[ReadyGroup] | None:
        take = asyncio.ensure_future(self.buffer.take(n, version))
        stop = asyncio.ensure_future(self._stop.wait())
        self._watchdog.waiting(True)
        try:
            await asyncio.wait({take, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._watchdog.waiting(False)
            stop.cancel()
        if take.done():
            return take.result()
        take.cancel()
        return None
