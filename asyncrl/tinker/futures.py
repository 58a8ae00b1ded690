"""The futures Tinker's SDK polls: every training and sampling call answers at once with a
``request_id`` (an ``UntypedAPIFuture``) and the SDK then posts ``/api/v1/retrieve_future``
until the result is there (``tinker/lib/api_future_impl.py``).

What a poll gets back, in the SDK's shapes:

- still running: ``{"type": "try_again", "request_id", "queue_state": "active"}`` — after a
  long poll of up to :data:`LONG_POLL_S`, so a quick call answers its first poll and a slow one
  costs one request per :data:`LONG_POLL_S`, not a busy loop;
- done: the result, protobuf for ``ForwardBackwardOutput`` and ``SampleResponse`` (the SDK
  takes them only so), JSON for the rest;
- failed: ``{"error": message, "category": "user" | "server"}``, which the SDK raises as
  ``RequestFailedError`` with that category (no retry: it is final);
- an id this server never issued, or one forgotten: 404. The SDK's poll raises it at once, as
  ``ValueError("Error retrieving result: ... status 404 ...")`` whose ``__cause__`` is the
  ``tinker.NotFoundError`` with this server's message (tinker 0.38, ``api_future_impl.py``:
  every status but 400, 402, 408, 410, 429 and 5xx is "fatal" there; no status makes a poll
  raise ``NotFoundError`` itself, and 410 would make the SDK send the call again).

Invariant: a request id names one result for ever (until forgotten, oldest first past
:data:`KEEP`), so a poll repeated after a lost reply reads the same answer.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Awaitable
from typing import Any, Literal

LONG_POLL_S = 10.0
"""How long a poll waits for its result before answering try_again (the SDK waits 45 s)."""
KEEP = 4096
"""Results remembered at most; the oldest finished ones are forgotten first."""


class UserError(ValueError):
    """A request the client got wrong: its future fails with category ``user``."""


class NotFound(LookupError):
    """Something the request names does not exist here (a 404 in the SDK's shape)."""


@dataclass(frozen=True)
class Outcome:
    """A finished request: ``body`` (bytes of ``content_type``) or ``error``."""

    body: bytes | dict[str, Any] | None = None
    content_type: str = "application/json"
    error: str | None = None
    category: Literal["user", "server"] = "user"


class FutureStore:
    """Request id → its outcome, filled by the task that runs the request."""

    def __init__(self) -> None:
        self._futures: OrderedDict[str, asyncio.Future[Outcome]] = OrderedDict()
        self._running: dict[str, tuple[asyncio.Task[None], str | None]] = {}  # request id -> its task, session
        self.boot = uuid.uuid4().hex[:8]
        """This server process's own mark in every request id it issues: an id without it
        was issued before a restart (or by another server), and its work died with that one."""

    def unknown(self, request_id: str) -> str:
        """Why ``request_id`` is not here, in words for the client."""
        parts = request_id.split("-")
        if len(parts) == 3 and parts[1] != self.boot:
            return (f"request {request_id!r} was issued before this server restarted (or by another server) and "
                    "died with it: what it would have done was not kept (training clients live in the server's "
                    "memory). Continue from your last save_state with create_training_client_from_state_with_optimizer")
        return f"no request {request_id!r} on this server (forgotten: the server keeps the latest {KEEP} finished ones)"

    def submit(self, work: Awaitable[Outcome], *, prefix: str = "req", session: str | None = None) -> str:
        """Await ``work`` (a coroutine, or a future of the training thread) in a task: its
        :class:`Outcome`, or what it raises — a :class:`UserError` the client's fault, anything
        else the server's. ``session``: the client session it belongs to (:meth:`cancel_session`).
        Returns the new request id."""
        request_id = f"{prefix}-{self.boot}-{uuid.uuid4().hex}"
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        self._trim()

        async def run() -> None:
            try:
                outcome = await work
            except UserError as exc:
                outcome = Outcome(error=str(exc), category="user")
            except Exception as exc:  # noqa: BLE001 - a server fault, reported in the SDK's shape
                outcome = Outcome(error=f"{type(exc).__name__}: {exc}", category="server")
            if not future.done():
                future.set_result(outcome)

        task = asyncio.get_running_loop().create_task(run())
        self._running[request_id] = (task, session)  # held: the loop keeps only a weak reference
        task.add_done_callback(lambda _: self._running.pop(request_id, None))
        return request_id

    def cancel(self, request_id: str, reason: str) -> bool:
        """Fail an unfinished request with ``reason`` (category ``user``) and stop its work: a
        sample leaves the engine, a training call still queued never runs (one already running
        ends its micro-batches: the training thread is not interrupted). False if it had ended."""
        running, future = self._running.get(request_id), self._futures.get(request_id)
        if running is None or future is None or future.done():
            return False
        future.set_result(Outcome(error=reason, category="user"))
        running[0].cancel()
        return True

    def cancel_session(self, session: str, reason: str) -> list[str]:
        """:meth:`cancel` every unfinished request of ``session``; their ids."""
        mine = [request_id for request_id, (_, owner) in self._running.items() if owner == session]
        return [request_id for request_id in mine if self.cancel(request_id, reason)]

    def cut(self, reason: str) -> list[str]:
        """Fail every request not finished yet with ``reason`` (category ``server``): what a
        stopping server does, so that no poll waits on work that will not finish. Their ids."""
        unfinished = [request_id for request_id, future in self._futures.items() if not future.done()]
        for request_id in unfinished:
            self._futures[request_id].set_result(Outcome(error=reason, category="server"))
        return unfinished

    def known(self, request_id: str) -> bool:
        return request_id in self._futures

    async def retrieve(self, request_id: str, wait_s: float = LONG_POLL_S) -> Outcome | None:
        """The outcome, or ``None`` if it is not there within ``wait_s`` (try again). The id
        must be :meth:`known`."""
        future = self._futures[request_id]
        try:
            return await asyncio.wait_for(asyncio.shield(future), wait_s)
        except asyncio.TimeoutError:
            return None

    def _trim(self) -> None:
        for request_id in list(self._futures)[: max(0, len(self._futures) - KEEP)]:
            if self._futures[request_id].done():
                del self._futures[request_id]


def try_again(request_id: str) -> dict[str, str]:
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}


def failed(outcome: Outcome) -> dict[str, str]:
    return {"error": outcome.error or "failed", "category": outcome.category}
