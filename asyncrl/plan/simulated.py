"""Cost-model engines and learner behind the runtime's two handles (``runtime/protocol.py``),
so that the real trainer — gate, buffer, rollout loop, train loop, weight-sync strategy —
runs against them unchanged. They spend time with ``asyncio.sleep``: on the virtual clock
(``virtual_clock.py``) a plan, on a standard loop a slowed real run with the same events.

Tokens are simulated in units of ``unit`` tokens (1 for short responses; more when a
workload's responses are long, so that a plan with 30,000-token responses does not build
30,000-element lists): a unit costs ``unit`` decode steps, and every token of a unit
carries the version that sampled it — the version can change only between units.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.core_budget import SIDES, WHOLE_WHEN_ALONE
from asyncrl.rollout.eval_scoring import EvalResult
from asyncrl.learner import TrainBatch
from asyncrl.plan.costs import Costs, LearnerCosts
from asyncrl.plan.engine import SharedCores, SimulatedEngine, SimulatedSequence
from asyncrl.runtime import Runtime, RuntimeStarter
from asyncrl.seeding import derive_seed
from asyncrl.tasks.base import Task
from asyncrl.types import Episode, Trajectory
from asyncrl.weight_sync import ObjectStoreSync

FILLER_TOKEN = 1
"""The id every simulated token carries: lengths and versions are what a plan is about."""


class SimulatedRollout:
    """The rollout handle over ``engines``: each sample goes to the least loaded engine. The
    first shares its cores with the learner (``cores``): a measured run's engine did."""

    def __init__(self, cfg: Config, costs: Costs, unit: int, cores: SharedCores | None = None) -> None:
        self.cfg, self.costs, self.unit = cfg, costs, unit
        self.engines = [SimulatedEngine(costs.engine, unit, cores if i == 0 else None) for i in range(costs.engines)]
        self._deck = costs.workload.deal(derive_seed(cfg.seed, "plan"))
        self.restarts = 0

    async def run_group(self, task: Task, n: int, draw: int = 0,
                        replay: Mapping[int, dict[str, Any]] | None = None) -> list[Episode]:
        rng = random.Random(derive_seed(self.cfg.seed, "plan", task.id, draw))
        lengths = self.costs.workload.group(next(self._deck, None), rng, n)
        filtered = rng.random() < self.costs.workload.filtered_fraction
        rewards = [0.0] * n if filtered else [float(i % 2) for i in range(n)]
        max_units = max(1, self.cfg.sampling.max_tokens // self.unit)

        async def sample(prompt: int, response: int) -> SimulatedSequence:
            await asyncio.sleep(self.costs.episode_lead_s)  # the workflow's own time, then the engine's
            engine = min(self.engines, key=lambda e: e.load)
            done = await engine.generate(max(1, prompt // self.unit), min(max_units, max(1, response // self.unit)),
                                         (task.id, draw))
            await asyncio.sleep(self.costs.episode_tail_s)
            return done

        sequences = await asyncio.gather(*[sample(p, r) for p, r in lengths])
        return [Episode(task.id, [Trajectory(
            prompt_ids=[FILLER_TOKEN] * s.prompt, response_ids=[FILLER_TOKEN] * s.target, loss_mask=[1] * s.target,
            logprobs=[0.0] * s.target, versions=s.versions, reward=reward,
            finish_reason="length" if s.target >= max_units else "stop", num_resumes=s.resumes)], reward=reward)
            for s, reward in zip(sequences, rewards)]

    async def in_flight(self) -> list[dict[str, Any]]:
        return []  # a plan keeps no journals: nothing resumes from its checkpoints

    async def evaluate(self, tasks: list[Task], *, version: int, weights: Any = None,
                       on_episode: Callable[[Episode], None] | None = None) -> EvalResult:
        """Takes no simulated time: evaluations are left out of a plan (and of the
        benchmarks' samples/s, which count from the first step's start)."""
        return EvalResult(mean_reward=0.0, pass_at={1: 0.0}, num_tasks=len(tasks), samples_per_task=1,
                          num_errors=0, episodes=[])

    async def sync_weights(self, weights: Any, version: int, mode: str) -> list[int]:
        seconds = self.costs.sync.sync(len(self.engines))
        await asyncio.gather(*[e.load_weights(version, mode, seconds) for e in self.engines])
        return [e.version for e in self.engines]

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        raise NotImplementedError("a simulated rollout runs no functions in workers (plan syncs by object_store)")

    async def engine_work(self) -> dict[str, float]:
        e = self.engines
        return {"busy_s": sum(x.busy_s for x in e) / len(e), "decode_steps": sum(x.decode_steps for x in e),
                "prefills": sum(x.prefills for x in e), "prefill_rows": sum(x.prefill_rows for x in e),
                "prefill_tokens": sum(x.prefill_tokens for x in e),
                "prefill_reused": sum(x.prefill_reused for x in e), "tokens": sum(x.tokens for x in e),
                "prefill_s": sum(x.prefill_s for x in e), "drain_s": sum(x.drain_s for x in e) / len(e)}

    async def engine_fleet(self) -> dict[str, float | str]:
        return {}  # simulated engines: no servers to lose

    async def gateway_counts(self) -> dict[str, int]:
        return {}

    async def shutdown(self) -> None:
        """Nothing to release: the engines' loops end with the runtime."""


class SimulatedLearner:
    """The learner handle on a cost model: a step takes the time its tokens cost."""

    def __init__(self, costs: LearnerCosts, unit: int, version: int = 0, cores: SharedCores | None = None) -> None:
        self.costs, self.unit, self.version, self.cores = costs, unit, version, cores
        self._pending = 0.0  # streaming: seconds accumulated towards the step
        self._first = True

    def _tokens(self, batch: TrainBatch) -> int:
        return int(batch.attention_mask.sum()) * self.unit

    def _warmup(self) -> float:
        first, self._first = self._first, False
        return self.costs.warmup_s if first else 0.0

    async def _compute(self, seconds: float) -> None:
        if self.cores is None:
            await asyncio.sleep(seconds)
        else:
            await self.cores.compute(seconds, self.costs.contention, self.costs.alone_speedup)

    async def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        seconds = self.costs.step(self._tokens(batch), on_policy) + self._warmup()
        await self._compute(seconds)
        await asyncio.sleep(self.costs.overhead_s)
        self.version += 1
        return {"actor/simulated_s": seconds}

    async def accumulate(self, batch: TrainBatch, on_policy: bool) -> None:
        seconds = self.costs.step(self._tokens(batch), on_policy) - self.costs.step_s * (1 if on_policy else
                                                                                          1 + self.costs.recompute)
        seconds += self._warmup()
        self._pending += seconds
        await self._compute(seconds)

    async def finish_step(self) -> dict[str, float]:
        seconds, self._pending = self._pending + self.costs.step_s, 0.0
        await self._compute(self.costs.step_s)
        await asyncio.sleep(self.costs.overhead_s)
        self.version += 1
        return {"actor/simulated_s": seconds}

    async def publish(self) -> object:
        return ("simulated weights", self.version)

    async def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path:
        """The trainer's own files only (its run state), so the plan's directory reads like a run's."""
        path.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (path / name).write_text(text)
        return path

    async def load_checkpoint(self, path: Path) -> int:
        raise NotImplementedError("a plan does not resume")

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        raise NotImplementedError("a simulated learner runs no functions in workers (plan syncs by object_store)")

    def stop_soon(self) -> None:
        """A simulated step always returns: nothing to cut short."""

    async def shutdown(self) -> None:
        """Nothing held."""


def simulated_runtime(costs: Costs, unit: int) -> RuntimeStarter:
    """A ``RuntimeStarter`` (``asyncrl.runtime``) whose handles are simulated on ``costs``
    (``costs.for_mode(cfg.mode)``: a colocated sync baseline gets every device)."""

    @asynccontextmanager
    async def start(cfg: Config, *, model: Any, tokenizer: Any, train: bool = True,
                    checkpoint: Path | None = None, version: int = 0) -> AsyncIterator[Runtime]:
        mode_costs = costs.for_mode(cfg.mode)
        # a side alone has every core where the run hands them over (colocated), or has them anyway (sync)
        sharing = cfg.rollout.thread_sharing
        cores = SharedCores(SIDES if cfg.mode == "sync" else WHOLE_WHEN_ALONE[sharing],
                            engine_yields=cfg.mode != "sync" and sharing == "turns")
        rollout = SimulatedRollout(cfg, mode_costs, unit, cores)
        learner = SimulatedLearner(mode_costs.learner, unit, version, cores)
        async with asyncio.TaskGroup() as engines:  # an engine's failure fails the run
            loops = [engines.create_task(e.run()) for e in rollout.engines]
            try:
                yield Runtime(learner, rollout, ObjectStoreSync(learner, rollout))
            finally:
                for task in loops:
                    task.cancel()

    return start
