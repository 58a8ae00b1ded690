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
import math
import random
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.eval_scoring import EvalResult
from asyncrl.learner import TrainBatch
from asyncrl.plan.costs import Costs, EngineCosts, LearnerCosts
from asyncrl.runtime import Runtime
from asyncrl.seeding import derive_seed
from asyncrl.tasks.base import Task
from asyncrl.types import Episode, Trajectory
from asyncrl.weight_sync import ObjectStoreSync

FILLER_TOKEN = 1
"""The id every simulated token carries: lengths and versions are what a plan is about."""


@dataclass(eq=False)
class _Sequence:
    prompt: int  # units
    target: int  # units of response it will have when done
    done: asyncio.Future[None]
    group: tuple[str, int]  # (task id, draw): a group's samples share a prompt
    versions: list[int] = field(default_factory=list)  # one per response unit, as sampled
    resumes: int = 0

    @property
    def context(self) -> int:
        return self.prompt + len(self.versions)


class SimulatedEngine:
    """Continuous batching on a cost model: newcomers are prefilled together between decode
    steps, one decode step advances every running sequence by a unit, and a weight sync
    lands between steps — as the torch engine does it."""

    def __init__(self, costs: EngineCosts, unit: int) -> None:
        self.costs, self.unit = costs, unit
        self.version = 0
        self.waiting: list[_Sequence] = []
        self.running: list[_Sequence] = []
        self.busy_s = 0.0
        self.decode_steps = self.prefills = self.prefill_rows = self.tokens = 0
        self._prefilled: set[tuple[str, int]] = set()  # prompts prefilled (the torch engine keeps them)
        self._wake = asyncio.Event()
        self._hold = asyncio.Event()  # set while a weight sync holds the engine
        self._parked = asyncio.Event()  # the engine stands between steps, held
        self._draining = False  # a sync that lets running sequences finish first: no admissions

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    async def generate(self, prompt: int, target: int, group: tuple[str, int]) -> _Sequence:
        seq = _Sequence(prompt, target, asyncio.get_running_loop().create_future(), group)
        self.waiting.append(seq)
        self._wake.set()
        await seq.done
        return seq

    async def run(self) -> None:
        """The engine's loop, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:  # a sequence whose caller went away (a cancelled group) is dropped, as an engine aborts it
            self.running = [s for s in self.running if not s.done.cancelled()]
            self.waiting = [s for s in self.waiting if not s.done.cancelled()]
            room = self.costs.max_batch - len(self.running)
            admit = [] if self._draining else self.waiting[:max(0, room)]
            if self._hold.is_set() or not (admit or self.running):
                self._parked.set()
                self._wake.clear()
                await self._wake.wait()
                self._parked.clear()
                continue
            if admit:  # prefill: a resumed sequence's partial response is prefilled with its prompt
                del self.waiting[:len(admit)]
                rows = [s for s in admit if s.versions] + [next(s for s in admit if s.group == g) for g in dict.fromkeys(
                    s.group for s in admit if not s.versions and s.group not in self._prefilled)]
                self._prefilled.update(s.group for s in admit)
                cost = self.costs.prefill(len(rows), sum(s.context for s in rows) * self.unit)
                await asyncio.sleep(cost)
                self.busy_s += cost
                self.prefills += 1
                self.prefill_rows += len(rows)
                for s in admit:  # a prefill samples each newcomer's next unit
                    s.versions.append(self.version)
                self.tokens += len(admit) * self.unit
                self.running += admit
                self._settle()
                continue
            unit_s = self.unit * self.costs.decode_step(len(self.running),
                                                       sum(s.context for s in self.running) * self.unit)
            steps = min(s.target - len(s.versions) for s in self.running)  # units until the first one ends
            start = loop.time()
            self._wake.clear()
            try:  # a newcomer or a sync interrupts at the next unit's boundary
                await asyncio.wait_for(self._wake.wait(), steps * unit_s)
                done = min(steps, max(1, math.ceil((loop.time() - start) / unit_s - 1e-9)))
                await asyncio.sleep(max(0.0, start + done * unit_s - loop.time()))
            except TimeoutError:
                done = steps
            self.busy_s += done * unit_s
            self.decode_steps += done * self.unit
            self.tokens += done * len(self.running) * self.unit
            for s in self.running:
                s.versions += [self.version] * done
            self._settle()

    def _settle(self) -> None:
        finished = [s for s in self.running if len(s.versions) >= s.target]
        self.running = [s for s in self.running if len(s.versions) < s.target]
        for s in finished:
            if not s.done.done():
                s.done.set_result(None)

    async def load_weights(self, version: int, mode: str, seconds: float) -> None:
        """A sync of ``version`` taking ``seconds``: ``continue`` goes on with the new weights
        after it, ``abort`` sends running sequences back to be prefilled again with their
        partial response (a resume), ``off`` finishes them on the old weights first."""
        if mode == "off":
            self._draining = True
            while self.running:
                await asyncio.wait([s.done for s in self.running], return_when=asyncio.FIRST_COMPLETED)
        self._hold.set()
        self._wake.set()
        await self._parked.wait()
        if mode == "abort":
            for s in self.running:
                s.resumes += 1
            self.waiting[:0], self.running = self.running, []
        await asyncio.sleep(seconds)
        self.version = version
        self._hold.clear()
        self._draining = False
        self._wake.set()


class SimulatedRollout:
    """The rollout handle over ``engines``: each sample goes to the least loaded engine."""

    def __init__(self, cfg: Config, costs: Costs, unit: int) -> None:
        self.cfg, self.costs, self.unit = cfg, costs, unit
        self.engines = [SimulatedEngine(costs.engine, unit) for _ in range(costs.engines)]
        self.restarts = 0

    async def run_group(self, task: Task, n: int, draw: int = 0,
                        replay: Mapping[int, dict[str, Any]] | None = None) -> list[Episode]:
        rng = random.Random(derive_seed(self.cfg.seed, "plan", task.id, draw))
        lengths = self.costs.workload.draw_group(rng, n)
        filtered = rng.random() < self.costs.workload.filtered_fraction
        rewards = [0.0] * n if filtered else [float(i % 2) for i in range(n)]
        max_units = max(1, self.cfg.sampling.max_tokens // self.unit)

        async def sample(prompt: int, response: int) -> _Sequence:
            engine = min(self.engines, key=lambda e: e.load)
            return await engine.generate(max(1, prompt // self.unit), min(max_units, max(1, response // self.unit)),
                                         (task.id, draw))

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
                "tokens": sum(x.tokens for x in e)}

    async def gateway_counts(self) -> dict[str, int]:
        return {}

    async def shutdown(self) -> None:
        """Nothing to release: the engines' loops end with the runtime."""


class SimulatedLearner:
    """The learner handle on a cost model: a step takes the time its tokens cost."""

    def __init__(self, costs: LearnerCosts, unit: int, version: int = 0) -> None:
        self.costs, self.unit, self.version = costs, unit, version
        self._pending = 0.0  # streaming: seconds accumulated towards the step
        self._first = True

    def _tokens(self, batch: TrainBatch) -> int:
        return int(batch.attention_mask.sum()) * self.unit

    def _warmup(self) -> float:
        first, self._first = self._first, False
        return self.costs.warmup_s if first else 0.0

    async def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        seconds = self.costs.step(self._tokens(batch), on_policy) + self._warmup()
        await asyncio.sleep(seconds + self.costs.overhead_s)
        self.version += 1
        return {"actor/simulated_s": seconds}

    async def accumulate(self, batch: TrainBatch, on_policy: bool) -> None:
        seconds = self.costs.step(self._tokens(batch), on_policy) - self.costs.step_s * (1 if on_policy else
                                                                                          1 + self.costs.recompute)
        seconds += self._warmup()
        self._pending += seconds
        await asyncio.sleep(seconds)

    async def finish_step(self) -> dict[str, float]:
        seconds, self._pending = self._pending + self.costs.step_s, 0.0
        await asyncio.sleep(self.costs.step_s + self.costs.overhead_s)
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

    async def shutdown(self) -> None:
        """Nothing held."""


def unit_for(max_response: int, max_units: int = 512) -> int:
    """Tokens per simulated unit: 1 unless responses run past ``max_units`` tokens."""
    return max(1, math.ceil(max_response / max_units))


def simulated_runtime(costs: Costs, unit: int):  # noqa: ANN201 - a RuntimeStarter
    """A ``RuntimeStarter`` (``asyncrl.runtime``) whose handles are simulated on ``costs``
    (``costs.for_mode(cfg.mode)``: a colocated sync baseline gets every device)."""

    @asynccontextmanager
    async def start(cfg: Config, *, model: Any, tokenizer: Any, train: bool = True,
                    checkpoint: Path | None = None, version: int = 0) -> AsyncIterator[Runtime]:
        mode_costs = costs.for_mode(cfg.mode)
        rollout = SimulatedRollout(cfg, mode_costs, unit)
        learner = SimulatedLearner(mode_costs.learner, unit, version)
        async with asyncio.TaskGroup() as engines:  # an engine's failure fails the run
            loops = [engines.create_task(e.run()) for e in rollout.engines]
            try:
                yield Runtime(learner, rollout, ObjectStoreSync(learner, rollout))
            finally:
                for task in loops:
                    task.cancel()

    return start
