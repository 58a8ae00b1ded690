"""``RankProcesses``: the transport for ``runtime: local`` with ``learner.world_size`` = N
> 1: N spawned processes of this machine, each one :class:`LearnerWorker` rank, driven in
lock-step over pipes.

All N ranks are child processes, rank 0 included, rather than rank 0 living in the driver:
the driver never blocks inside a collective, so it can always watch the ranks, and when
one raises or dies it kills the rest and fails the run naming that rank and its
traceback, instead of hanging in an all-reduce that will never complete. The cost is
that published weights cross from rank 0 to the engines: through one shared-memory block
rank 0 owns, copied out by the driver before the call returns (``shared_weights.py``), so
the driver's tensors never depend on rank 0's lifetime.

With N = 1 this is the learner in a process of its own (``learner.process``), which on the
CPU keeps its Python off the GIL the engine's thread and the event loop share.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from asyncrl.config import Config, ConfigError
from asyncrl.learner.distributed import free_port
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.shared_weights import SharedSnapshot, WeightBlock, WeightReader
from asyncrl.runtime.transport import LearnerRankError


def _context() -> multiprocessing.context.BaseContext:
    """Rank processes forked from a fork server that imported the learner once: a fresh
    interpreter importing torch and transformers takes ~4 s of CPU, paid once per driver
    instead of once per rank process (a test session starts dozens of learners). Not a
    fork of the driver itself: that would copy its threads' locks mid-use."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["asyncrl.runtime.learner_worker"])
    return ctx


def _serve(conn: Connection, worker_cls: type[LearnerWorker], cfg: Config, rank: int, world_size: int,
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
    block = WeightBlock()  # rank 0's published weights (shared_weights.py)
    try:
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except EOFError:  # the driver is gone
                break
            try:
                value = getattr(worker, method)(*args)
                if method == "publish" and value:
                    value = block.write(value)
            except BaseException:
                reply("error", traceback.format_exc())
                continue
            reply("ok", value)
            if method == "leave":
                break
    finally:
        block.close()


class RankProcesses:
    """N rank processes (the module docstring). :meth:`start` before the first call.
    ``worker_cls``: the rank's class (a subclass of :class:`LearnerWorker`, e.g. a test's)."""

    def __init__(self, cfg: Config, *, num_threads: int | None = None, world_size: int | None = None,
                 worker_cls: type[LearnerWorker] = LearnerWorker) -> None:
        self.world_size = world_size or cfg.learner.world_size
        self._check_devices(cfg)
        ctx = _context()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._lock = asyncio.Lock()
        self._failed: LearnerRankError | None = None
        self._in_flight = False  # a call's replies are being read (even if its caller was cancelled)
        self._call: tuple[str, float] | None = None  # the call under way and when it was sent
        self._weights = WeightReader()
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
            self._in_flight, self._call = True, (method, time.monotonic())
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
                if isinstance(value, SharedSnapshot):  # copied out before the next call may rewrite it
                    value = self._weights.read(value)
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

    async def close(self) -> None:
        """Leave the process group cleanly when idle; kill whatever is left (at once when
        a call is still under way, e.g. one whose caller was cancelled)."""
        grace = 0.0
        if self._failed is None and self._in_flight and self._call is not None:  # a stop that could not wait for it
            method, sent = self._call
            print(f"asyncrl: the learner's {method} had not returned after {time.monotonic() - sent:.0f} s; its "
                  f"process{'es' if self.world_size > 1 else ''} killed", file=sys.stderr)
        if self._failed is None and not self._in_flight and all(p.is_alive() for p in self.procs):
            try:
                await asyncio.wait_for(self.call("leave"), timeout=30)
                grace = 10.0
            except (LearnerRankError, TimeoutError):
                pass
        await asyncio.to_thread(self._kill, grace)
        self._weights.close()
        for conn in self.conns:
            conn.close()

