"""The bridge between worker threads and asyncio: the engine thread and user code that
blocks (reward functions) hand their results to the event loop through here."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
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


async def call_in_thread(fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
    """Call blocking user code off the event loop, with a timeout.

    A daemon thread per call rather than the shared executor: a function that never
    returns is abandoned after the timeout without starving the pool for everyone else.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except Exception as exc:
            settle_threadsafe(loop, done, None, exc)
        else:
            settle_threadsafe(loop, done, result, None)

    threading.Thread(target=target, daemon=True, name=f"asyncrl-call-{getattr(fn, '__name__', 'fn')}").start()
    async with asyncio.timeout(timeout_s):
        return await done
