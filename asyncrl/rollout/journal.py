"""An episode's generation so far, kept so that a restart continues it instead of
sampling it again.

The client (``client.py``) records every completion it asks the engine for in the
episode's :class:`Journal`: the context it sent, the tokens that came back with their
behaviour logprobs and versions, and how the sequence ended, or that it had not ended
yet. A checkpoint saves the journals of the training episodes in flight
(``in_flight.jsonl``, written by the trainer); after a restart the same episode (task,
draw, sample, attempt) runs its workflow again with the journal to replay:

- a call whose context is the recorded one gets the recorded completion, without the
  engine, the tokens keeping the versions and logprobs they were sampled with;
- the call the checkpoint cut off continues from its partial tokens through the usual
  abort/resume path. Sampling is seeded per position (``engine/sampling.py``), so the
  tokens it samples next are those the run would have sampled uninterrupted, given the
  same weights;
- a workflow that asks for something else than it did (a user's agent that is not
  deterministic, a tool whose answer changed) ends the replay at that call: from there
  the episode samples afresh, and :attr:`Journal.diverged` says so.

Everything here is plain data and a cursor; no engine, no asyncio.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from asyncrl.types import Completion


class EpisodeKey(NamedTuple):
    """Which episode a journal belongs to: its seed's coordinates (``seeding.py``)."""

    task_id: str
    draw: int
    sample: int
    attempt: int


@dataclass
class Segment:
    """One completion: ``context`` sent, what came back. ``finish_reason`` None: cut off
    (by a checkpoint or a restart), to be continued."""

    context: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_resumes: int = 0

    def extend(self, part: Completion) -> None:
        self.token_ids += part.token_ids
        self.logprobs += part.logprobs
        self.versions += part.versions


@dataclass
class Journal:
    key: EpisodeKey
    segments: list[Segment] = field(default_factory=list)
    replay: list[Segment] = field(default_factory=list)  # recorded before the restart, not yet replayed
    replayed_tokens: int = 0  # tokens taken from the replay instead of the engine
    diverged: bool = False  # the workflow asked for another context than the one recorded
    calls_sent: int = 0  # engine calls made and returned: what a checkpoint waits on (``parked``)
    calls_returned: int = 0

    def begin(self, context: list[int]) -> Segment:
        """The segment for a completion of ``context``: the next recorded one when it was
        asked for this context (finished, or its partial tokens to continue from), else a
        new, empty one; a mismatch ends the replay."""
        recorded = None
        if self.replay:
            if self.replay[0].context == context:
                recorded = self.replay.pop(0)
                self.replayed_tokens += len(recorded.token_ids)
            else:
                self.diverged, self.replay = True, []
        segment = recorded or Segment(list(context))
        self.segments.append(segment)
        return segment

    @property
    def parked(self) -> bool:
        """No engine call under way (a checkpoint reads the journal when every call in flight
        at its pause has come back with its partial tokens)."""
        return self.calls_returned >= self.calls_sent

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the key and the segments (the replay not yet used
        included, so a second restart loses nothing either)."""
        return {"key": self.key._asdict(), "segments": [asdict(s) for s in self.segments + self.replay]}

    @classmethod
    def for_replay(cls, data: dict[str, Any]) -> Journal:
        """A journal to run again from a checkpoint's record of it."""
        return cls(EpisodeKey(**data["key"]), replay=[Segment(**s) for s in data["segments"]])
