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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.engine.protocol import EngineClosedError
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.protocol import LEARNER_CALLS, LearnerHandle
from asyncrl.threads import UserThreads

if TYPE_CHECKING:
    from asyncrl.engine.torch_engine import TorchEngine


class LearnerRankError(RuntimeError):
    """A rank of the learner raised or died; the message names it and holds its traceback."""

    def __init__(self, rank: int, world_size: int, detail: str) -> None:
        super().__init__(f"learner rank {rank} of {world_size} failed:\n{detail}")
        self.rank = rank


class Transport(Protocol):
    world_size: int

    async def start(self) -> None:
        """Every rank joined (its group formed, its policy loaded)."""
        ...

    async def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank's worker, in rank order; each rank's value.
        Calls are serialised: the next starts when every rank answered the last."""
        ...

    async def close(self) -> None:
        """Let every rank leave cleanly when idle, then end them."""
        ...


def _forward(name: str) -> Callable[..., Any]:
    async def call(self: LearnerGroup, *args: Any) -> Any:
        return (await self.transport.call(name, *args))[0]

    call.__name__ = call.__qualname__ = name
    call.__doc__ = getattr(LearnerHandle, name).__doc__
    return call


class LearnerGroup:
    """The :class:`~asyncrl.runtime.protocol.LearnerHandle` for every runtime: each call in
    ``LEARNER_CALLS`` goes to every rank and rank 0's value comes back (every rank
    returns the same metrics; the full weights and the checkpoint's path are rank 0's)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return await self.transport.call("apply", fn, *args)

    async def shutdown(self) -> None:
        await self.transport.close()


for _name in LEARNER_CALLS:
    setattr(LearnerGroup, _name, _forward(_name))


class InProcess:
    """One worker in this process: each call runs on a thread, so the event loop keeps
    feeding the engine while the learner computes (torch releases the GIL in its kernels).
    Daemon threads of its own, not asyncio's default pool: a user's loss that never returns
    must not keep the process alive after a second signal (that pool is joined at exit)."""

    world_size = 1
    FINISH_S = 30.0
    """How long :meth:`close` lets a call under way finish, unless a second signal ended the run."""

    def __init__(self, worker: LearnerWorker) -> None:
        self.worker = worker
        self._threads = UserThreads(None, name="asyncrl-learner")
        self._engine: TorchEngine | None = None

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
        settled = task is not None and not task.cancelling() and await self._threads.settle(self.FINISH_S)
        self._threads.close()
        if settled:
            self.worker.leave()
