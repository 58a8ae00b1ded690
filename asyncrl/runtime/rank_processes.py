"""``RankProcesses``: the transport for ``runtime: local`` with ``learner.world_size`` = N
> 1: N processes of this machine, each one :class:`LearnerWorker` rank, driven in
lock-step over sockets. They come from this driver's fork server (``fork_server.py``:
started as ``python -c``, so the user's ``__main__`` is never run again, and nothing of
it outlives the driver).

All N ranks are child processes, rank 0 included, rather than rank 0 living in the driver:
the driver never blocks inside a collective, so it can always watch the ranks, and when
one raises or dies it kills the rest and fails the run naming that rank and its
traceback, instead of hanging in an all-reduce that will never complete. The cost is
that published weights cross from rank 0 to the engines: through one shared-memory block
rank 0 owns, copied out by the driver before the call returns (``shared_weights.py``), so
the driver's tensors never depend on rank 0's lifetime.

Every way a rank ends is said as what it is, in one line: an error in the rank (its
traceback), its process killed (by which signal), a bus error (shared memory), the fork
server gone (and every rank with it). A driver that goes away ends the ranks quietly.

With N = 1 this is the learner in a process of its own (``learner.process``), which on the
CPU keeps its Python off the GIL the engine's thread and the event loop share.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from asyncrl.config import Config, ConfigError
from asyncrl.learner.distributed import free_port
from asyncrl.runtime.fork_server import ForkedProcess, fork_server
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.shared_weights import BlockUnavailable, SharedSnapshot, WeightBlock, WeightReader
from asyncrl.runtime.transport import LearnerRankError
from asyncrl.core_budget import CoreBudget, ThreadBudget


def _serve_sharing(fd: int, budget_fd: int, rule: CoreBudget, *args: Any) -> None:
    """:func:`_serve`, the rank computing within the core budget it shares with the
    driver's engine (``rollout.thread_sharing: colocated``), whose cell it maps from ``budget_fd``."""
    # args: _serve's parameters from worker_cls to num_threads, so thread_budget is not among them
    _serve(fd, *args, thread_budget=ThreadBudget.attach(rule, budget_fd))  # type: ignore[misc]


def _serve(fd: int, worker_cls: type[LearnerWorker], cfg: Config, rank: int, world_size: int,
           init_method: str, num_threads: int | None, thread_budget: ThreadBudget | None = None) -> None:
    """A rank process: join, then run each call the driver sends until ``leave``. Replies
    are ``("ok", value)`` or ``("error", traceback)``; an error leaves this process
    serving (the driver decides). A lost driver ends it quietly: at once when idle (the
    socket closes), or when the fork server, seeing the driver gone, kills it."""
    conn = Connection(fd)

    def reply(status: str, value: Any) -> None:
        conn.send_bytes(pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        # passed only when set: a test's worker class may not take it
        shares: dict[str, Any] = {} if thread_budget is None else {"thread_budget": thread_budget}
        worker = worker_cls(cfg, rank=rank, world_size=world_size, num_threads=num_threads, **shares)
        worker.join(init_method, local_rank=rank)
    except BaseException:
        _quietly(reply, "error", traceback.format_exc())
        return
    block: WeightBlock | None = WeightBlock()  # rank 0's published weights (shared_weights.py)
    try:
        if not _quietly(reply, "ok", None):
            return
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the driver is gone
                break
            snapshot = None
            try:
                if method == "publish" and block is not None:  # the copy into the block within the core budget too
                    try:
                        value = worker.publish_into(block.write)  # an empty update on the other ranks
                        snapshot = value if isinstance(value, SharedSnapshot) else None
                    except BlockUnavailable as exc:  # the pipe from now on, said once
                        print(f"asyncrl: learner rank {rank}: {exc}; the weights cross the pipe instead (slower)",
                              file=sys.stderr, flush=True)
                        block.close()
                        block = None
                        value = worker.publish()
                else:
                    value = getattr(worker, method)(*args)
            except BaseException:
                if not _quietly(reply, "error", traceback.format_exc()):
                    break
                continue
            if not _quietly(reply, "ok", value):
                break
            if snapshot is not None and snapshot.new and block is not None:
                reduction.send_handle(conn, block.descriptor(), None)
            if method == "leave":
                break
    finally:
        if block is not None:
            block.close()


def _quietly(reply: Any, status: str, value: Any) -> bool:
    """Send a reply; False when the driver is no longer there to read it."""
    try:
        reply(status, value)
    except OSError:
        return False
    return True


class RankProcesses:
    """N rank processes (the module docstring). :meth:`start` before the first call.
    ``worker_cls``: the rank's class (a subclass of :class:`LearnerWorker`, e.g. a test's)."""

    def __init__(self, cfg: Config, *, num_threads: int | None = None, world_size: int | None = None,
                 worker_cls: type[LearnerWorker] = LearnerWorker, thread_budget: ThreadBudget | None = None) -> None:
        """``thread_budget``: the cores the rank shares with this process's engine (one rank)."""
        self.world_size = world_size or cfg.learner.world_size
        self._check_devices(cfg)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[ForkedProcess] = []
        self.conns: list[Connection] = []
        self._lock = asyncio.Lock()
        self._failed: LearnerRankError | None = None
        self._in_flight = False  # a call's replies are being read (even if its caller was cancelled)
        self._call: tuple[str, float] | None = None  # the call under way and when it was sent
        self._cpu_at_call: list[float] = []  # each rank's CPU seconds when it was sent
        self._weights = WeightReader()
        for rank in range(self.world_size):
            parent, child = socket.socketpair()
            try:
                args = (worker_cls, cfg, rank, self.world_size, init_method, num_threads)
                if thread_budget is None:
                    proc = fork_server().fork(_serve, args, [child.fileno()], name=f"asyncrl-rank{rank}")
                else:
                    proc = fork_server().fork(_serve_sharing, (thread_budget.rule, *args),
                                              [child.fileno(), thread_budget.fd], name=f"asyncrl-rank{rank}")
            except BaseException:
                parent.close()
                self._kill()
                raise
            finally:
                child.close()
            self.procs.append(proc)
            self.conns.append(Connection(parent.detach()))

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
            self._cpu_at_call = [process_state(p.pid)[1] for p in self.procs]
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(payload)
                except OSError:  # its end is gone: the process died
                    self.procs[rank].join(timeout=5)
                    self._fail(rank, exit_cause(self.procs[rank]))
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
                    if value.new:
                        self._weights.attach(value, reduction.recv_handle(conn))
                    value = self._weights.read(value)
                values[rank] = value
                del pending[rank]
            for sentinel, rank in sentinels.items():  # exited without a reply
                if sentinel in ready and rank in pending and not pending[rank].poll():
                    self._fail(rank, self._death(rank))
        return values

    def _death(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=5)
        return f"{exit_cause(proc)} without replying"

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

    def describe(self) -> str:
        since = " since the call began" if self._call is not None else ""
        ranks = []
        for rank, proc in enumerate(self.procs):
            state, cpu = process_state(proc.pid)
            used = cpu - self._cpu_at_call[rank] if rank < len(self._cpu_at_call) else cpu
            ranks.append(f"rank {rank} (pid {proc.pid}) {state}, {used:.1f} s of CPU{since}")
        return "; ".join(ranks)

    async def abandon(self, why: str) -> str:
        detail = f"{why}; ended by the driver"
        self._failed = LearnerRankError(0, self.world_size, detail)
        await asyncio.to_thread(self._kill)
        return f"its process{'es' if self.world_size > 1 else ''} killed"

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
            except (LearnerRankError, TimeoutError):  # a rank that cannot leave is killed at once (grace 0):
                pass  # the run is ending either way, and a failed call already said what failed
        await asyncio.to_thread(self._kill, grace)
        self._weights.close()
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.close()



def exit_cause(proc: ForkedProcess) -> str:
    """How a rank process ended, said as what it is."""
    if proc.server_gone:
        return "the learner's fork server died, and its process with it"
    code = proc.exitcode
    if code is None:
        return "its process is still running"
    if code >= 0:
        return f"its process exited with code {code}"
    sig = signal.Signals(-code)
    if sig == signal.SIGBUS:
        return ("its process died of a bus error (SIGBUS): memory it had mapped could not be backed — most often "
                "shared memory (/dev/shm) or RAM running out")
    return f"its process was killed by {sig.name}"


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait (disk or device)", "T": "stopped (SIGSTOP)",
           "t": "stopped by a debugger", "Z": "a zombie (exited, not reaped)", "X": "dead"}


def process_state(pid: int) -> tuple[str, float]:
    """A process's state in words and its CPU seconds so far, from ``/proc`` (Linux);
    ``("gone", 0)`` when it is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return "gone", 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return _STATES.get(fields[0], fields[0]), (int(fields[11]) + int(fields[12])) / ticks
