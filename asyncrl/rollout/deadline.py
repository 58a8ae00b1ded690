"""An episode's deadline over the seconds it is served, not the seconds it waits its turn.

``workflow.timeout_s`` is there to catch an episode that is stuck: a reward function or a
tool that hangs, an agent that loops, an engine that stopped. Under load a healthy episode
spends most of its life in the engine's queue, behind up to ``rollout.max_concurrent_episodes``
others; a clock that counted that wait failed every episode of a run on a busy machine
(issue 47). So the clock stops while one of the episode's engine requests waits for its
first token (queued, not yet in the running batch) and runs again when one arrives.
Everything else counts: generation once admitted, the workflow's own code, the reward.

A stopped clock must not hide a stopped engine. While it is stopped, a check every
``timeout_s`` asks whether the engine worked meanwhile (its ``stats.busy_s`` grew); if it
did not, that interval counts after all. So an episode queued behind a moving queue never
times out, and one queued at an engine that does nothing does, within two ``timeout_s``.

Invariants: one timer per deadline (the expiry while the clock runs, the check while it is
stopped); ``used_s + queued_s`` is the time inside, split; the error of an expired deadline
is an :class:`EpisodeTimeout` (a ``TimeoutError``) that says what the episode waited for,
written when it expired, before cancellation unwinds the workflow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType


class EpisodeTimeout(TimeoutError):
    """An episode used its ``workflow.timeout_s``; the message says what it was waiting for."""


class EngineWait:
    """One engine call of the episode: queued until its first token, served after it."""

    def __init__(self, deadline: EpisodeDeadline, context_tokens: int, progress: Callable[[], float] | None,
                 queue: Callable[[], object] | None) -> None:
        self._deadline, self.context_tokens = deadline, context_tokens
        self.progress, self.queue = progress, queue  # the engine's busy seconds, its queue's snapshot
        self.sent = deadline.now()
        self.admitted: float | None = None  # when its first token came
        self.tokens, self.last_token = 0, self.sent
        self.mark = progress() if progress is not None else None

    def on_tokens(self, ids: list[int]) -> None:
        """The engine's sink (``TokenSink``): the first token ends the wait in the queue."""
        self.tokens += len(ids)
        self.last_token = self._deadline.now()
        if self.admitted is None:
            self.admitted = self.last_token
            self._deadline._changed()

    def close(self) -> None:
        """The call returned (or was cancelled)."""
        self._deadline._waits.discard(self)
        self._deadline._changed()


class EpisodeDeadline:
    """``async with deadline:`` around an episode's attempt; the client opens an
    :class:`EngineWait` for each engine call (:meth:`engine_call`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.used_s = 0.0  # counted, up to the last start or stop of the clock
        self.queued_s = 0.0  # not counted: waits for the engine's first token while the engine worked
        self.reason: str | None = None  # set when it expired
        self._waits: set[EngineWait] = set()
        self._running_since: float | None = None  # exactly one of these two is set while inside
        self._stopped_since: float | None = None
        self._inside = False
        self._timeout: asyncio.Timeout | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def now(self) -> float:
        return self._loop.time() if self._loop is not None else asyncio.get_running_loop().time()

    def engine_call(self, context_tokens: int, progress: Callable[[], float] | None = None,
                    queue: Callable[[], object] | None = None) -> EngineWait:
        """Open a wait for one engine call of ``context_tokens``. ``progress``: the engine's
        busy seconds (``RolloutEngine.stats.busy_s``); ``queue``: a snapshot of its queue
        for the error (the built-in engine's ``queue_state``). Close it when the call ends."""
        wait = EngineWait(self, context_tokens, progress, queue)
        self._waits.add(wait)
        self._changed()
        return wait

    async def __aenter__(self) -> EpisodeDeadline:
        self._loop = asyncio.get_running_loop()
        self._timeout = asyncio.timeout(None)  # the canceller; our timer decides when
        await self._timeout.__aenter__()
        self._inside, self._running_since = True, self.now()
        self._changed()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        self._settle(self.now())
        self._inside = False
        if self._timer is not None:
            self._timer.cancel()
        try:
            return await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError as timeout:
            if self.reason is None:
                raise
            raise EpisodeTimeout(self.reason) from timeout

    # ------------------------------------------------------------------ the clock
    def _settle(self, now: float) -> None:
        if self._running_since is not None:
            self.used_s += now - self._running_since
            self._running_since = now
        elif self._stopped_since is not None:
            self.queued_s += now - self._stopped_since
            self._stopped_since = now

    def _changed(self) -> None:
        """A wait opened, got its first token or closed: stop or start the clock, re-arm the timer."""
        if not self._inside or self.reason is not None:
            return
        now = self.now()
        self._settle(now)
        queued = [w for w in self._waits if w.admitted is None]
        if queued and self._running_since is not None:
            self._running_since, self._stopped_since = None, now
        elif not queued and self._stopped_since is not None:
            self._stopped_since, self._running_since = None, now
        self._arm(now)

    def _arm(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        at = now + (self.timeout_s - self.used_s if self._running_since is not None else self.timeout_s)
        self._timer = self._loop.call_at(at, self._fire)

    def _fire(self) -> None:
        if not self._inside or self.reason is not None:
            return
        now = self.now()
        if self._stopped_since is not None:
            queued = [w for w in self._waits if w.admitted is None]
            moved = False
            for w in queued:
                if w.progress is not None:
                    mark, w.mark = w.mark, w.progress()
                    moved = moved or w.mark != mark
            if not moved:  # the engine did nothing for a whole interval: it counts
                self.used_s += now - self._stopped_since
                self._stopped_since = now
        self._settle(now)
        if self.used_s >= self.timeout_s:
            self.reason = self.describe(now)
            self._timeout.reschedule(self._loop.time())  # asyncio.timeout cancels the attempt, next iteration
            return
        self._arm(now)

    # ------------------------------------------------------------ the evidence
    def describe(self, now: float | None = None) -> str:
        """What the episode had used and what it was waiting for."""
        now = self.now() if now is None else now
        lines = [f"the episode used its workflow.timeout_s={self.timeout_s:g} s (time waiting in the engine's "
                 f"queue not counted: {self.queued_s:.1f} s)"]
        if not self._waits:
            lines.append("it was waiting for its own code, not an engine call: the workflow, the reward function, "
                         "a tool or the agent")
        for w in sorted(self._waits, key=lambda w: w.sent):
            if w.admitted is None:
                what = (f"it was waiting for the engine to admit a request of {w.context_tokens} context tokens, "
                        f"sent {now - w.sent:.1f} s ago, while the engine did no work")
            else:
                what = (f"it was waiting for the engine's reply to a request of {w.context_tokens} context tokens: "
                        f"admitted {now - w.admitted:.1f} s ago, {w.tokens} tokens sampled, the last "
                        f"{now - w.last_token:.1f} s ago")
            snapshot = w.queue() if w.queue is not None else None
            lines.append(what + (f"; the engine's queue: {snapshot}" if snapshot is not None else ""))
        return "\n".join(lines)
