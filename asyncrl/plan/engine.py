"""The simulated engine: continuous batching on a cost model (:class:`EngineCosts`),
spending its time with ``asyncio.sleep`` — on the virtual clock in a plan. Newcomers are
prefilled together between decode steps (a group's samples share one prompt row, as with
the torch engine's group prefill), one decode step advances every running sequence by a
unit of tokens, and a weight sync lands between steps.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import dataclass, field

from asyncrl.plan.virtual_clock import run_virtual


@dataclass(frozen=True)
class EngineCosts:
    step_s: float
    per_sequence_s: float = 0.0
    per_context_token_s: float = 0.0
    prefill_s: float = 0.0
    prefill_per_row_s: float = 0.0
    prefill_per_token_s: float = 0.0
    max_batch: int = 256
    contention: float = 0.0
    """How much slower a decode step is while the learner computes on the same cores."""
    alone_speedup: float = 1.0
    """How much faster the engine computes with every core than with its share, where it has
    them while the learner is idle (``rollout.thread_sharing: colocated``, and ``sync``)."""
    padded: bool = False
    """A step's rows are padded to its longest (the torch engine): its context and a prefill's
    tokens are rows × longest, not their sum."""

    def decode_step(self, sequences: int, context_tokens: int) -> float:
        return self.step_s + self.per_sequence_s * sequences + self.per_context_token_s * context_tokens

    def positions(self, contexts: list[int]) -> int:
        """The positions a step over rows holding ``contexts`` tokens each computes on."""
        return len(contexts) * max(contexts, default=0) if self.padded else sum(contexts)

    def prefill(self, contexts: list[int]) -> float:
        """A prefill of rows holding ``contexts`` tokens each."""
        return (self.prefill_s + self.prefill_per_row_s * len(contexts)
                + self.prefill_per_token_s * self.positions(contexts))


@dataclass(eq=False)
class SimulatedSequence:
    prompt: int  # units
    target: int  # units of response it will have when done
    done: asyncio.Future[None]
    group: tuple[str, int]  # (task id, draw): a group's samples share a prompt
    versions: list[int] = field(default_factory=list)  # one per response unit, as sampled
    resumes: int = 0

    @property
    def context(self) -> int:
        return self.prompt + len(self.versions)


class SharedCores:
    """Who computes on the cores an engine shares with the learner (one machine): each
    slows the other down (``EngineCosts.contention``, ``LearnerCosts.contention``). A side
    of ``whole_when_alone`` (``rollout.thread_sharing: colocated`` both, ``colocated_learner``
    the learner; ``sync``, whose one thread has every core, both) computing while the other
    is idle has every core and runs ``alone_speedup`` times faster than on its share; any
    other keeps its share. ``engine_yields`` (``turns``): the engine computes only while the
    learner is idle, parked at its next unit while the learner works."""

    def __init__(self, whole_when_alone: tuple[str, ...] = (), engine_yields: bool = False) -> None:
        self.whole_when_alone = whole_when_alone
        self.engine_yields = engine_yields
        self.engine_busy = self.learner_busy = False
        self.engine_changed = asyncio.Event()  # the learner re-times its work on it
        self.engine_wake: asyncio.Event | None = None  # the engine's: it re-times its next unit

    def set_engine(self, busy: bool) -> None:
        if busy != self.engine_busy:
            self.engine_busy = busy
            self.engine_changed.set()

    def set_learner(self, busy: bool) -> None:
        if busy != self.learner_busy:
            self.learner_busy = busy
            if self.engine_wake is not None:
                self.engine_wake.set()

    def alone(self, side: str, speedup: float) -> float:
        """``side``'s time factor while the other is idle: ``1 / speedup`` with every core, else 1."""
        return 1 / speedup if side in self.whole_when_alone else 1.0

    async def compute(self, seconds: float, contention: float, alone_speedup: float = 1.0) -> None:
        """The learner's ``seconds`` of work on its share of the cores: ``1 + contention``
        times slower while the engine is busy, ``alone_speedup`` faster while it is idle
        where the learner then has every core (``whole_when_alone``)."""
        loop = asyncio.get_running_loop()
        self.set_learner(True)
        try:
            while seconds > 1e-12:
                slowdown = 1 + contention if self.engine_busy else self.alone("learner", alone_speedup)
                self.engine_changed.clear()
                start = loop.time()
                try:
                    await asyncio.wait_for(self.engine_changed.wait(), seconds * slowdown)
                    seconds -= (loop.time() - start) / slowdown
                except TimeoutError:
                    seconds = 0.0
        finally:
            self.set_learner(False)


class SimulatedEngine:
    """Continuous batching on a cost model: newcomers are prefilled together between decode
    steps, one decode step advances every running sequence by a unit, and a weight sync
    lands between steps — as the torch engine does it. With ``cores`` it shares them with
    the learner: its decode steps slow down while the learner computes."""

    def __init__(self, costs: EngineCosts, unit: int, cores: SharedCores | None = None) -> None:
        self.costs, self.unit, self.cores = costs, unit, cores
        self.version = 0
        self.waiting: list[SimulatedSequence] = []
        self.running: list[SimulatedSequence] = []
        self.busy_s = self.prefill_s = self.drain_s = 0.0
        self.decode_steps = self.prefills = self.prefill_rows = self.prefill_tokens = self.prefill_reused = 0
        self.tokens = 0
        self._prefilled: set[tuple[str, int]] = set()  # prompts prefilled (the torch engine keeps them)
        self._wake = asyncio.Event()
        if cores is not None:
            cores.engine_wake = self._wake
        self._hold = asyncio.Event()  # set while a weight sync holds the engine
        self._parked = asyncio.Event()  # the engine stands between steps, held
        self._draining = False  # a sync that lets running sequences finish first: no admissions

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    async def generate(self, prompt: int, target: int, group: tuple[str, int]) -> SimulatedSequence:
        seq = SimulatedSequence(prompt, target, asyncio.get_running_loop().create_future(), group)
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
            yields = self.cores is not None and self.cores.engine_yields and self.cores.learner_busy
            if self._hold.is_set() or yields or not (admit or self.running):
                if self.cores is not None:
                    self.cores.set_engine(False)
                self._parked.set()
                self._wake.clear()
                await self._wake.wait()
                self._parked.clear()
                continue
            if self.cores is not None:
                self.cores.set_engine(True)
            if admit:  # prefill: a resumed sequence's partial response is prefilled with its prompt
                del self.waiting[:len(admit)]
                rows = [s for s in admit if s.versions] + [
                    next(s for s in admit if s.group == g) for g in dict.fromkeys(
                        s.group for s in admit if not s.versions and s.group not in self._prefilled)]
                self._prefilled.update(s.group for s in admit)
                contexts = [s.context * self.unit for s in rows]
                cost = self.costs.prefill(contexts) * self._alone()
                await asyncio.sleep(cost)
                self.busy_s += cost
                self.prefill_s += cost
                self.prefills += 1
                self.prefill_rows += len(rows)
                self.prefill_tokens += self.costs.positions(contexts)
                self.prefill_reused += len(admit) - len(rows)
                for s in admit:  # a prefill samples each newcomer's next unit
                    s.versions.append(self.version)
                self.tokens += len(admit) * self.unit
                self.running += admit
                self._settle()
                continue
            context = self.costs.positions([s.context * self.unit for s in self.running])
            unit_s = self.unit * self.costs.decode_step(len(self.running), context)
            if self.cores is not None and self.cores.learner_busy:  # re-timed at the next unit when it stops
                unit_s *= 1 + self.costs.contention
            else:
                unit_s *= self._alone()
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

    def _alone(self) -> float:
        """This step's time factor with the learner idle (every core where the engine gets them)."""
        if self.cores is None or self.cores.learner_busy:
            return 1.0
        return self.cores.alone("engine", self.costs.alone_speedup)

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
            self._draining, start = True, asyncio.get_running_loop().time()
            while self.running:
                await asyncio.wait([s.done for s in self.running], return_when=asyncio.FIRST_COMPLETED)
            self.drain_s += asyncio.get_running_loop().time() - start
        self._hold.set()
        self._wake.set()
        await self._parked.wait()
        if mode == "abort":
            for s in self.running:
                s.resumes += 1
            # the client resubmits prompt + partial response: behind what was already waiting
            self.waiting, self.running = self.waiting + self.running, []
        await asyncio.sleep(seconds)
        self.version = version
        self._hold.clear()
        self._draining = False
        self._wake.set()


def unit_for(max_response: int, max_units: int = 512) -> int:
    """Tokens per simulated unit: 1 unless responses run past ``max_units`` tokens."""
    return max(1, math.ceil(max_response / max_units))


def generation_time(engine: EngineCosts, draws: list[list[int]], engines: int) -> float:
    """Mean over ``draws`` of the time ``engines`` simulated engines take to generate one
    batch dealt out evenly (the slowest engine's), on the virtual clock."""
    unit = unit_for(max(max(batch) for batch in draws))

    async def one(batch: list[int]) -> float:
        sims = [SimulatedEngine(engine, unit) for _ in range(engines)]
        loops = [asyncio.ensure_future(s.run()) for s in sims]
        await asyncio.gather(*[sims[i % engines].generate(1, max(1, n // unit), ("calibration", i))
                               for i, n in enumerate(batch)])
        for loop in loops:
            loop.cancel()
        return asyncio.get_running_loop().time()

    return statistics.mean(run_virtual(one(batch))[0] for batch in draws[:2])
