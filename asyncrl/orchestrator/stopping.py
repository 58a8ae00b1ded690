"""How a run is asked to stop: a signal, a second signal, or a method call.

A first SIGINT/SIGTERM (or :meth:`StopControl.request`, from any thread or a hook)
asks the run to finish its step, checkpoint and return. A second signal stops waiting
(for a worker that never starts, say) by cancelling the run, which then fails with its
last good checkpoint. Signal handlers go only on the main thread, the only one Python
lets own them: a run in a notebook's thread or an embedding application is stopped by
the method instead. A run without an event loop (``asyncrl sft``) installs the same
handling with :meth:`StopControl.signals`, where a second signal raises
``KeyboardInterrupt``, its way to stop at once.

Neither waits for user code stuck on a thread: such calls are abandoned at their
timeout on daemon threads (``asyncrl/threads.py``), which the exit lists and does not
join. A first signal says at once that it was heard and, if the run is still finishing
after a few seconds, what it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from tqdm import tqdm

from asyncrl.threads import in_user_code, summarize

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STILL_STOPPING_S = 5.0  # a first signal not done by then says what the run still waits for
FIRST_SIGNAL = ("stopping: finishing the step and saving a checkpoint; a second Ctrl-C or SIGTERM stops at once, "
                "without one")
"""What a first signal says at once: what follows (the step, an evaluation, the save) may take a while."""


class StopControl:
    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notice: asyncio.TimerHandle | None = None

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

    async def then(self, call: Callable[[], object]) -> None:
        """``call()`` once a stop is asked (a task beside the run: cancel it when done)."""
        await self.requested.wait()
        call()

    def is_set(self) -> bool:
        return self.requested.is_set()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While the run's main task runs on this event loop: signals (main thread only)."""
        self._loop = loop = asyncio.get_running_loop()
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        main = asyncio.current_task()
        if main is None:
            raise RuntimeError("StopControl.installed() must be entered inside the run's asyncio task")
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, main)
        try:
            yield
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            if self._notice is not None:
                self._notice.cancel()

    @contextlib.contextmanager
    def signals(self, command: str = "asyncrl") -> Iterator[None]:
        """While a run without an event loop runs on this thread: a first SIGINT/SIGTERM
        requests the stop (the run checks :meth:`is_set` at its step's end), a second raises
        ``KeyboardInterrupt`` wherever the run is. Main thread only, as :meth:`installed`;
        the handlers before are put back after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: object) -> None:
            if self.requested.is_set():
                raise KeyboardInterrupt
            tqdm.write(f"{command}: {FIRST_SIGNAL}", file=sys.stderr)
            self.requested.set()

        before = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, old in before.items():
                signal.signal(sig, old)

    def _on_signal(self, main: asyncio.Task) -> None:
        if self.requested.is_set():
            main.cancel("stopped by a second signal")
        else:
            tqdm.write(f"asyncrl: {FIRST_SIGNAL}", file=sys.stderr)
            # a signal handler runs on the loop installed() registered it with
            self._notice = asyncio.get_running_loop().call_later(STILL_STOPPING_S, self._still_stopping)
        self.requested.set()

    def _still_stopping(self) -> None:
        """Why a first signal has not ended the run yet: most often an evaluation whose
        episodes wait on user code until ``workflow.timeout_s``."""
        calls = in_user_code()
        stuck = (f"; {len(calls)} thread{'s' if len(calls) != 1 else ''} in user code: {summarize(calls)}"
                 if calls else "")
        tqdm.write(f"asyncrl: still stopping after {STILL_STOPPING_S:g} s: the step, an evaluation or the "
                   f"checkpoint is not done{stuck}; a second Ctrl-C or SIGTERM stops at once, without a checkpoint",
                   file=sys.stderr)


@contextlib.contextmanager
def first_failure_raised() -> Iterator[None]:
    """Around a task group: its failure raised as the first failure in it that is not a
    cancellation, with its own traceback, not as a group of it and the cancellations it
    caused; a group of cancellations alone is raised as it is."""
    try:
        yield
    except BaseExceptionGroup as group:
        first = next((e for e in _leaves(group) if not isinstance(e, asyncio.CancelledError)), None)
        if first is None:
            raise
        raise first from first.__cause__


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        yield from _leaves(exc) if isinstance(exc, BaseExceptionGroup) else (exc,)
