"""How a run is asked to stop: a signal, a second signal, or a method call.

A first SIGINT/SIGTERM (or :meth:`StopControl.request`, from any thread or a hook)
asks the run to finish its step, checkpoint and return. A second signal stops waiting
(for a worker that never starts, say) by cancelling the run, which then fails with its
last good checkpoint. Signal handlers go only on the main thread, the only one Python
lets own them: a run in a notebook's thread or an embedding application is stopped by
the method instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopControl:
    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def request(self) -> None:
        """Safe from any thread, before, during or after the run."""
        with contextlib.suppress(RuntimeError):  # no loop runs in this thread
            if asyncio.get_running_loop() is self._loop:
                self.requested.set()
                return
        if self._loop is None or self._loop.is_closed():
            self.requested.set()
        else:
            self._loop.call_soon_threadsafe(self.requested.set)

    async def wait(self) -> None:
        await self.requested.wait()

    def is_set(self) -> bool:
        return self.requested.is_set()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While the run's main task runs on this event loop: signals (main thread only)."""
        self._loop = asyncio.get_running_loop()
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        main = asyncio.current_task()
        for sig in STOP_SIGNALS:
            self._loop.add_signal_handler(sig, self._on_signal, main)
        try:
            yield
        finally:
            for sig in STOP_SIGNALS:
                self._loop.remove_signal_handler(sig)

    def _on_signal(self, main: asyncio.Task) -> None:
        if self.requested.is_set():
            main.cancel("stopped by a second signal")
        self.requested.set()
