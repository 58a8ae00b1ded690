"""The engine's decisions, on plain records: who is admitted, who decodes, who is done.

A step of the built-in engine is schedule → run → postprocess (nano-vllm's shape). This
module is the first and the last of the three: it picks the rows a step samples for and
books what they sampled, and it never sees a tensor, so every rule here (admission up to
the batch size, prefill before decode, stop token, length, abort at a pause, a cancelled
caller) is testable without a model (tests/test_engine_scheduler.py). ``running`` is kept
in the order of the KV batch's rows (``kv_batch.KVBatch``): newcomers join at the end and
``remove_finished`` tells the batch which rows stay.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from asyncrl.types import FinishReason, SamplingParams


@dataclass(eq=False)  # identity: two requests with the same prompt are two sequences
class Sequence:
    """One request's progress: what it asked for and what it has sampled so far."""

    id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights that sampled each token
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class QueueState:
    """What the engine's queue holds, as an episode's deadline error quotes it."""

    waiting: int  # for a row of the running batch
    running: int
    oldest_wait_s: float  # of the waiting ones
    paused: bool  # between a weight sync's pause and its resume

    def __str__(self) -> str:
        return (f"{self.waiting} requests waiting for a row (the oldest for {self.oldest_wait_s:.1f} s), "
                f"{self.running} running" + (", paused for a weight sync" if self.paused else ""))


@dataclass(frozen=True)
class ScheduledStep:
    """What one step runs: a prefill of ``sequences`` (newcomers) or a decode of them (every
    running row). Either way each of them samples one token, in this order."""

    sequences: list[Sequence]
    is_prefill: bool


class Scheduler:
    """Admission and completion for the continuous batch.

    Prefill comes first: while there are waiting sequences and free rows, a step admits as
    many as fit (all in one prefill, so a group's samples can share it) and decodes nothing;
    otherwise it decodes every running row. A sequence ends on a stop token (kept), on its
    ``max_tokens`` or when the model's context is full."""

    def __init__(self, max_batch_size: int, max_positions: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_positions = max_positions
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # rebound, never mutated: a step's list stays as it was
        self.paused = False
        self.admitting = True  # False while pause("wait") lets the running rows finish

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return not self.paused and ((self.admitting and bool(self.waiting)) or bool(self.running))

    def schedule(self) -> ScheduledStep:
        """The next step; call only when ``has_work()``."""
        room = self.max_batch_size - len(self.running)
        if self.admitting and self.waiting and room > 0:
            newcomers = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            self.running = self.running + newcomers  # their rows join the batch at the end
            return ScheduledStep(newcomers, is_prefill=True)
        return ScheduledStep(self.running, is_prefill=False)

    def postprocess(self, sequences: list[Sequence], token_ids: list[int], logprobs: list[float],
                    version: int) -> list[Sequence]:
        """Book one sampled token per sequence; returns those it finished, in order. Their
        rows stay in ``running`` until ``remove_finished``."""
        finished = []
        for seq, token, logprob in zip(sequences, token_ids, logprobs):
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if token in seq.sampling.stop_token_ids:
                seq.finish_reason = "stop"
            elif (len(seq.token_ids) >= seq.sampling.max_tokens
                  or len(seq.prompt_ids) + len(seq.token_ids) >= self.max_positions):
                seq.finish_reason = "length"
            else:
                continue
            finished.append(seq)
        return finished

    def remove_finished(self) -> list[int]:
        """Drop finished sequences from ``running``; returns the rows that stay, as indices
        into the running rows before the call (what the KV batch keeps)."""
        keep = [i for i, seq in enumerate(self.running) if not seq.finished]
        if len(keep) < len(self.running):
            self.running = [self.running[i] for i in keep]
        return keep

    def cancel(self, seq: Sequence) -> bool:
        """Its caller gave up: forget it if it waits; if it runs, end it (reason ``abort``,
        delivered to nobody). True when it held a row, which ``remove_finished`` then frees."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return False
        if seq in self.running and not seq.finished:
            seq.finish_reason = "abort"
            return True
        return False

    # ------------------------------------------------------------------ pauses
    def pause(self) -> None:
        """Stop between two steps; the running rows keep their place (and their KV cache)."""
        self.paused, self.admitting = True, True

    def resume(self) -> None:
        self.paused = False

    def stop_admitting(self) -> None:
        """``pause("wait")``'s first half: the running rows go on until they finish, nothing
        new joins, so the pause lands with no sequence spanning two weight versions."""
        self.admitting = False

    def abort_running(self) -> list[Sequence]:
        """``pause("abort")``: every running sequence ends now with its partial tokens (the
        client resubmits prompt + partial). Waiting ones stay queued: they sampled nothing."""
        aborted, self.running = self.running, []
        for seq in aborted:
            seq.finish_reason = "abort"
        return aborted

    def clear(self) -> None:
        self.waiting.clear()
        self.running = []
