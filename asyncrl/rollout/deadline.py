"""An episode's deadline over the time it makes no progress, not the time it waits its turn.

``workflow.timeout_s`` is there to catch an episode that is stuck: a reward function or a
tool that hangs, an agent that waits on nothing, an engine that stopped. Under load a
healthy episode spends most of its life in the engine: queued behind up to
``rollout.max_concurrent_episodes`` others, then decoding in a batch whose steps a busy
CPU makes slow. A clock that counted that failed every episode of a run on a loaded
machine, and so did one that counted only the time after admission: on a
machine loaded enough, a reply gets only a few tokens in a whole ``timeout_s`` of service
(docs/design.md, "Measurements behind choices in the code").

So the clock stops while the episode waits for one of its engine calls, as long as that
call makes progress: while it is queued, the engine works (its ``stats.busy_s`` grows,
so the queue moves); once it is served, its tokens keep arriving. A check every
``timeout_s`` asks each open call whether it moved since the last; if none did, that
interval counts after all. So an episode queued behind a moving queue, or decoding
slowly, never times out; one whose engine stopped, or whose call gets no token for a
whole interval, does within two ``timeout_s``. Everything outside engine calls counts:
the workflow's own code, the reward, tools. (An agent that loops on engine calls forever
is bounded by its turn limit, not by this clock.)

Invariants: one timer per deadline (the expiry while the clock runs, the check while it
is stopped); ``used_s + waited_s`` is the time inside, split; the error of an expired
deadline is an :class:`EpisodeTimeout` (a ``TimeoutError``) that says what the episode
waited for, written when it expired, before cancellation unwinds the workflow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType


class EpisodeTimeout(TimeoutError):
    """An episode used its ``workflow.timeout_s``; the message says what it was waiting for."""


class EngineWait:
    """One engine call of the episode: queued until its first token, served after it;
    it moves while queued if the engine works, while served if its tokens arrive."""

    def __init__(self, deadline: EpisodeDeadline, context_tokens: int, progress: Callable[[], float] | None,
                 queue: Callable[[], object] | None) -> None:
        self._deadline, self.context_tokens = deadline, context_tokens
        self.progress, self.queue = progress, queue  # the engine's busy seconds, its queue's snapshot
        self.sent = deadline.now()
        self.admitted: float | None = None  # when its first token came
        self.tokens, self.last_token = 0, self.sent
        self.mark = self._progress()

    def on_tokens(self, ids: list[int]) -> None:
        """The engine's sink (``TokenSink``): the first token ends the wait in the queue."""
        self.tokens += len(ids)
        self.last_token = self._deadline.now()
        if self.admitted is None:
            self.admitted = self.last_token

    def moved(self) -> bool:
        """Whether it made progress since the last time it was asked."""
        mark, self.mark = self.mark, self._progress()
        return self.mark != mark

    def _progress(self) -> tuple[int, float | None]:
        return self.tokens, self.progress() if self.admitted is None and self.progress is not None else None

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
        self.waited_s = 0.0  # not counted: waits for engine calls that made progress
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
        self._arm(self._running_since)
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
            self.waited_s += now - self._stopped_since
            self._stopped_since = now

    def _changed(self) -> None:
        """A wait opened or closed: stop or start the clock, re-arm the timer."""
        if not self._inside or self.reason is not None:
            return
        now = self.now()
        self._settle(now)
        if self._waits and self._running_since is not None:
            self._running_since, self._stopped_since = None, now
        elif not self._waits and self._stopped_since is not None:
            self._stopped_since, self._running_since = None, now
        else:
            return  # no change: the timer stands
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
            moved = [w.moved() for w in self._waits]  # each asked, so each mark is of now
            if not any(moved):  # no call moved for a whole interval: it counts
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
        lines = [f"the episode used its workflow.timeout_s={self.timeout_s:g} s without progress (not counted: "
                 f"{self.waited_s:.1f} s waiting for engine calls that moved: queued at a working engine, "
                 "or receiving tokens)"]
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
                        f"{now - w.last_token:.1f} s ago, none since")
            snapshot = w.queue() if w.queue is not None else None
            lines.append(what + (f"; the engine's queue: {snapshot}" if snapshot is not None else ""))
        return "\n".join(lines)
