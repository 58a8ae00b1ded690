"""One learner handle over a transport. A transport carries ``call(method, *args)`` to N
:class:`~asyncrl.runtime.learner_worker.LearnerWorker` ranks and gathers their values, in
rank order; :class:`LearnerGroup` turns the orchestrator's calls into transport calls.
Three transports: :class:`InProcess` (one worker here, its calls on a thread),
``RankProcesses`` (N spawned processes: ``rank_processes.py``) and ``RayActors`` (N
actors: ``ray_runtime.py``). Whichever carries them, a rank that raises or dies fails
the whole learner at once, named (:class:`LearnerRankError`): the others may be waiting
for it inside a collective that would never complete.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.engine.protocol import EngineClosedError
from asyncrl.learner import TrainBatch
from asyncrl.runtime.protocol import LearnerRank, Weights
from asyncrl.threads import UserThreads

if TYPE_CHECKING:
    from asyncrl.engine.torch_engine import TorchEngine


class LearnerRankError(RuntimeError):
    """A rank of the learner raised or died; the message names it and holds its traceback."""

    def __init__(self, rank: int, world_size: int, detail: str) -> None:
        super().__init__(f"learner rank {rank} of {world_size} failed:\n{detail}")
        self.rank, self.world_size, self.detail = rank, world_size, detail

    def __reduce__(self) -> tuple[type, tuple[int, int, str]]:
        # Crosses process boundaries (a bench runs each system in a process pool): without
        # this, unpickling calls __init__ with the message alone, and the pool reports a
        # broken process instead of the rank's traceback.
        return (type(self), (self.rank, self.world_size, self.detail))


class Transport(Protocol):
    world_size: int

    async def start(self) -> None:
        """Every rank joined (its group formed, its policy loaded)."""
        ...

    async def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank's worker, in rank order; each rank's value.
        Calls are serialised: the next starts when every rank answered the last."""
        ...

    def describe(self) -> str:
        """Where the learner is now, for a call that hangs: its processes' states, or the
        stack of the thread it runs on."""
        ...

    async def abandon(self, why: str) -> str:
        """End the ranks of a call that hangs (a thread cannot be ended: it is left, and
        the process does not wait for it at exit); says what was done. The learner is
        failed from then on."""
        ...

    async def close(self) -> None:
        """Let every rank leave cleanly when idle, then end them."""
        ...


class LearnerHung(RuntimeError):
    """A learner call ran past its deadline (:class:`CallDeadlines`); the message names the
    call, how long it ran, and the learner's state (its process's, or its thread's stack)."""


class CallDeadlines:
    """How long a learner call may run before it counts as hung: ``floor_s``, or ``factor``
    times the slowest call of the same method so far, whichever is longer — measured, so a
    slow real model is not cut short and a tiny one is not waited on for minutes. Once a stop
    is asked (a first Ctrl-C), a call under way then gets ``stop_grace_s`` from that moment,
    or 2 × its method's slowest, whichever is longer, but never more than it had; calls made
    after it (the stop's checkpoint) keep their own deadline. Pure bookkeeping: the caller
    reads the clock."""

    def __init__(self, floor_s: float = 300.0, factor: float = 10.0, stop_grace_s: float = 30.0) -> None:
        self.floor_s, self.factor, self.stop_grace_s = floor_s, factor, stop_grace_s
        self.slowest: dict[str, float] = {}
        self.stop_asked_at: float | None = None

    def took(self, method: str, seconds: float) -> None:
        self.slowest[method] = max(seconds, self.slowest.get(method, 0.0))

    def deadline(self, method: str, started: float) -> float:
        """When a call of ``method`` started at ``started`` counts as hung."""
        slowest = self.slowest.get(method, 0.0)
        due = started + max(self.floor_s, self.factor * slowest)
        if self.stop_asked_at is not None and started <= self.stop_asked_at:  # under way when it was asked
            due = min(due, self.stop_asked_at + max(self.stop_grace_s, 2 * slowest))
        return due

    def rule(self, method: str) -> str:
        """The deadline in words, with the keys that set it."""
        slowest = self.slowest.get(method)
        measured = (f"{self.factor:g} × the slowest {method} so far ({slowest:.1f} s)" if slowest is not None else
                    f"no {method} had finished yet")
        stop = (f"; a stop was asked, so at most watchdog.learner_stop_grace_s={self.stop_grace_s:g} s after it"
                if self.stop_asked_at is not None else "")
        return f"watchdog.learner_call_s={self.floor_s:g}, or {measured}{stop}"


class LearnerGroup:
    """The :class:`~asyncrl.runtime.protocol.LearnerHandle` for every runtime: each call goes
    to every rank and rank 0's value comes back (every rank returns the same metrics; the
    full weights and the checkpoint's path are rank 0's). Every call is watched: past its
    deadline (:class:`CallDeadlines`) the transport's ranks are ended and
    :class:`LearnerHung` fails the run, naming the call and the learner's state."""

    def __init__(self, transport: Transport, deadlines: CallDeadlines | None = None) -> None:
        self.transport = transport
        self.deadlines = deadlines or CallDeadlines()

    # -- LearnerHandle's calls: each a worker method of the same name on every rank
    async def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        return await self._call("train_step", batch, on_policy)

    async def accumulate(self, batch: TrainBatch, on_policy: bool) -> None:
        return await self._call("accumulate", batch, on_policy)

    async def finish_step(self) -> dict[str, float]:
        return await self._call("finish_step")

    async def publish(self) -> Weights:
        return await self._call("publish")

    async def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path:
        return await self._call("save_checkpoint", path, extra, files)

    async def load_checkpoint(self, path: Path) -> int:
        return await self._call("load_checkpoint", path)

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return await self._call("apply", fn, *args, every_rank=True)

    def stop_soon(self) -> None:
        """A stop was asked: a call under way gets at most the stop's grace from now."""
        self.deadlines.stop_asked_at = time.monotonic()

    async def shutdown(self) -> None:
        await self.transport.close()

    async def _call(self, method: str, *args: Any, every_rank: bool = False) -> Any:
        started = time.monotonic()
        call = asyncio.ensure_future(self.transport.call(method, *args))
        try:
            while True:
                remaining = self.deadlines.deadline(method, started) - time.monotonic()
                if remaining <= 0:
                    break
                # re-read each second: a stop asked meanwhile shortens the deadline
                done, _ = await asyncio.wait({call}, timeout=min(remaining, 1.0))
                if done:
                    values = call.result()
                    self.deadlines.took(method, time.monotonic() - started)
                    return values if every_rank else values[0]
        except BaseException:
            call.cancel()
            raise
        ran = time.monotonic() - started
        state = self.transport.describe()
        call.cancel()
        ended = await self.transport.abandon(f"its {method} was hung")
        raise LearnerHung(f"the learner's {method} had not returned after {ran:.0f} s, past its deadline "
                          f"({self.deadlines.rule(method)}); {state}; {ended}")


class InProcess:
    """One worker in this process: each call runs on a thread, so the event loop keeps
    feeding the engine while the learner computes (torch releases the GIL in its kernels).
    Daemon threads of its own, not asyncio's default pool: a user's loss that never returns
    must not keep the process alive after a second signal (that pool is joined at exit)."""

    world_size = 1
    FINISH_S = 30.0
    """How long :meth:`close` lets a call under way finish, unless a second signal ended the run."""

    def __init__(self, worker: LearnerRank) -> None:
        self.worker = worker
        self._threads = UserThreads(None, name="asyncrl-learner")
        self._engine: TorchEngine | None = None
        self._abandoned = False

    def share_thread(self, engine: TorchEngine) -> None:
        """From now on run the calls on ``engine``'s thread, between its steps (``sync``,
        where the two take turns: ``asyncrl.runtime.one_torch_thread`` says why one thread)."""
        self._engine = engine

    async def start(self) -> None:
        await self.call("join")

    async def call(self, method: str, *args: Any) -> list[Any]:
        fn = getattr(self.worker, method)
        if self._engine is not None:
            try:
                return [await self._engine.call_between_steps(functools.partial(fn, *args))]
            except EngineClosedError:  # the engine is shutting down (or failed): the call never ran
                self._engine = None
        return [await self._threads.call(fn, *args, what=f"learner {method}")]

    async def close(self) -> None:
        """The learner lives and dies with this process; only its idle threads end. A step
        under way when the run ends on an error (a non-finite advantage from the rollout
        side, say) is first let finish, up to :attr:`FINISH_S`: a daemon thread still inside
        torch when the interpreter finalizes is ended mid-C++ and aborts the process
        (SIGABRT, "terminate called without an active exception") instead of letting it exit
        with the run's status. Not while this task is being cancelled (a second signal):
        that exit must not wait for a loss that never returns."""
        task = asyncio.current_task()
        settled = (not self._abandoned and task is not None and not task.cancelling()
                   and await self._threads.settle(self.FINISH_S))
        self._threads.close()
        if settled:
            self.worker.leave()

    def describe(self) -> str:
        if self._engine is not None:
            return f"it runs on the engine's thread, at {_stack(self._engine._thread)}"
        threads = [c.thread for c in self._threads.in_user_code() if c.thread is not None]
        return f"it runs on a thread of this process, at {_stack(threads[-1])}" if threads else \
            "it runs on a thread of this process, not yet started"

    async def abandon(self, why: str) -> str:
        self._abandoned = True
        return "a thread cannot be ended: it is left to itself, and the exit does not wait for it"


def _stack(thread: threading.Thread, depth: int = 3) -> str:
    """Where ``thread`` is now: its innermost ``depth`` frames, innermost first."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "(no frame: the thread has ended)"
    frames = traceback.extract_stack(frame)[-depth:]
    return " <- ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(frames))
