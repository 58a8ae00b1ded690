"""The two ends of a collective sync, as functions the handles' generic ``apply`` runs
inside the workers: ``learner.apply(send, v)`` calls ``send(worker, v)`` on every learner
rank, ``rollout.apply(receive, v, mode)`` calls ``receive(worker, i, v, mode)`` on rollout
worker i. The sender or receiver lives in the worker's ``attached`` dict between calls
(the worker closes what is there when it leaves), so neither worker class knows about
weight sync beyond holding it."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import torch

from asyncrl.weight_updates import flatten_update, unflatten_update
from asyncrl.learner import Learner
from asyncrl.weight_sync.buckets import fingerprint
from asyncrl.weight_sync.group import SyncAddress, WeightReceiver, WeightSender, WeightSyncError

SENDER, RECEIVER = "weight_sync.sender", "weight_sync.receiver"


class LearnerEnd(Protocol):
    """What a learner rank's worker offers (``runtime/learner_worker.py``)."""

    rank: int
    learner: Learner
    attached: dict[str, Any]


class RolloutEnd(Protocol):
    """What a rollout worker offers (``asyncrl/rollout/worker.py``)."""

    attached: dict[str, Any]

    async def sync_weights(self, weights: Any, version: int, mode: str) -> list[int]: ...

    async def ready_engine(self) -> Any: ...


# ------------------------------------------------------------ in the learner's ranks
def open_sender(worker: LearnerEnd, receivers: int, bucket_mb: float, timeout_s: float,
                backend: str) -> SyncAddress | None:
    """Rank 0 hosts the group's store and returns where the engines meet it; a sharded
    learner's other ranks only take part in each send's gather (None)."""
    close_sender(worker)
    if worker.rank != 0:
        return None
    device = worker.learner.device if backend == "nccl" else torch.device("cpu")
    sender = WeightSender(receivers=receivers, bucket_mb=bucket_mb, timeout_s=timeout_s, backend=backend,
                          device=device)
    worker.attached[SENDER] = sender
    return sender.address


def connect_sender(worker: LearnerEnd) -> None:
    """Rank 0 waits for every receiver, then forms the group. The layout comes from the
    names, global shapes and dtypes of what the engines load (``Learner.engine_weights``,
    flattened: ``engine.protocol.flatten_update``, whose header, the kind of update, the
    receivers get with the layout; a sharded learner's DTensors report the full tensor's),
    so no gather is needed to plan it."""
    if worker.rank == 0:
        kind, tensors = flatten_update(worker.learner.engine_weights())
        _sender(worker).connect(((name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
                                 for name, p in tensors.items()), kind=kind)


def send(worker: LearnerEnd, version: int) -> None:
    """Broadcast the current weights as ``version``. Sharded, a collective of the
    learner's group: every rank gathers the full weights to rank 0, then rank 0 alone
    sends them; the other ranks return."""
    learner = worker.learner
    if learner.sharding is None:
        _sender(worker).send(version, flatten_update(learner.engine_weights())[1])
        return
    weights = learner.export_weights()
    if learner.is_main:
        _sender(worker).send(version, flatten_update(weights)[1])


def close_sender(worker: LearnerEnd) -> None:
    sender = worker.attached.pop(SENDER, None)
    if sender is not None:
        sender.close()


def _sender(worker: LearnerEnd) -> WeightSender:
    sender = worker.attached.get(SENDER)
    if sender is None:
        raise WeightSyncError("the weight-sync group is not open on the learner (open_sender first)")
    return sender


# ------------------------------------------------------------ in the rollout workers
async def join_receiver(worker: RolloutEnd, index: int, address: SyncAddress) -> None:
    """Rollout worker ``index`` joins the learner's group as rank ``index + 1`` (blocks a
    thread, not the loop, until every rank has joined)."""
    await close_receiver(worker, index)
    receiver = WeightReceiver(address, index + 1)
    worker.attached[RECEIVER] = receiver
    await asyncio.to_thread(receiver.join)


async def engine_started(worker: RolloutEnd, index: int) -> None:
    """Returns once the worker's engine is up: the group forms after that, so a worker
    still loading its model (CPU-bound, beside the others) does not spend the join's timeout."""
    await worker.ready_engine()


async def receive(worker: RolloutEnd, index: int, version: int, mode: str) -> int:
    """Take ``version`` from the broadcast while the engine goes on generating, then load
    it as ``sync_weights`` does (all weights at once, between decode steps, honouring
    ``mode``); returns the version the engine serves."""
    receiver = worker.attached.get(RECEIVER)
    if receiver is None:
        raise WeightSyncError(f"rollout worker {index} has not joined the weight-sync group")
    tensors = await asyncio.to_thread(receiver.receive, version)
    return (await worker.sync_weights(unflatten_update(receiver.kind or ("full",), tensors), version, mode))[0]


async def close_receiver(worker: RolloutEnd, index: int) -> None:
    receiver = worker.attached.pop(RECEIVER, None)
    if receiver is not None:
        receiver.close()


async def served_fingerprint(worker: RolloutEnd, index: int) -> tuple[int, str]:
    """``(version, digest of the engine's weights)``: a pass over every weight, for checks
    (tests, ``asyncrl bench sync``), torch engine only."""
    engine = await worker.ready_engine()
    if not engine.kind.in_process:
        raise NotImplementedError(f"a fingerprint reads the engine's weights in this process; engine="
                                  f"{engine.kind.name} keeps them in {engine.kind.placement} of its own")
    return engine.version, await asyncio.to_thread(fingerprint, engine.model.named_parameters())
