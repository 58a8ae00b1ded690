"""The collective group and its handshake: :class:`WeightSender` (rank 0, in the learner's
process) and :class:`WeightReceiver` (rank i+1, in rollout worker i's), meeting at a
``TCPStore`` the sender hosts. Every wait has a timeout and names who did not answer
(the package docstring tells the protocol)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.weight_sync.buckets import Bucket, pack_bucket, plan_buckets, unpack_bucket


@dataclass(frozen=True)
class SyncAddress:
    """Where a rollout worker meets the learner: the sender's store and what the group is
    made of."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float


class WeightSyncError(RuntimeError):
    """A weight sync that could not complete; the message names the ranks at fault."""


def rank_name(rank: int) -> str:
    return "rank 0 (the learner)" if rank == 0 else f"rank {rank} (rollout worker {rank - 1})"



def _wait_keys(store: dist.Store, keys: Mapping[int, str], timeout_s: float, doing: str) -> None:
    """Wait until every rank's key is set; past ``timeout_s`` raise naming the ranks whose
    key is missing. Polls ``check`` (a round trip each), backing off to 20 ms."""
    deadline, pause, pending = time.monotonic() + timeout_s, 0.0002, dict(keys)
    while True:
        try:
            pending = {rank: key for rank, key in pending.items() if not store.check([key])}
        except dist.DistError as exc:  # the store lives in the learner's process
            raise WeightSyncError(f"lost the weight-sync store hosted by {rank_name(0)} while waiting to "
                                  f"{doing}: {exc}") from exc
        if not pending:
            return
        if time.monotonic() > deadline:
            who = ", ".join(rank_name(r) for r in sorted(pending))
            raise WeightSyncError(f"{who} did not {doing} within weight_sync.timeout_s={timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


_PATIENCE = 2
"""A receiver waits this many timeouts for the learner, which waits one for every receiver:
when a receiver is missing, the learner's error, which names it, comes first."""


def _new_group(store: dist.Store, rank: int, size: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """A standalone group on ``store``: not the default group, which a sharded learner's
    ranks own. Its rendezvous keys live under their own prefix, apart from the handshake."""
    prefixed = dist.PrefixStore("asyncrl-weight-sync-group/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


def node_host() -> str:
    """The address receivers reach this process at: the Ray node's IP in a Ray actor (the
    rollout workers may be on other nodes), loopback otherwise."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # Ray not installed: not in an actor, so this machine's loopback
        pass
    return "127.0.0.1"


class WeightSender:
    """Rank 0, in the learner's process (learner rank 0's, when sharded): hosts the store,
    then broadcasts each version.
    Build it, hand :attr:`address` to the receivers, then :meth:`connect` while they
    :meth:`WeightReceiver.join`."""

    def __init__(self, *, receivers: int, bucket_mb: float, timeout_s: float, backend: str = "gloo",
                 host: str | None = None, device: torch.device | None = None) -> None:
        host = host or node_host()
        self.timeout_s, self.backend = timeout_s, backend
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.device = device if device is not None else torch.device("cuda" if backend == "nccl" else "cpu")
        # port 0: the store binds a free port itself, so no other process can take it meanwhile
        self._store = dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        self.address = SyncAddress(host, self._store.port, receivers + 1, backend, timeout_s)
        self._group: dist.ProcessGroup | None = None
        self._plan: list[Bucket] = []
        self.last_version: int | None = None

    @property
    def receivers(self) -> range:
        return range(1, self.address.world_size)

    def connect(self, named: Iterable[tuple[str, torch.Tensor]], kind: Any = None) -> None:
        """Wait for every receiver to join (naming those that do not), publish the bucket
        layout of ``named`` (what :meth:`send` will send) and ``kind`` (JSON: what the
        tensors are, read back as :attr:`WeightReceiver.kind`), then build the group."""
        self._plan = plan_buckets(named, self.bucket_bytes)
        _wait_keys(self._store, {r: f"join/{r}" for r in self.receivers}, self.timeout_s,
                   "join the weight-sync group")
        self._store.set("kind", json.dumps(kind))
        self._store.set("layout", json.dumps([b.to_json() for b in self._plan]))
        self._group = _new_group(self._store, 0, self.address.world_size, self.backend, self.timeout_s)

    def send(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Broadcast ``tensors`` (the names and shapes given to :meth:`connect`) as ``version``;
        returns once every receiver confirmed it holds all of them."""
        if self._group is None:
            raise WeightSyncError("the weight-sync group is not connected (connect() first)")
        if self.last_version is not None and version <= self.last_version:
            raise WeightSyncError(f"weight sync of version {version} does not advance past version "
                                  f"{self.last_version}, already sent")
        store, receivers = self._store, self.receivers
        _wait_keys(store, {r: f"ready/{version}/{r}" for r in receivers}, self.timeout_s,
                   f"get ready for the weight sync of version {version}")
        store.set(f"send/{version}", "1")
        header = torch.tensor([version, len(self._plan)], dtype=torch.int64, device=self.device)
        try:
            self._group.broadcast(header, 0).wait()
            flat = pack_bucket(self._plan[0], tensors, self.device) if self._plan else None
            for i in range(len(self._plan)):
                work = self._group.broadcast(flat, 0)
                following = pack_bucket(self._plan[i + 1], tensors, self.device) if i + 1 < len(self._plan) else None
                work.wait()  # packing the next bucket overlapped this one's transfer
                flat = following
        except Exception as exc:
            unconfirmed = [r for r in receivers if not store.check([f"done/{version}/{r}"])]
            raise WeightSyncError(f"the broadcast of version {version} failed ({exc}); not confirmed by: "
                                  f"{', '.join(map(rank_name, unconfirmed)) or 'none'}") from exc
        _wait_keys(store, {r: f"done/{version}/{r}" for r in receivers}, self.timeout_s,
                   f"confirm the weights of version {version}")
        for key in [f"send/{version}", *(f"{k}/{version}/{r}" for k in ("ready", "done") for r in receivers)]:
            store.delete_key(key)
        self.last_version = version

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and self.backend == "nccl":
            group.shutdown()


class WeightReceiver:
    """Rank ``rank`` (≥ 1), in a rollout worker's process: joins the learner's group and
    receives each version as a dict of tensors."""

    def __init__(self, address: SyncAddress, rank: int, device: torch.device | None = None) -> None:
        self.address, self.rank = address, rank
        self.device = device if device is not None else torch.device("cuda" if address.backend == "nccl" else "cpu")
        self._store: dist.Store | None = None
        self._group: dist.ProcessGroup | None = None
        self._plan: list[Bucket] = []
        self.kind: Any = None  # what the sender said its tensors are (WeightSender.connect)

    def join(self) -> None:
        """Reach the learner's store, say so, read the layout, build the group (blocks until
        every rank builds it)."""
        a = self.address
        try:
            self._store = dist.TCPStore(a.host, a.port, None, False, timedelta(seconds=a.timeout_s))
        except dist.DistError as exc:
            raise WeightSyncError(f"{rank_name(self.rank)} could not reach the weight-sync store of "
                                  f"{rank_name(0)} at {a.host}:{a.port}: {exc}") from exc
        self._store.set(f"join/{self.rank}", "1")
        _wait_keys(self._store, {0: "layout"}, _PATIENCE * a.timeout_s, "publish the weight-sync layout")
        self._plan = [Bucket.from_json(b) for b in json.loads(self._store.get("layout"))]
        self.kind = json.loads(self._store.get("kind"))  # set before the layout
        self._group = _new_group(self._store, self.rank, a.world_size, a.backend, a.timeout_s)

    def receive(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of ``version``, name -> tensor (views into the received buckets)."""
        if self._group is None or self._store is None:
            raise WeightSyncError(f"{rank_name(self.rank)} has not joined the weight-sync group")
        store, timeout_s = self._store, self.address.timeout_s
        store.set(f"ready/{version}/{self.rank}", "1")
        _wait_keys(store, {0: f"send/{version}"}, _PATIENCE * timeout_s, f"start sending version {version}")
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        weights: dict[str, torch.Tensor] = {}
        try:
            self._group.broadcast(header, 0).wait()
            sent, buckets = (int(x) for x in header.tolist())
            if sent != version or buckets != len(self._plan):
                raise WeightSyncError(f"{rank_name(self.rank)} expected version {version} in {len(self._plan)} "
                                      f"buckets, {rank_name(0)} sent version {sent} in {buckets}")
            for bucket in self._plan:
                flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
                self._group.broadcast(flat, 0).wait()
                weights.update(unpack_bucket(bucket, flat))
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"{rank_name(self.rank)} lost the broadcast of version {version} from "
                                  f"{rank_name(0)}: {exc}") from exc
        store.set(f"done/{version}/{self.rank}", "1")
        return weights

    def close(self) -> None:
        group, self._group, self._store = self._group, None, None
        if group is not None and self.address.backend == "nccl":
            group.shutdown()
