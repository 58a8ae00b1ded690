"""``runtime: ray``: rollout workers and the learner as Ray actors; this process keeps
the orchestrator (gate, buffer, loops, logs).

- Each rollout worker is an async actor holding one engine replica
  (:class:`RolloutWorker`), reached through :class:`RayRollouts`, the transport under
  the one rollout handle (``rollout_group.py``: groups to the least-loaded worker).
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
from typing import Any, cast

from asyncrl.config import Config, ConfigError
from asyncrl.engine import EngineClosedError
from asyncrl.learner.distributed import free_port
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.protocol import StoredWeights, Weights
from asyncrl.runtime.rollout_group import WorkerLost
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.runtime.transport import LearnerRankError
from asyncrl.seeding import rollout_worker_seed


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

    # not the WeightUpdate of LearnerWorker.publish, on purpose: an actor hands the driver an object-store
    # reference to it (RayActors reads it as one), so the weights never pass through the actor call
    def publish(self) -> StoredWeights | None:  # type: ignore[override]
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
            self._failed = cast(LearnerRankError, failed[0].exception())  # one() raises nothing else
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
            except (LearnerRankError, TimeoutError):  # a rank that cannot leave: its actor is killed just below
                pass
        self._kill()
        remove_placement_group(self.group)


class RayRollouts:
    """The rollout transport on Ray: ``ray.num_rollout_workers`` :class:`RolloutWorker`
    actors; one that dies is killed and replaced (with the latest weights) and the call
    raises :class:`WorkerLost` for the group to send its work round again."""

    in_process = False

    def __init__(self, cfg: Config, *, weights: Any, version: int, eval_replica: bool = False) -> None:
        ray, r = _ray(), cfg.ray
        self.cfg = cfg
        self._actor = ray.remote(num_cpus=r.worker_cpus, num_gpus=r.worker_gpus)(RolloutWorker)
        self.weights, self.version, self.eval_replica = _in_store(weights), version, eval_replica
        self.restarts = 0
        self.workers = [self._spawn(i) for i in range(r.num_rollout_workers)]
        self.size = len(self.workers)

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

    async def call(self, i: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Worker ``i``'s ``method``; a dead worker is replaced and :class:`WorkerLost` raised."""
        ray, worker = _ray(), self.workers[i]
        try:
            return await getattr(worker, method).remote(*args, **kwargs)
        except ray.exceptions.RayActorError as exc:  # dead, or unreachable: kill it to free its resources
            ray.kill(worker)
            self._replace(i, worker, exc)
            raise WorkerLost from exc
        except ray.exceptions.RayTaskError as exc:
            if not isinstance(exc.cause, EngineClosedError):
                raise
            ray.kill(worker)  # the process lives on but its engine died: as good as dead
            self._replace(i, worker, exc)
            raise WorkerLost from exc

    def share(self, weights: Weights, version: int) -> Any:
        """In the object store once; a worker spawned from now on starts from these."""
        self.weights, self.version = _in_store(weights), version
        return self.weights

    async def close(self) -> None:
        """Let each engine stop cleanly (vLLM has processes of its own), then end the actors."""
        ray = _ray()
        calls = asyncio.gather(*[w.shutdown.remote() for w in self.workers], return_exceptions=True)
        try:
            await asyncio.wait_for(calls, timeout=60)
        except TimeoutError:  # an engine that will not stop within 60 s: its actor is killed just below
            pass
        for worker in self.workers:
            ray.kill(worker)
