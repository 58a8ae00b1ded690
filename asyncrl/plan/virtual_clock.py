"""An asyncio event loop whose clock jumps to the next timer instead of waiting for it.

Everything the orchestrator does with time goes through the loop: ``asyncio.sleep``,
``wait_for`` and timeouts schedule timers on ``loop.time()``, and the trainer reads its
clock from ``loop.time()`` too. So a loop whose ``time()`` is a number it advances
itself runs the real gate, buffer and loops unchanged: when nothing is ready, instead of
blocking in ``select`` until the earliest timer, it moves its clock to that timer and
goes on. A simulated hour of cost-model engines and learners takes as long as its
Python takes, not an hour.

Work handed to threads (``run_in_executor``, ``asyncio.to_thread``) takes no simulated
time: while any is under way the loop waits for it for real with the clock stopped, so a
thread's result comes back before any later timer fires — the order a run with
instantaneous threads would see. A loop with nothing ready, no timer and no thread of
its own can only be woken from outside; after ``STUCK_AFTER_S`` of that the simulation
is stuck, and it says so instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

REAL_WAIT_S = 1.0
"""How long one real wait for a thread lasts before the loop looks again (no simulated time passes)."""
STUCK_AFTER_S = 10.0
"""Real seconds with nothing ready, no timer and no thread after which the simulation is declared stuck."""


class SimulationStuck(RuntimeError):
    """Nothing can happen any more: no callback ready, no timer set, no thread working."""


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)  # what is already there (the loop's self-pipe: thread results, signals)
        if events or timeout == 0:
            return events
        if self._loop.threads_working:
            return super().select(REAL_WAIT_S if timeout is None else min(timeout, REAL_WAIT_S))
        if timeout is None:  # only a thread the loop did not start (its own shutdown's) can wake it now
            events = super().select(STUCK_AFTER_S)
            if not events:
                raise SimulationStuck(f"the simulated run is stuck: no task could run, no timer was set and no "
                                      f"thread woke the loop for {STUCK_AFTER_S:g} s (a coroutine waits for "
                                      "something nothing will do)")
            return events
        self._loop.advance(timeout)
        return []


class _FirstComeTimer(asyncio.TimerHandle):
    """Timers due at the same simulated instant fire in the order they were set — as on a
    real clock, where the one set later is due a little later."""

    __slots__ = ("order",)

    def __lt__(self, other: asyncio.TimerHandle) -> bool:
        return (self.when(), self.order) < (other.when(), getattr(other, "order", 0))


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``time()`` starts at 0 and moves only when the loop would otherwise wait."""

    def __init__(self) -> None:
        self._now = 0.0
        self.threads_working = 0
        self._timers_set = itertools.count()
        super().__init__(selector=_JumpingSelector(self))

    def call_at(self, when: float, callback: Callable[..., object], *args: Any,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        """As the base loop's, with the timer ordered by when it was set among equals."""
        self._check_closed()  # type: ignore[attr-defined]
        timer = _FirstComeTimer(when, callback, args, self, context)
        timer.order = next(self._timers_set)
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True
        return timer

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.threads_working += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: asyncio.Future[Any]) -> None:
        self.threads_working -= 1


def run_virtual(main: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """``main`` to completion on a :class:`VirtualClockLoop`; its result and the simulated
    seconds it took."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        result = runner.run(main)
        return result, runner.get_loop().time()
