"""The learner as N ranks of one process group (``learner.world_size`` > 1).

:class:`RankWorker` is one rank: it joins the group and serves the learner's calls with a
sharded :class:`~asyncrl.learner.Learner` (``asyncrl/learner/distributed.py``). Every call
goes to every rank, in the same order, because each is a collective: each rank takes its
rows of the step's batch, the gathered weights and the checkpoint's weights come from
rank 0, each rank writes its optimizer shard. Under ``weight_sync.method=collective``
rank 0 is also the weight-sync group's sender: each sync, every rank gathers the full
weights to it and it broadcasts them to the engines (:class:`RankCalls`).

:class:`ShardedLearner` is the ``runtime: local`` handle: N processes of this machine.
All N ranks are child processes, rank 0 included, rather than rank 0 living in the driver:
the driver never blocks inside a collective, so it can always watch the ranks, and when
one raises or dies it kills the rest and fails the run naming that rank and its
traceback, instead of hanging in an all-reduce that will never complete. The cost is
that published weights cross a pipe from rank 0 to the engines (plain pickled bytes:
shared-memory handles would tie the driver's tensors to rank 0's lifetime). The Ray
handle (``ray_runtime.RayShardedLearner``) drives the same :class:`RankWorker` as actors.
"""

from __future__ import annotations

import abc
import asyncio
import multiprocessing
import os
import pickle
import resource
import signal
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import Config, ConfigError
from asyncrl.learner import TrainBatch
from asyncrl.learner.distributed import (
    Sharding,
    default_backend,
    destroy_process_group,
    free_port,
    init_process_group,
    local_bytes,
    rank_device,
)
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.protocol import SyncAddress


class LearnerRankError(RuntimeError):
    """A rank of a sharded learner raised or died; the message names it and holds its traceback."""

    def __init__(self, rank: int, world_size: int, detail: str) -> None:
        super().__init__(f"learner rank {rank} of {world_size} failed:\n{detail}")
        self.rank = rank


class RankCalls(abc.ABC):
    """What both sharded handles do alike, on top of their :meth:`call` (``method`` on
    every rank, in rank order, each rank's value): the weight-sync part of
    ``LearnerHandle``. Under ``weight_sync.method=collective`` learner rank 0 is the
    group's sender (its rank 0); each sync is a call to every rank, since every rank takes
    part in gathering the full weights to rank 0, which then broadcasts them; the other
    ranks return once gathered. Errors name the rank at fault: a rollout worker missing
    from the weight-sync group comes back in rank 0's error, named."""

    @abc.abstractmethod
    async def call(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every rank, in rank order; each rank's return value."""

    async def open_weight_sync(self, receivers: int, bucket_mb: float, timeout_s: float,
                               backend: str) -> SyncAddress:
        return (await self.call("open_weight_sync", receivers, bucket_mb, timeout_s, backend))[0]

    async def connect_weight_sync(self) -> None:
        await self.call("connect_weight_sync")

    async def send_weights(self, version: int) -> None:
        await self.call("send_weights", version)

    async def close_weight_sync(self) -> None:
        await self.call("close_weight_sync")


class RankWorker:
    """One rank. Built cheaply, then :meth:`join` connects it to the others and loads the
    policy (a Ray driver must first ask rank 0 where to meet: :meth:`rendezvous`)."""

    def __init__(self, cfg: Config, *, rank: int, world_size: int, num_threads: int | None = None) -> None:
        self.cfg, self.rank, self.world_size, self.num_threads = cfg, rank, world_size, num_threads
        self.worker: LearnerWorker | None = None
        if num_threads is not None:
            torch.set_num_threads(num_threads)

    def rendezvous(self) -> str:
        """Where the ranks meet: a free port on this machine (called on rank 0)."""
        return f"tcp://127.0.0.1:{free_port()}"

    def join(self, init_method: str, local_rank: int) -> None:
        """Join the process group (when there is more than one rank) and load the policy,
        sharded. ``local_rank``: this rank's index on its machine (its GPU)."""
        sharding = None
        if self.world_size > 1:
            device = rank_device(self.cfg.model.device, local_rank)
            backend = self.cfg.learner.backend or default_backend(device)
            if backend == "nccl" and device.type != "cuda":
                raise ConfigError(f"learner.backend=nccl, but rank {self.rank} has no GPU (device {device})")
            init_process_group(rank=self.rank, world_size=self.world_size, init_method=init_method,
                               backend=backend, timeout_s=self.cfg.learner.timeout_s)
            sharding = Sharding.current(self.cfg.learner.effective_strategy, device)
        self.worker = LearnerWorker(self.cfg, num_threads=self.num_threads, sharding=sharding)

    def leave(self) -> None:
        if self.worker is not None:
            self.worker.close_weight_sync()
        destroy_process_group()

    # weight_sync.method: collective: rank 0 hosts the weight-sync group and sends;
    # every rank gathers (``LearnerWorker.send_weights``)
    def open_weight_sync(self, receivers: int, bucket_mb: float, timeout_s: float, backend: str) -> SyncAddress | None:
        """Rank 0: host the weight-sync group's store; returns where the engines meet it."""
        return self.worker.open_weight_sync(receivers, bucket_mb, timeout_s, backend) if self.rank == 0 else None

    def connect_weight_sync(self) -> None:
        if self.rank == 0:
            self.worker.connect_weight_sync()

    def send_weights(self, version: int) -> None:
        self.worker.send_weights(version)

    def close_weight_sync(self) -> None:
        self.worker.close_weight_sync()

    # ------------------------------------------------ the learner's calls, on every rank
    def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        """Every rank returns the same metrics (reduced over ranks)."""
        return self.worker.train_step(batch, on_policy)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0, ``{}`` elsewhere."""
        return self.worker.export_weights()

    def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path:
        return self.worker.save_checkpoint(path, extra, files)

    def load_checkpoint(self, path: Path) -> int:
        return self.worker.load_checkpoint(path)

    def timed_train_step(self, batch: TrainBatch, on_policy: bool) -> tuple[dict[str, float], float]:
        """A step and its seconds on this rank, from a barrier to the end of the optimizer
        step (what ``asyncrl bench learner`` reports, without the driver's pipe)."""
        sharding = self.worker.learner.sharding
        if sharding is not None:
            sharding.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = self.worker.train_step(batch, on_policy)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return metrics, time.perf_counter() - start

    def memory(self) -> dict[str, Any]:
        """Bytes of parameters, gradients and optimizer state this rank holds (its shards,
        counted exactly), its peak RSS, and on CUDA the allocator's peak."""
        learner = self.worker.learner
        out: dict[str, Any] = {"rank": self.rank, **local_bytes(learner.model, learner.optimizer),
                               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if learner.device.type == "cuda":
            out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(learner.device)
        return out

    def pid(self) -> int:
        return os.getpid()


def _serve(conn: Connection, worker_cls: type[RankWorker], cfg: Config, rank: int, world_size: int,
           init_method: str, num_threads: int | None) -> None:
    """A rank process: join, then run each call the driver sends until ``leave``. Replies
    are ``("ok", value)`` or ``("error", traceback)``; an error leaves this process
    serving (the driver decides). A lost driver ends it: at once when idle (the pipe
    closes), after ``learner.timeout_s`` when waiting in a collective."""

    def reply(status: str, value: Any) -> None:
        conn.send_bytes(pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL))

    # Ctrl-C reaches the whole terminal process group; the driver alone decides what it
    # means (finish the step, checkpoint), so a rank must not die of it mid-collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = worker_cls(cfg, rank=rank, world_size=world_size, num_threads=num_threads)
        worker.join(init_method, local_rank=rank)
    except BaseException:
        reply("error", traceback.format_exc())
        return
    reply("ok", None)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except EOFError:  # the driver is gone
            break
        try:
            value = getattr(worker, method)(*args)
        except BaseException:
            reply("error", traceback.format_exc())
            continue
        reply("ok", value)
        if method == "leave":
            break


class ShardedLearner(RankCalls):
    """The learner handle for ``runtime: local`` with ``learner.world_size`` = N: N rank
    processes, driven in lock-step. Call :meth:`start` before the first call.
    ``worker_cls``: the rank's class (a subclass of :class:`RankWorker`, e.g. a test's)."""

    def __init__(self, cfg: Config, *, num_threads: int | None = None, world_size: int | None = None,
                 worker_cls: type[RankWorker] = RankWorker) -> None:
        self.world_size = world_size or cfg.learner.world_size
        self._check_devices(cfg)
        ctx = multiprocessing.get_context("spawn")  # fork would copy the driver's threads' locks mid-use
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._lock = asyncio.Lock()
        self._failed: LearnerRankError | None = None
        self._in_flight = False  # a call's replies are being read (even if its caller was cancelled)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, worker_cls, cfg, rank, self.world_size, init_method,
                                                    num_threads), name=f"asyncrl-learner-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def _check_devices(self, cfg: Config) -> None:
        cuda = cfg.model.device.startswith("cuda") or (cfg.model.device == "auto" and torch.cuda.is_available())
        if cuda and self.world_size > torch.cuda.device_count():
            raise ConfigError(f"learner.world_size={self.world_size} ranks on CUDA need one GPU each; this machine has "
                              f"{torch.cuda.device_count()}")

    async def start(self) -> None:
        """Wait until every rank has joined the group and loaded its shard."""
        async with self._lock:
            self._in_flight = True
            await asyncio.to_thread(self._replies)

    # --------------------------------------------------------------- the calls
    async def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank, in rank order; returns each rank's value."""
        async with self._lock:
            if self._failed is not None:
                raise self._failed
            payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
            self._in_flight = True
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(payload)
                except OSError:  # its end is gone: the process died
                    self._fail(rank, f"its process is gone (exit code {self.procs[rank].exitcode})")
            return await asyncio.to_thread(self._replies)

    def _replies(self) -> list[Any]:
        """Each rank's reply; the first error or death fails the whole learner at once."""
        try:
            return self._read_replies()
        finally:
            self._in_flight = False

    def _read_replies(self) -> list[Any]:
        values: list[Any] = [None] * self.world_size
        pending = dict(enumerate(self.conns))
        while pending:
            sentinels = {self.procs[rank].sentinel: rank for rank in pending}
            ready = wait([*pending.values(), *sentinels])
            for rank, conn in list(pending.items()):
                if conn not in ready and not conn.poll():
                    continue
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(rank, self._death(rank))
                if status == "error":
                    self._fail(rank, value)
                values[rank] = value
                del pending[rank]
            for sentinel, rank in sentinels.items():  # exited without a reply
                if sentinel in ready and rank in pending and not pending[rank].poll():
                    self._fail(rank, self._death(rank))
        return values

    def _death(self, rank: int) -> str:
        self.procs[rank].join(timeout=5)
        return f"its process exited with code {self.procs[rank].exitcode} without replying"

    def _fail(self, rank: int, detail: str) -> None:
        """Kill every rank (the others may be waiting in a collective for this one) and raise."""
        self._failed = LearnerRankError(rank, self.world_size, detail)
        self._kill()
        raise self._failed

    def _kill(self, grace_s: float = 0.0) -> None:
        """End every rank process, after ``grace_s`` for those already on their way out
        (killed mid-exit, a process leaks the semaphores its libraries made)."""
        for proc in self.procs:
            proc.join(timeout=grace_s)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)

    # ------------------------------------------------------- the LearnerHandle
    async def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        return (await self.call("train_step", batch, on_policy))[0]

    async def publish(self) -> dict[str, torch.Tensor]:
        """Rank 0's gathered full weights (name -> tensor), as an unsharded learner's."""
        return (await self.call("export_weights"))[0]

    async def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path:
        return (await self.call("save_checkpoint", path, extra, files))[0]

    async def load_checkpoint(self, path: Path) -> int:
        return (await self.call("load_checkpoint", path))[0]

    async def shutdown(self) -> None:
        """Leave the process group cleanly when idle; kill whatever is left (at once when
        a call is still under way, e.g. one whose caller was cancelled)."""
        grace = 0.0
        if self._failed is None and not self._in_flight and all(p.is_alive() for p in self.procs):
            try:
                await asyncio.wait_for(self.call("leave"), timeout=30)
                grace = 10.0
            except (LearnerRankError, TimeoutError):
                pass
        await asyncio.to_thread(self._kill, grace)
        for conn in self.conns:
            conn.close()
