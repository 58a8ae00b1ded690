"""The training thread every client of ``serve-tinker`` shares, taken in turns.

One thread runs the training calls (one model's weights, one optimizer step at a time), and a
client's calls must run in the order it sent them (``service.py``: arrival order is sequence
order). Across clients nothing is owed to arrival order, and first-come-first-served lets one
client's long queue (the SDK splits a large call into many requests at once) hold every
other client behind all of it. So each client (an *owner*) has its own queue, and the thread
takes one request from each owner that has one, round and round: a client with one request
waits for at most one request of each other client, each bounded by the request budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any


class Turns:
    """One worker thread; :meth:`submit` queues a job under its owner; owners take turns."""

    def __init__(self, name: str) -> None:
        self._queues: OrderedDict[Hashable, deque[tuple[Callable[[], Any], Future[Any]]]] = OrderedDict()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, owner: Hashable, fn: Callable[[], Any]) -> Future[Any]:
        """``fn()`` after ``owner``'s earlier jobs, taking turns with the other owners."""
        future: Future[Any] = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the training thread is shut down")
            self._queues.setdefault(owner, deque()).append((fn, future))
            self._wake.notify()
        return future

    def shutdown(self) -> None:
        """Cancel every queued job and wait for the one running (if any) to end."""
        with self._wake:
            self._closed = True
            queued = [future for queue in self._queues.values() for _, future in queue]
            self._queues.clear()
            self._wake.notify()
        for future in queued:
            future.cancel()
        self._thread.join()

    def _next(self) -> tuple[Callable[[], Any], Future[Any]] | None:
        """The first owner's next job, that owner sent to the back of the round; None: closed."""
        with self._wake:
            while not (self._closed or self._queues):
                self._wake.wait()
            if self._closed:
                return None
            owner, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            del self._queues[owner]
            if queue:
                self._queues[owner] = queue  # re-inserted: last in the round
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future, not swallowed
                future.set_exception(exc)
