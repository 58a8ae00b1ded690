"""One rollout handle over a transport, the rollout side's twin of ``LearnerGroup``.

A transport carries ``call(i, method, *args)`` to worker i of N
:class:`~asyncrl.rollout.worker.RolloutWorker` instances; :class:`RolloutGroup` decides
which worker gets what: a group to the least loaded worker, an evaluation in shards over
all of them, weights and ``apply`` to every one, counts summed. Two transports:
:class:`InProcessRollouts` (N workers in this process, each engine on a thread of its
own) and ``RayRollouts`` (N actors, a dead one replaced: ``ray_runtime.py``). A worker
lost mid-call raises :class:`WorkerLost` after the transport replaced it; the group then
sends the work round again (a group to another worker, a shard again), so nothing is lost
with a worker but the time.

Adding a rollout call is one method on ``RolloutWorker``, its line in
``protocol.RolloutHandle`` and one method here, written out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from asyncrl.rollout.eval_scoring import EvalResult
from asyncrl.modes import PartialRollout
from asyncrl.runtime.protocol import Weights
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.tasks.base import Task
from asyncrl.types import Episode

T = TypeVar("T")


class WorkerLost(Exception):
    """A rollout worker died during a call; the transport has replaced it."""


class RolloutTransport(Protocol):
    size: int
    restarts: int
    """Workers replaced after dying, in this process's lifetime."""
    in_process: bool
    """The workers live in this process: a callback can be handed to them as it is."""

    async def call(self, i: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Worker ``i``'s ``method(*args, **kwargs)``; :class:`WorkerLost` when it died meanwhile."""
        ...

    def share(self, weights: Weights, version: int) -> Any:
        """``weights`` in the form calls carry them (a reference on Ray), and remembered
        with ``version`` for a worker that replaces a dead one."""
        ...

    async def close(self) -> None: ...


class RolloutGroup:
    """The :class:`~asyncrl.runtime.protocol.RolloutHandle` for every runtime."""

    def __init__(self, transport: RolloutTransport) -> None:
        self.transport = transport
        self.load = [0] * transport.size  # groups under way per worker

    @property
    def restarts(self) -> int:
        return self.transport.restarts

    async def run_group(self, task: Task, n: int, draw: int = 0,
                        replay: Mapping[int, dict[str, Any]] | None = None) -> list[Episode]:
        while True:  # sent again after a worker's death; the transport bounds the replacements
            i = min(range(self.transport.size), key=self.load.__getitem__)
            self.load[i] += 1
            try:
                return await self.transport.call(i, "run_group", task, n, draw, replay)
            except WorkerLost:
                continue
            finally:
                self.load[i] -= 1

    async def evaluate(self, tasks: list[Task], *, version: int, weights: Weights | None = None,
                       on_episode: Callable[[Episode], None] | None = None) -> EvalResult:
        """A shard of ``tasks`` on every worker; a shard lost with its worker goes round
        again. ``on_episode`` sees each episode as it ends in this process, or each shard's
        when the shard returns from another."""
        size = self.transport.size
        shards = {i: tasks[i::size] for i in range(size)}
        carried = self.transport.share(weights, version) if weights is not None else None
        local = on_episode if self.transport.in_process else None

        async def shard(i: int) -> EvalResult:
            result = await self.transport.call(i, "evaluate", shards[i], version, carried, local)
            if on_episode is not None and local is None:
                for episode in result.episodes:
                    on_episode(episode)
            return result

        parts: dict[int, EvalResult] = {}
        while todo := [i for i, part in shards.items() if part and i not in parts]:
            results = await asyncio.gather(*[shard(i) for i in todo], return_exceptions=True)
            for i, result in zip(todo, results):
                if isinstance(result, EvalResult):
                    parts[i] = result
                elif not isinstance(result, WorkerLost):
                    raise result
        return EvalResult.merge([parts[i] for i in sorted(parts)])

    async def in_flight(self) -> list[dict[str, Any]]:
        """Every live worker's journals (a worker lost meanwhile has none to give)."""
        return [j for journals in await self._every("in_flight") for j in journals]

    async def sync_weights(self, weights: Weights, version: int, mode: PartialRollout) -> list[int]:
        """The version each live worker serves afterwards (a replaced one starts from these)."""
        carried = self.transport.share(weights, version)
        return [v for versions in await self._every("sync_weights", carried, version, mode) for v in versions]

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, i, *args)`` on every worker i, in the worker's process."""
        parts = await asyncio.gather(*[self.transport.call(i, "apply", fn, *args, index=i)
                                       for i in range(self.transport.size)])
        return [value for part in parts for value in part]

    async def engine_work(self) -> dict[str, float]:
        """Busy and drain seconds as a mean per worker (a sync waits for the workers side by
        side), counts summed (a replaced worker starts again from 0)."""
        work = await self._every("engine_work")
        total = {key: sum(w[key] for w in work) for key in (work[0] if work else {}) if all(key in w for w in work)}
        return {**total, **{key: total[key] / max(1, len(work)) for key in ("busy_s", "drain_s") if key in total}}

    async def engine_fleet(self) -> dict[str, float | str]:
        """The one worker's (``engine: remote`` runs one client: the config refuses more)."""
        return next((fleet for fleet in await self._every("engine_fleet") if fleet), {})

    async def gateway_counts(self) -> dict[str, int]:
        """Summed over the live workers (a replaced worker's counts start again from 0)."""
        total: dict[str, int] = {}
        for counts in await self._every("gateway_counts"):
            for key, value in counts.items():
                total[key] = total.get(key, 0) + value
        return total

    async def shutdown(self) -> None:
        await self.transport.close()

    async def _every(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every worker; the values of those that did not die meanwhile."""
        results = await asyncio.gather(*[self.transport.call(i, method, *args) for i in range(self.transport.size)],
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, WorkerLost):
                raise result
        return [r for r in results if not isinstance(r, BaseException)]


class InProcessRollouts:
    """N rollout workers in this process, each engine decoding on a thread of its own.
    None is ever replaced: a worker whose engine fails fails the run."""

    in_process = True
    restarts = 0

    def __init__(self, workers: list[RolloutWorker]) -> None:
        self.workers = workers
        self.size = len(workers)

    async def start(self) -> None:
        await asyncio.gather(*[w.start() for w in self.workers])

    async def call(self, i: int, method: str, *args: Any, **kwargs: Any) -> Any:
        call: Callable[..., Awaitable[T]] = getattr(self.workers[i], method)
        return await call(*args, **kwargs)

    def share(self, weights: Weights, version: int) -> Weights:
        return weights

    async def close(self) -> None:
        for worker in self.workers:
            await worker.shutdown()
