"""The bridge between worker threads and asyncio: the engine thread and user code that
blocks (synchronous agents, reward functions) hand their results to the event loop
through here.

Blocking user code runs on :class:`UserThreads`, a pool of daemon threads that a run
owns (the rollout worker makes one, sized from ``rollout.max_concurrent_episodes``),
never on asyncio's default executor: a call that never returns would keep a slot of that
shared pool for good (starving the learner and the engine's shutdown, which use it too),
and both ``asyncio.run`` and ``concurrent.futures`` join their threads at exit, so one
stuck user function made a run unkillable. Here a call that times out (or whose episode
is cancelled) is abandoned: its slot is freed for a new thread, the stuck thread is
tracked (which function, which task, since when) so that the exit can say what it did
not wait for, and being a daemon it never holds the interpreter open.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def settle_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any,
                      error: BaseException | None) -> None:
    """Settle ``future`` on its own loop's thread; a caller whose loop is gone is ignored."""
    with contextlib.suppress(RuntimeError):  # the loop was closed: nobody is waiting
        loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def describe(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a user function (what a config names), else its repr."""
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if name and module else repr(fn)


@dataclass(eq=False)
class UserCall:
    """One call of user code: what it is, for which task, and where it stands."""

    what: str  # "agent mod:run", "reward function mod:fn"
    task_id: str | None
    state: str = "queued"  # queued -> running -> done | abandoned; queued -> dropped
    started: float | None = None  # time.monotonic() when a thread entered the user code
    thread: threading.Thread | None = None

    def summary(self, now: float | None = None) -> str:
        seconds = (now if now is not None else time.monotonic()) - (self.started or 0.0)
        task = f"task {self.task_id}, " if self.task_id is not None else ""
        note = ", abandoned" if self.state == "abandoned" else ""  # timed out, or its episode was cancelled
        return f"{self.what} ({task}{seconds:.0f} s{note})"


class UserThreads:
    """Daemon threads for blocking user code, at most ``size`` calls at once (``None``: no
    limit), threads reused while their calls return.

    Not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined at interpreter
    exit, so one user function that never returns would keep the process alive.
    """

    def __init__(self, size: int | None, *, name: str = "asyncrl-user", max_abandoned: int | None = None) -> None:
        """``max_abandoned``: abandoned threads still stuck beyond which calls are refused
        (an error episode each, which the watchdog judges) rather than each leaking one
        more thread; default 4 × ``size`` (1024 without a size)."""
        if size is not None and size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self.name = size, name
        self.max_abandoned = max_abandoned or (4 * size if size is not None else 1024)
        self._slots = asyncio.Semaphore(size) if size is not None else None
        self._jobs: queue.SimpleQueue[tuple[UserCall, Callable[[], Any], asyncio.AbstractEventLoop,
                                            asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job that no submitted job has claimed yet
        self._started = 0  # threads ever started (their names)
        self._running: set[UserCall] = set()  # in user code, still awaited
        self._abandoned: set[UserCall] = set()  # in user code, given up on (timed out, cancelled)
        self.abandoned_total = 0  # calls given up on while in user code, ever
        self.closed = False
        _POOLS.add(self)

    async def call(self, fn: Callable[..., T], *args: Any, what: str, task_id: str | None = None,
                   timeout_s: float | None = None) -> T:
        """``fn(*args)`` on one of the pool's threads. Past ``timeout_s`` (or when the caller
        is cancelled, by the episode's own timeout say) the call is abandoned: the caller
        gets ``TimeoutError`` (or its cancellation), the slot is free again, and the thread
        is left to finish (or not) on its own, listed by :func:`in_user_code`."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s), self._slot():
            call, done = UserCall(what, task_id), loop.create_future()
            context = contextvars.copy_context()  # as asyncio.to_thread does: the caller's context variables
            self._submit((call, lambda: context.run(fn, *args), loop, done))
            try:
                return await done
            finally:
                if not done.done() or done.cancelled():
                    self._give_up(call)

    @contextlib.asynccontextmanager
    async def _slot(self) -> Any:
        if self._slots is None:
            yield
        else:
            async with self._slots:
                yield

    def in_user_code(self) -> list[UserCall]:
        """Calls whose thread is in user code now, awaited or abandoned, oldest first."""
        with self._lock:
            calls = [*self._running, *self._abandoned]
        return sorted(calls, key=lambda c: c.started or 0.0)

    @property
    def abandoned_now(self) -> int:
        """Abandoned calls still in user code."""
        return len(self._abandoned)

    async def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every call in user code, awaited or abandoned, to
        return; True when none is left."""
        deadline = time.monotonic() + timeout_s
        while self.in_user_code():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def close(self) -> None:
        """Let idle threads end; threads in user code are not waited for (they are daemons)."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._jobs.put(None)

    @contextlib.contextmanager
    def current(self) -> Iterator[UserThreads]:
        """Make this the pool that :func:`call_in_thread` uses in this context (an episode)."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    # -- the threads ------------------------------------------------------------
    def _submit(self, job: tuple[UserCall, Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]]) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError(f"{self.name}: the pool is closed (the run is shutting down)")
            if len(self._abandoned) >= self.max_abandoned:
                oldest = min(self._abandoned, key=lambda c: c.started or 0.0)
                raise RuntimeError(f"{len(self._abandoned)} threads are stuck in user code that ran past its timeout "
                                   f"(the oldest: {oldest.summary()}); no more calls until some return")
            start = self._idle == 0  # each job claims an idle thread, or brings its own
            if start:
                self._started += 1
                number = self._started
            else:
                self._idle -= 1
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._work, name=f"{self.name}-{number}", daemon=True).start()

    def _give_up(self, call: UserCall) -> None:
        with self._lock:
            if call.state == "queued":  # no thread took it yet: none will run it
                call.state = "dropped"
            elif call.state == "running":
                call.state = "abandoned"
                self._running.discard(call)
                self._abandoned.add(call)
                self.abandoned_total += 1
                if call.thread is not None:
                    call.thread.name += " (abandoned)"  # as py-spy and faulthandler show it

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            call, fn, loop, done = job
            with self._lock:
                if call.state == "dropped":
                    if self.closed:
                        return
                    self._idle += 1
                    continue
                call.state, call.started, call.thread = "running", time.monotonic(), threading.current_thread()
                self._running.add(call)
            result, error = None, None
            try:
                result = fn()
            except Exception as exc:
                error = exc
            except BaseException as exc:  # SystemExit in user code: the call's failure, not the run's
                error = RuntimeError(f"{call.what} raised {exc!r}")
            with self._lock:
                abandoned = call.state == "abandoned"
                if abandoned:
                    self._abandoned.discard(call)
                else:
                    call.state = "done"
                    self._running.discard(call)
                    if not self.closed:
                        self._idle += 1
            if not abandoned:
                settle_threadsafe(loop, done, result, error)
            if abandoned or self.closed:  # an abandoned thread's slot went to a new one
                return


_POOLS: weakref.WeakSet[UserThreads] = weakref.WeakSet()
_DEFAULT = UserThreads(None, name="asyncrl-call")  # outside a run's episodes (tests, scripts)
_CURRENT: contextvars.ContextVar[UserThreads | None] = contextvars.ContextVar("asyncrl_user_threads", default=None)


def current_pool() -> UserThreads:
    """The run's pool where an episode runs (:meth:`UserThreads.current`), else a
    process-wide one with no size limit."""
    return _CURRENT.get() or _DEFAULT


async def call_in_thread(fn: Callable[..., T], *args: Any, timeout_s: float | None, what: str | None = None,
                         task_id: str | None = None) -> T:
    """Call blocking user code off the event loop, on the current pool, abandoning it past
    ``timeout_s`` (``None``: only when the caller is cancelled). ``what`` names it in the
    exit's list of stuck threads (default: the function's ``module:qualname``)."""
    return await current_pool().call(fn, *args, what=what or describe(fn), task_id=task_id, timeout_s=timeout_s)


def in_user_code() -> list[UserCall]:
    """Every call in user code now, in every pool of this process, oldest first."""
    calls = [c for pool in list(_POOLS) for c in pool.in_user_code()]
    return sorted(calls, key=lambda c: c.started or 0.0)


def abandoned_total() -> int:
    """Calls abandoned in user code in this process, ever (timed out or cancelled)."""
    return sum(pool.abandoned_total for pool in list(_POOLS))


def summarize(calls: list[UserCall], examples: int = 3) -> str:
    """``calls`` by function: how many, a few of their tasks, the oldest's age, how many
    were abandoned (one call: itself)."""
    now, by_what = time.monotonic(), {}
    for call in sorted(calls, key=lambda c: c.started or 0.0):  # each function's first call is its oldest
        by_what.setdefault(call.what, []).append(call)
    parts = []
    for what, group in by_what.items():
        if len(group) == 1:
            parts.append(group[0].summary(now))
            continue
        tasks = list(dict.fromkeys(c.task_id for c in group if c.task_id is not None))
        shown = ", ".join(tasks[:examples]) + (f" and {len(tasks) - examples} more" if len(tasks) > examples else "")
        abandoned = sum(c.state == "abandoned" for c in group)
        parts.append(f"{what} × {len(group)} (tasks {shown}; the oldest for {now - (group[0].started or now):.0f} s"
                     f"{f', {abandoned} abandoned' if abandoned else ''})")
    return "; ".join(parts)


def stuck_report() -> str | None:
    """One line for the end of a process: the threads in user code it does not wait for."""
    calls = in_user_code()
    if not calls:
        return None
    n = len(calls)
    return f"asyncrl: {n} thread{'s' if n != 1 else ''} still in user code, not waited for: {summarize(calls)}"
