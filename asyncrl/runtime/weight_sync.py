"""Weight sync: how a new version's weights get from the learner to the rollout engines.

Two methods (``weight_sync.method``), one interface for the trainer (:class:`WeightSync`):

- ``object_store`` (:class:`ObjectStoreSync`): ``learner.publish()`` exports a snapshot and
  ``rollout.sync_weights`` has every engine load it (on Ray: one put, one get per worker).
- ``collective`` (:class:`CollectiveSync`): the learner broadcasts its parameters to every
  rollout worker through a ``torch.distributed`` process group of their own — learner =
  rank 0, rollout worker i = rank i+1 — built from a ``TCPStore`` the learner hosts on a
  free port. Not the default process group: a sharded learner's ranks own that one.
  With ``learner.world_size`` > 1, learner rank 0 is the group's rank 0: on each sync
  every learner rank gathers the full weights to it (a collective of the learner's own
  group, ``LearnerWorker.send_weights``), then it alone broadcasts them.

A collective sync moves the bytes once, device to device where the backend allows (nccl),
instead of through the object store's serialise-put-get-deserialise. Parameters of one
dtype are packed into flat buckets of ``bucket_mb`` (one broadcast each, the next packed
while the previous is on the wire); the receivers read the bucket layout once, from the
store, and unpack them into views. The version travels in a header broadcast first.

Nothing may hang silently, so every wait has ``weight_sync.timeout_s`` and names who did
not answer. The store carries a handshake beside the group:

- forming the group: each receiver sets ``join/<rank>``; the learner waits for all of them
  (:class:`WeightSyncError` naming the ranks missing), then publishes the layout, and only
  then do all build the group (gloo's own rendezvous would time out without names);
- each sync of version v: each receiver sets ``ready/v/<rank>``, the learner waits for all,
  sets ``send/v`` and broadcasts; each receiver sets ``done/v/<rank>`` once it holds every
  bucket and the learner waits for those too. A receiver waiting for ``send/v`` names the
  learner if it never comes;
- afterwards each engine reports the version it serves and :func:`check_served` turns one
  that is not v into an error naming the worker, for both methods.

A receiver takes the bytes while its engine goes on generating, then swaps all weights at
once between two decode steps (``RolloutWorker.receive_weights``, which honours
``partial_rollout`` as ``sync_weights`` does), so no token comes from a half-loaded model.
vLLM takes them through its own ``update_weights`` (``reload_weights`` in its workers), as
with ``object_store``: the collective replaces the learner-to-worker hop, not vLLM's
load. ``runtime: local`` keeps the engine in the driver's process, with the learner
(or beside a sharded learner's rank processes, whose rank 0 publishes the gathered
weights), where a collective would copy through a socket what can be copied in memory:
it uses ``object_store`` and says so once. A dead rollout worker cannot be replaced under ``collective`` (the group has
a fixed size): the run stops naming it, and ``resume=true`` starts a fresh group.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from asyncrl.config import Config, WeightSyncConfig
from asyncrl.runtime.protocol import LearnerHandle, RolloutHandle, SyncAddress, Weights

T = TypeVar("T")


class WeightSyncError(RuntimeError):
    """A weight sync that could not complete; the message names the ranks at fault."""


def rank_name(rank: int) -> str:
    return "rank 0 (the learner)" if rank == 0 else f"rank {rank} (rollout worker {rank - 1})"


# ------------------------------------------------------------------------ buckets
@dataclass(frozen=True)
class Bucket:
    """Parameters packed back to back into one flat tensor of ``dtype``."""

    dtype: torch.dtype
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "names": self.names, "shapes": self.shapes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Bucket:
        return cls(getattr(torch, d["dtype"]), tuple(d["names"]), tuple(tuple(s) for s in d["shapes"]))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Group tensors by dtype (a flat bucket has one), in order, each bucket at most
    ``bucket_bytes``; a tensor larger than that goes alone rather than being split."""
    open_: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    size: dict[torch.dtype, int] = {}
    buckets: list[Bucket] = []

    def close(dtype: torch.dtype) -> None:
        entries = open_.pop(dtype, [])
        size.pop(dtype, None)
        if entries:
            buckets.append(Bucket(dtype, tuple(n for n, _ in entries), tuple(s for _, s in entries)))

    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if open_.get(tensor.dtype) and size[tensor.dtype] + nbytes > bucket_bytes:
            close(tensor.dtype)
        open_.setdefault(tensor.dtype, []).append((name, tuple(tensor.shape)))
        size[tensor.dtype] = size.get(tensor.dtype, 0) + nbytes
    for dtype in list(open_):
        close(dtype)
    return buckets


def pack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat tensor on ``device`` holding ``bucket``'s tensors back to back."""
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    offset = 0
    with torch.no_grad():
        for name, shape in zip(bucket.names, bucket.shapes):
            n = _numel(shape)
            flat[offset:offset + n].copy_(tensors[name].detach().reshape(-1))
            offset += n
    return flat


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into ``flat``, one per tensor of ``bucket`` (no copy)."""
    out, offset = {}, 0
    for name, shape in zip(bucket.names, bucket.shapes):
        n = _numel(shape)
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of names and exact bytes, to check two copies of the weights are equal
    without moving them (tests, ``bench sync``): a full pass over the weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        t = tensor.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ------------------------------------------------------------------------ the group
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
    except ImportError:
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

    def connect(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Wait for every receiver to join (naming those that do not), publish the bucket
        layout of ``named`` (what :meth:`send` will send), then build the group."""
        self._plan = plan_buckets(named, self.bucket_bytes)
        _wait_keys(self._store, {r: f"join/{r}" for r in self.receivers}, self.timeout_s,
                   "join the weight-sync group")
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


def resolve_backend(cfg: Config) -> str:
    """``weight_sync.backend``, or nccl where both ends hold GPUs (torch engine), else gloo."""
    if cfg.weight_sync.backend is not None:
        return cfg.weight_sync.backend
    r = cfg.ray
    gpus = cfg.runtime == "ray" and r.learner_gpus > 0 and r.worker_gpus > 0 and cfg.engine == "torch"
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

    async def sync(self, version: int, mode: str) -> Weights | None:
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

    async def sync(self, version: int, mode: str) -> Weights:
        weights = await self.learner.publish()
        check_served(version, await self.rollout.sync_weights(weights, version, mode))
        return weights

    async def close(self) -> None:
        """Nothing held between syncs."""


class CollectiveSync:
    """The learner broadcasts to the engines over a group of their own (see the module
    docstring). :meth:`connect` forms the group; every call checks the versions served."""

    method = "collective"

    def __init__(self, cfg: WeightSyncConfig, learner: LearnerHandle, rollout: RolloutHandle, *,
                 receivers: int, backend: str = "gloo") -> None:
        self.cfg, self.learner, self.rollout = cfg, learner, rollout
        self.receivers, self.backend = receivers, backend
        self.version: int | None = None
        self._opened = False

    async def connect(self) -> None:
        address = await self.learner.open_weight_sync(self.receivers, self.cfg.bucket_mb, self.cfg.timeout_s,
                                                      self.backend)
        self._opened = True
        await _all_or_first_failure(self.learner.connect_weight_sync(), self.rollout.join_weight_sync(address))

    async def sync(self, version: int, mode: str) -> None:
        if self.version is not None and version <= self.version:
            raise WeightSyncError(f"weight sync of version {version} does not advance past version {self.version}")
        _, served = await _all_or_first_failure(self.learner.send_weights(version),
                                                self.rollout.receive_weights(version, mode))
        check_served(version, served)
        self.version = version

    async def close(self) -> None:
        """Each side drops its group (the learner's store goes with it)."""
        if self._opened:
            self._opened = False
            await asyncio.gather(self.rollout.leave_weight_sync(), self.learner.close_weight_sync(),
                                 return_exceptions=True)


async def open_weight_sync(cfg: Config, learner: LearnerHandle, rollout: RolloutHandle) -> WeightSync:
    """The configured method, its group formed; the caller closes it. ``runtime: local``
    has nothing to cross (see the module docstring) and uses ``object_store``."""
    if cfg.weight_sync.method == "collective":
        if cfg.runtime != "ray":
            where = ("the engine shares the learner's process" if cfg.learner.world_size == 1 else
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
