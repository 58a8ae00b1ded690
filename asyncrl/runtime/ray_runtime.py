"""``runtime: ray``: rollout workers and the learner as Ray actors; this process keeps
the orchestrator (gate, buffer, loops, logs).

- Each rollout worker is an async actor holding one engine replica
  (:class:`RolloutWorker`); groups go to the least-loaded worker.
- Weights go from the learner to every worker through the object store: the learner
  actor's ``export_weights`` result *is* the one put (the driver never fetches it),
  and each worker gets it when its ``sync_weights`` call runs. The version travels
  with the reference.
- A worker that dies is replaced (loading the latest weights and version) and the
  group it was running is re-issued to a live one; past ``ray.max_worker_restarts``
  replacements the run stops with the last error.

On GPUs the object-store hop (device → host → store → host → device) is the slow part
of a weight sync. The faster path is a NCCL group between the learner and the engines
(vLLM's weight-transfer engines: ``init_weight_transfer_engine`` then ``update_weights``
broadcasting tensor by tensor). The seam is :meth:`RayRollout.sync_weights`: it
receives whatever :meth:`RayLearner.publish` returns, so a NCCL publisher only has to
return a handle the workers' ``sync_weights`` knows how to receive.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from typing import Any

import torch

from asyncrl.config import Config, ConfigError
from asyncrl.engine import EngineClosedError
from asyncrl.evaluation import EvalResult
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.rollout_worker import RolloutWorker
from asyncrl.tasks.base import Task
from asyncrl.types import Episode


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("runtime=ray needs Ray: pip install -e '.[ray]'") from None
    return ray


def start_ray(cfg: Config) -> bool:
    """Connect (or start a local cluster) and refuse a layout the cluster cannot place:
    Ray would otherwise wait forever for resources that never come. True when this call
    started Ray (the run then shuts it down)."""
    ray, r = _ray(), cfg.ray
    started = not ray.is_initialized()
    if started:
        ray.init(address=r.address, num_cpus=r.num_cpus if r.address is None else None, include_dashboard=False,
                 log_to_driver=True, configure_logging=False)
    have = ray.cluster_resources()
    for kind, per_worker, learner in (("CPU", r.worker_cpus, r.learner_cpus), ("GPU", r.worker_gpus, r.learner_gpus)):
        need = r.num_rollout_workers * per_worker + learner
        if need > have.get(kind, 0) + 1e-9:
            if started:
                ray.shutdown()
            raise ConfigError(
                f"ray.num_rollout_workers={r.num_rollout_workers} × ray.worker_{kind.lower()}s={per_worker} + "
                f"ray.learner_{kind.lower()}s={learner} = {need:g} {kind}s, but the Ray cluster has "
                f"{have.get(kind, 0):g}; use fewer workers or smaller requests")
    return started


class RayLearner:
    def __init__(self, cfg: Config) -> None:
        ray, r = _ray(), cfg.ray
        actor = ray.remote(num_cpus=r.learner_cpus, num_gpus=r.learner_gpus)(LearnerWorker)
        self.actor = actor.remote(cfg, num_threads=max(1, int(r.learner_cpus)))

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.actor, method).remote(*args)

    async def publish(self) -> Any:
        """An ObjectRef to the weights, left in the object store (not fetched here)."""
        return self.actor.export_weights.remote()

    async def shutdown(self) -> None:
        _ray().kill(self.actor)


class _WorkerLost(Exception):
    pass


class RayRollout:
    def __init__(self, cfg: Config, *, weights: Any, version: int) -> None:
        ray, r = _ray(), cfg.ray
        self.cfg = cfg
        self._actor = ray.remote(num_cpus=r.worker_cpus, num_gpus=r.worker_gpus)(RolloutWorker)
        self.weights, self.version = weights, version
        self.restarts = 0
        self.workers = [self._spawn(i) for i in range(r.num_rollout_workers)]
        self.load = [0] * len(self.workers)

    def _spawn(self, i: int):
        """A new worker, told to start its engine; calls made meanwhile wait for it."""
        worker = self._actor.remote(self.cfg, weights=self.weights, version=self.version,
                                    seed=self.cfg.seed + 1009 * (i + 1) + 7919 * (self.restarts + self.version),
                                    num_threads=max(1, int(self.cfg.ray.worker_cpus)))
        worker.start.remote()
        return worker

    def _replace(self, i: int, dead: Any, error: BaseException) -> None:
        if self.workers[i] is not dead:  # another caller already replaced it
            return
        self.restarts += 1
        if self.restarts > self.cfg.ray.max_worker_restarts:
            raise RuntimeError(f"rollout workers died {self.restarts} times (ray.max_worker_restarts="
                               f"{self.cfg.ray.max_worker_restarts}); last: {error}") from error
        print(f"asyncrl: rollout worker {i} died ({type(error).__name__}); restarting it with version "
              f"{self.version}", file=sys.stderr)
        self.workers[i] = self._spawn(i)

    async def _call(self, i: int, method: str, *args: Any) -> Any:
        ray, worker = _ray(), self.workers[i]
        try:
            return await getattr(worker, method).remote(*args)
        except ray.exceptions.RayActorError as exc:  # dead, or unreachable: kill it to free its resources
            ray.kill(worker)
            self._replace(i, worker, exc)
            raise _WorkerLost from exc
        except ray.exceptions.RayTaskError as exc:
            if not isinstance(exc.cause, EngineClosedError):
                raise
            ray.kill(worker)  # the process lives on but its engine died: as good as dead
            self._replace(i, worker, exc)
            raise _WorkerLost from exc

    async def run_group(self, task: Task, n: int) -> list[Episode]:
        while True:  # re-issued after a worker death; _replace bounds the attempts
            i = min(range(len(self.workers)), key=self.load.__getitem__)
            self.load[i] += 1
            try:
                return await self._call(i, "run_group", task, n)
            except _WorkerLost:
                continue
            finally:
                self.load[i] -= 1

    async def evaluate(self, tasks: list[Task]) -> EvalResult:

        shards = {i: tasks[i::len(self.workers)] for i in range(len(self.workers))}
        parts: dict[int, EvalResult] = {}
        while todo := [i for i, shard in shards.items() if shard and i not in parts]:
            results = await asyncio.gather(*[self._call(i, "evaluate", shards[i]) for i in todo],
                                           return_exceptions=True)
            for i, result in zip(todo, results):
                if isinstance(result, EvalResult):
                    parts[i] = result
                elif not isinstance(result, _WorkerLost):  # lost shards go round again
                    raise result
        return EvalResult.merge([parts[i] for i in sorted(parts)])

    async def sync_weights(self, weights: Mapping[str, torch.Tensor] | Any, version: int, partial_rollout: str) -> None:

        ray = _ray()
        self.weights = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        self.version = version  # a worker spawned from now on starts from these
        results = await asyncio.gather(
            *[self._call(i, "sync_weights", self.weights, version, partial_rollout) for i in range(len(self.workers))],
            return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, _WorkerLost):
                raise result

    async def busy_s(self) -> float:
        """Mean decode seconds per worker (a replaced worker starts again from 0)."""

        results = await asyncio.gather(*[self._call(i, "busy_s") for i in range(len(self.workers))],
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, _WorkerLost):
                raise result
        busy = [r for r in results if isinstance(r, float)]
        return sum(busy) / max(1, len(busy))

    async def pids(self) -> list[int]:

        return list(await asyncio.gather(*[self._call(i, "pid") for i in range(len(self.workers))]))

    async def shutdown(self) -> None:
        """Let each engine stop cleanly (vLLM has processes of its own), then end the actors."""
        ray = _ray()
        calls = asyncio.gather(*[w.shutdown.remote() for w in self.workers], return_exceptions=True)
        try:
            await asyncio.wait_for(calls, timeout=60)
        except TimeoutError:
            pass
        for worker in self.workers:
            ray.kill(worker)
