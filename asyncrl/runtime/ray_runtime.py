"""``runtime: ray``: rollout workers and the learner as Ray actors; this process keeps
the orchestrator (gate, buffer, loops, logs).

- Each rollout worker is an async actor holding one engine replica
  (:class:`RolloutWorker`); groups go to the least-loaded worker.
- The learner is ``learner.world_size`` :class:`RayLearnerWorker` actors in one
  placement group (:class:`RayActors`, the transport under the one learner handle),
  one process group between them when there are several.
- Weights go from the learner to every worker through the object store: learner rank 0
  puts them itself (the driver holds only the reference, :class:`StoredWeights`), and
  each worker gets them when its ``sync_weights`` call runs. The version travels with
  the reference.
- A worker that dies is replaced (loading the latest weights and version) and the
  group it was running is re-issued to a live one; past ``ray.max_worker_restarts``
  replacements the run stops with the last error.

On GPUs the object-store hop (device → host → store → host → device) is the slow part
of a weight sync. ``weight_sync.method: collective`` replaces it with a broadcast from the
learner actor (learner rank 0's, when sharded, after every rank gathered the weights to
it) to the workers over a process group of their own (``asyncrl/weight_sync``); the workers
then cannot be replaced mid-run, since the group has a fixed size.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.engine import EngineClosedError
from asyncrl.eval_scoring import EvalResult
from asyncrl.learner.distributed import free_port
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.protocol import StoredWeights, Weights
from asyncrl.runtime.rollout_worker import RolloutWorker
from asyncrl.runtime.transport import LearnerRankError
from asyncrl.seeding import rollout_worker_seed
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
    ranks = cfg.learner.world_size
    for kind, per_worker, learner in (("CPU", r.worker_cpus, r.learner_cpus), ("GPU", r.worker_gpus, r.learner_gpus)):
        need = r.num_rollout_workers * per_worker + ranks * learner
        if need > have.get(kind, 0) + 1e-9:
            if started:
                ray.shutdown()
            learners = f"learner.world_size={ranks} × " if ranks > 1 else ""
            raise ConfigError(
                f"ray.num_rollout_workers={r.num_rollout_workers} × ray.worker_{kind.lower()}s={per_worker} + "
                f"{learners}ray.learner_{kind.lower()}s={learner} = {need:g} {kind}s, but the Ray cluster has "
                f"{have.get(kind, 0):g}; use fewer workers or smaller requests")
    return started


def _in_store(weights: Weights | None) -> Any:
    """The object-store reference of published weights (put now when they are not there
    yet), to pass to actors as a bare reference, which Ray resolves in the actor."""
    if weights is None or isinstance(weights, _ray().ObjectRef):
        return weights
    return weights.ref if isinstance(weights, StoredWeights) else _ray().put(weights)


def stop_ray(started: bool) -> None:
    """Shut Ray down if :func:`start_ray` started it (a cluster we joined stays up)."""
    if started:
        _ray().shutdown()


class RayLearnerWorker(LearnerWorker):
    """A learner rank as a Ray actor: it meets the others at its node's address, and hands
    its gathered weights to the object store itself, so the driver holds a reference, not
    the weights."""

    def rendezvous(self) -> str:
        ray = _ray()
        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def publish(self) -> StoredWeights | None:
        weights = super().publish()
        return StoredWeights(_ray().put(weights)) if self.rank == 0 else None


class RayActors:
    """The transport on Ray: ``learner.world_size`` :class:`RayLearnerWorker` actors, one
    per bundle of a placement group (``PACK``: on as few nodes as possible). With several
    ranks, checkpoints need a directory every rank's node sees."""

    def __init__(self, cfg: Config, *, worker_cls: type[RayLearnerWorker] = RayLearnerWorker) -> None:
        """``worker_cls``: the rank's class (a subclass of :class:`RayLearnerWorker`, e.g. a test's)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, r = _ray(), cfg.ray
        self.world_size = cfg.learner.world_size
        bundle = {k: v for k, v in (("CPU", r.learner_cpus), ("GPU", r.learner_gpus)) if v > 0} or {"CPU": 0.01}
        self.group = placement_group([bundle] * self.world_size, strategy="PACK")
        actor = ray.remote(num_cpus=r.learner_cpus, num_gpus=r.learner_gpus)(worker_cls)
        self.actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                           self.group, placement_group_bundle_index=rank)).remote(
                           cfg, rank=rank, world_size=self.world_size, num_threads=max(1, int(r.learner_cpus)))
                       for rank in range(self.world_size)]
        self._lock = asyncio.Lock()
        self._failed: LearnerRankError | None = None

    async def start(self, timeout_s: float = 300) -> None:
        """Place the group, meet at rank 0's address, load the policy on every rank."""
        try:
            await asyncio.wait_for(self.group.ready(), timeout=timeout_s)
        except TimeoutError:
            raise RuntimeError(f"the learner's placement group ({self.world_size} bundles) was not placed in "
                               f"{timeout_s:g} s; the cluster lacks the resources") from None
        async with self._lock:
            init_method = (await self._all([self.actors[0].rendezvous.remote()]))[0]
            # each actor sees only its own GPU, so its device index is 0
            await self._all([a.join.remote(init_method, 0) for a in self.actors])

    async def _all(self, refs: list[Any]) -> list[Any]:
        """Every rank's result; the first failure kills every rank (the others may be
        waiting for it in a collective) and raises naming it."""
        if self._failed is not None:
            raise self._failed

        async def one(rank: int, ref: Any) -> Any:
            try:
                return await ref
            except Exception as exc:  # RayTaskError carries the rank's traceback; RayActorError its death
                raise LearnerRankError(rank, self.world_size, str(exc)) from exc

        tasks = [asyncio.ensure_future(one(rank, ref)) for rank, ref in enumerate(refs)]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t in done and t.exception() is not None]
        if failed:
            for task in pending:
                task.cancel()
            self._failed = failed[0].exception()
            self._kill()
            raise self._failed
        return [t.result() for t in tasks]

    async def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank; each argument is put once, every rank reads it."""
        async with self._lock:
            if self.world_size > 1:
                args = tuple(_ray().put(a) for a in args)
            return await self._all([getattr(a, method).remote(*args) for a in self.actors])

    def _kill(self) -> None:
        ray = _ray()
        for actor in self.actors:
            ray.kill(actor)

    def describe(self) -> str:
        return f"{self.world_size} Ray actor{'s' if self.world_size > 1 else ''} (ray.util.state can show their stacks)"

    async def abandon(self, why: str) -> str:
        self._failed = LearnerRankError(0, self.world_size, f"{why}; ended by the driver")
        self._kill()
        return f"its actor{'s' if self.world_size > 1 else ''} killed"

    async def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self._failed is None and not self._lock.locked():
            try:
                await asyncio.wait_for(self.call("leave"), timeout=30)
            except (LearnerRankError, TimeoutError):
                pass
        self._kill()
        remove_placement_group(self.group)


class _WorkerLost(Exception):
    pass


class RayRollout:
    """The rollout handle on Ray: ``ray.num_rollout_workers`` :class:`RolloutWorker` actors."""

    def __init__(self, cfg: Config, *, weights: Any, version: int, eval_replica: bool = False) -> None:
        ray, r = _ray(), cfg.ray
        self.cfg = cfg
        self._actor = ray.remote(num_cpus=r.worker_cpus, num_gpus=r.worker_gpus)(RolloutWorker)
        self.weights, self.version, self.eval_replica = _in_store(weights), version, eval_replica
        self.restarts = 0
        self.workers = [self._spawn(i) for i in range(r.num_rollout_workers)]
        self.load = [0] * len(self.workers)

    def _spawn(self, i: int):
        """A new worker, told to start its engine; calls made meanwhile wait for it."""
        worker = self._actor.remote(self.cfg, weights=self.weights, version=self.version,
                                    seed=rollout_worker_seed(self.cfg.seed, i, self.version, self.restarts),
                                    num_threads=max(1, int(self.cfg.ray.worker_cpus)),
                                    eval_replica=self.eval_replica)
        worker.start.remote()
        return worker

    def _replace(self, i: int, dead: Any, error: BaseException) -> None:
        if self.workers[i] is not dead:  # another caller already replaced it
            return
        if self.cfg.weight_sync.method == "collective":  # a weight-sync group has a fixed size
            raise RuntimeError(f"rollout worker {i} died ({error}); with weight_sync.method=collective it cannot be "
                               "replaced mid-run: resume from the last checkpoint (resume=true), or use "
                               "weight_sync.method=object_store, which replaces dead workers") from error
        self.restarts += 1
        if self.restarts > self.cfg.ray.max_worker_restarts:
            raise RuntimeError(f"rollout workers died {self.restarts} times (ray.max_worker_restarts="
                               f"{self.cfg.ray.max_worker_restarts}); last: {error}") from error
        print(f"asyncrl: rollout worker {i} died ({type(error).__name__}); restarting it with version "
              f"{self.version}", file=sys.stderr)
        self.workers[i] = self._spawn(i)

    async def _call(self, i: int, invoke: Callable[[Any], Any]) -> Any:
        """``invoke(actor)`` on worker ``i`` (it returns the ObjectRef of one actor method);
        a dead worker is replaced and ``_WorkerLost`` raised."""
        ray, worker = _ray(), self.workers[i]
        try:
            return await invoke(worker)
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

    async def run_group(self, task: Task, n: int, draw: int = 0,
                        replay: Mapping[int, dict[str, Any]] | None = None) -> list[Episode]:
        while True:  # re-issued after a worker death; _replace bounds the attempts
            i = min(range(len(self.workers)), key=self.load.__getitem__)
            self.load[i] += 1
            try:
                return await self._call(i, lambda w: w.run_group.remote(task, n, draw, replay))
            except _WorkerLost:
                continue
            finally:
                self.load[i] -= 1

    async def evaluate(self, tasks: list[Task], *, version: int, weights: Any = None,
                       on_episode: Callable[[Episode], None] | None = None) -> EvalResult:
        """Shards of ``tasks`` on every worker; a shard lost with its worker goes round
        again. ``on_episode`` sees each shard's episodes when the shard returns."""
        shards = {i: tasks[i::len(self.workers)] for i in range(len(self.workers))}
        parts: dict[int, EvalResult] = {}
        stored = _in_store(weights)

        async def shard(i: int) -> EvalResult:
            result = await self._call(i, lambda w: w.evaluate.remote(shards[i], version, stored))
            for episode in result.episodes if on_episode is not None else ():
                on_episode(episode)
            return result

        while todo := [i for i, part in shards.items() if part and i not in parts]:
            results = await asyncio.gather(*[shard(i) for i in todo], return_exceptions=True)
            for i, result in zip(todo, results):
                if isinstance(result, EvalResult):
                    parts[i] = result
                elif not isinstance(result, _WorkerLost):  # lost shards go round again
                    raise result
        return EvalResult.merge([parts[i] for i in sorted(parts)])

    async def in_flight(self) -> list[dict[str, Any]]:
        """Every live worker's journals (a worker lost meanwhile has none to give)."""
        results = await asyncio.gather(*[self._call(i, lambda w: w.in_flight.remote())
                                         for i in range(len(self.workers))], return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, _WorkerLost):
                raise result
        return [j for result in results if isinstance(result, list) for j in result]

    async def sync_weights(self, weights: Weights, version: int, mode: str) -> list[int]:
        """The version each live worker serves afterwards (a replaced one starts from these)."""
        self.weights = _in_store(weights)
        self.version = version  # a worker spawned from now on starts from these
        results = await asyncio.gather(
            *[self._call(i, lambda w: w.sync_weights.remote(self.weights, version, mode)) for i in range(len(self.workers))],
            return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, _WorkerLost):
                raise result
        return [v for result in results if isinstance(result, list) for v in result]

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, i, *args)`` on every worker i, in the worker's process."""
        parts = await asyncio.gather(*[self._call(i, lambda w, i=i: w.apply.remote(fn, *args, index=i))
                                       for i in range(len(self.workers))])
        return [value for part in parts for value in part]

    async def engine_work(self) -> dict[str, float]:
        """Mean busy and drain seconds per worker (a sync waits for the workers side by side),
        counts summed (a replaced worker starts again from 0)."""
        results = await asyncio.gather(*[self._call(i, lambda w: w.engine_work.remote())
                                         for i in range(len(self.workers))], return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, _WorkerLost):
                raise result
        work = [r for r in results if isinstance(r, dict)]
        total = {key: sum(w[key] for w in work) for key in (work[0] if work else {}) if all(key in w for w in work)}
        return {**total, **{key: total[key] / max(1, len(work)) for key in ("busy_s", "drain_s") if key in total}}

    async def gateway_counts(self) -> dict[str, int]:
        """Summed over the live workers (a replaced worker's counts start again from 0)."""
        results = await asyncio.gather(*[self._call(i, lambda w: w.gateway_counts.remote())
                                         for i in range(len(self.workers))], return_exceptions=True)
        total: dict[str, int] = {}
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, _WorkerLost):
                raise result
            for key, value in (result if isinstance(result, dict) else {}).items():
                total[key] = total.get(key, 0) + value
        return total

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
