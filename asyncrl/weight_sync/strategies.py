"""The trainer's side of weight sync: which method, the order of the calls on the two
handles, and the checks after each sync (the package docstring tells the methods)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from asyncrl.config import Config, WeightSyncConfig
from asyncrl.modes import PartialRollout
from asyncrl.weight_sync.endpoints import (
    close_receiver,
    close_sender,
    connect_sender,
    engine_started,
    join_receiver,
    open_sender,
    receive,
    send,
)
from asyncrl.weight_sync.group import WeightSyncError

T = TypeVar("T")


class LearnerHandle(Protocol):
    """What a sync needs of the learner handle (``runtime/protocol.py`` has the whole one)."""

    async def publish(self) -> Any: ...

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]: ...


class RolloutHandle(Protocol):
    """What a sync needs of the rollout handle."""

    async def sync_weights(self, weights: Any, version: int, mode: PartialRollout) -> list[int]: ...

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]: ...


def resolve_backend(cfg: Config) -> str:
    """``weight_sync.backend``, or nccl where both ends hold GPUs (an engine kind that takes
    tensors in its worker's process), else gloo."""
    if cfg.weight_sync.backend is not None:
        return cfg.weight_sync.backend
    r = cfg.ray
    gpus = cfg.runtime == "ray" and r.learner_gpus > 0 and r.worker_gpus > 0 and cfg.engine_kind.in_process
    return "nccl" if gpus and not cfg.model.device.startswith("cpu") else "gloo"


# ------------------------------------------------------------ the trainer's side
def check_served(version: int, served: list[int]) -> None:
    """Every engine must serve ``version`` after its sync; one that does not is an error
    (its weights and the versions it stamps on tokens would disagree with the gate's)."""
    wrong = [f"rollout worker {i} serves version {v}" for i, v in enumerate(served) if v != version]
    if wrong:
        raise WeightSyncError(f"after the weight sync of version {version}: {'; '.join(wrong)}")


_SENDER_GRACE_S = 5.0


async def _all_or_first_failure(*calls: Awaitable[T]) -> list[T]:
    """Every result, or the first exception as soon as it happens: the sender failing
    (naming a missing rank) must not wait for receivers that wait for that rank.

    The sender (the first call) is preferred: when it fails it drops the store, so a
    receiver's "lost the store" can arrive first (the learner's own error travels through
    its process or actor). A receiver's failure therefore waits up to ``_SENDER_GRACE_S``
    for the sender's, which names the culprit."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if pending and tasks[0] in pending and any(t.exception() is not None for t in done):
            await asyncio.wait([tasks[0]], timeout=_SENDER_GRACE_S)
            done = {t for t in tasks if t.done()}
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()


class WeightSync(Protocol):
    method: str

    async def sync(self, version: int, mode: PartialRollout) -> Any:
        """Every engine serves ``version`` when this returns (``mode``: the effective
        ``partial_rollout``). Returns the published snapshot where there is one, which
        an evaluation replica may load; ``None`` if the weights went another way."""
        ...

    async def close(self) -> None: ...


class ObjectStoreSync:
    """``learner.publish()`` then ``rollout.sync_weights``: a snapshot every engine loads."""

    method = "object_store"

    def __init__(self, learner: LearnerHandle, rollout: RolloutHandle) -> None:
        self.learner, self.rollout = learner, rollout

    async def sync(self, version: int, mode: PartialRollout) -> Any:
        weights = await self.learner.publish()
        check_served(version, await self.rollout.sync_weights(weights, version, mode))
        return weights

    async def close(self) -> None:
        """Nothing held between syncs."""


class CollectiveSync:
    """The learner broadcasts to the engines over a group of their own (see the package
    docstring). :meth:`connect` forms the group; every call checks the versions served."""

    method = "collective"

    def __init__(self, cfg: WeightSyncConfig, learner: LearnerHandle, rollout: RolloutHandle, *,
                 receivers: int, backend: str = "gloo") -> None:
        self.cfg, self.learner, self.rollout = cfg, learner, rollout
        self.receivers, self.backend = receivers, backend
        self.version: int | None = None
        self._opened = False

    async def connect(self) -> None:
        await self.rollout.apply(engine_started)
        addresses = await self.learner.apply(open_sender, self.receivers, self.cfg.bucket_mb, self.cfg.timeout_s,
                                             self.backend)
        self._opened = True
        await _all_or_first_failure(self.learner.apply(connect_sender), self.rollout.apply(join_receiver, addresses[0]))

    async def sync(self, version: int, mode: PartialRollout) -> None:
        if self.version is not None and version <= self.version:
            raise WeightSyncError(f"weight sync of version {version} does not advance past version {self.version}")
        _, served = await _all_or_first_failure(self.learner.apply(send, version),
                                                self.rollout.apply(receive, version, mode))
        check_served(version, served)
        self.version = version

    async def close(self) -> None:
        """Each side drops its group (the learner's store goes with it)."""
        if self._opened:
            self._opened = False
            await asyncio.gather(self.rollout.apply(close_receiver), self.learner.apply(close_sender),
                                 return_exceptions=True)


async def open_weight_sync(cfg: Config, learner: LearnerHandle, rollout: RolloutHandle) -> WeightSync:
    """The configured method, its group formed; the caller closes it. ``runtime: local``
    has nothing to cross (see the package docstring) and uses ``object_store``."""
    if cfg.weight_sync.method == "collective":
        if cfg.runtime != "ray":
            where = ("the engine lives in this process, the learner in it or beside it"
                     if cfg.learner.world_size == 1 else
                     "the engine lives in this process; learner rank 0 publishes the gathered weights to it")
            print(f"asyncrl: weight_sync.method=collective has nothing to cross with runtime=local ({where}): "
                  "weights are copied in memory (object_store)", file=sys.stderr)
        else:
            sync = CollectiveSync(cfg.weight_sync, learner, rollout, receivers=cfg.ray.num_rollout_workers,
                                  backend=resolve_backend(cfg))
            try:
                await sync.connect()
            except BaseException:
                await sync.close()
                raise
            return sync
    return ObjectStoreSync(learner, rollout)
