"""A reply sent as it is sampled: token ids in, OpenAI stream deltas out.

The engine hands the gateway each token when the step that sampled it ends
(``StreamingEngine``); this module turns the growing text into what may be sent now, so
that a streamed reply adds up to the reply the same request gets unstreamed:

- text goes out once no later token can change it: a character a byte-level BPE is still
  spelling (``\\ufffd`` at the end) waits for its next token, and so does text that may be
  the start of a stop string (the reply is cut there), of ``<think>``/``</think>`` or of a
  tool call;
- under a template with ``<think>`` the reasoning goes out as ``reasoning_content`` and the
  rest as ``content``, split as ``reasoning.split`` splits the whole reply;
- tool calls: content goes out until the text reaches where a call may begin (the tool
  format's call marker); from there nothing more is sent until the reply ends, when the
  parsed calls go out, each whole in one delta, as vLLM sends them (half a call is one no
  agent can run). A forced call, or tools under a format with no fixed opening, hold all
  content for the end. Trailing whitespace waits too: a reply with calls has its content
  stripped;
- at the end, what the reply holds beyond what was sent goes out. What was sent is a
  prefix of the reply's reasoning and content, except where the parsed content of a reply
  with calls drops whitespace the stream had already sent before them.

Nothing here touches what is recorded: the engine's completion, and so the trajectory,
is the same streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

import asyncrl.rollout.gateway.tool_choice as tool_choice
from asyncrl.rollout.gateway.reasoning import END_THINK, THINK, Thinking
from asyncrl.rollout.gateway.tool_calls import ToolFormat


class Detokenizer:
    """Token ids in, the text so far out. Each step decodes a short window — the tokens
    since the last text went out and the ones before them — rather than the whole reply
    (vLLM's incremental detokenizing): the cost per token stays flat, and a tokenizer that
    spells a character or a leading space across tokens gives the text decoding all the
    ids at once would."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # the window's start; where the tokens not yet in text begin

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # not halfway through a character
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text


def call_marker(parser: ToolFormat) -> str | None:
    """Where a call may begin in a reply, under ``parser``'s tool format: its opening up to
    the first whitespace (``<tool_call>``, ``[TOOL_CALLS]``), or the bracket a bare JSON or
    Python call opens with (``{``, ``[``: content is then held from its first bracket).
    None where the format has no fixed opening."""
    start = parser.opening(None)
    if not start or not start.strip():
        return None
    word = start.split(maxsplit=1)[0]
    return word[0] if word[0] in "{[" and not word.endswith("]") else word


@dataclass
class ReplyStream:
    """What of a reply may be sent, as its text grows. ``marker``: where a tool call may
    begin (None: no call is read from this reply); ``hold_content``: send content only at
    the end (a forced call, or tools under a format without a marker)."""

    thinking: Thinking | None = None
    marker: str | None = None
    hold_content: bool = False
    stops: tuple[str, ...] = ()
    sent: dict[str, str] = field(default_factory=lambda: {"reasoning_content": "", "content": ""})

    def update(self, text: str) -> dict[str, str]:
        """The delta to send for the reply's text so far (empty: nothing yet)."""
        reasoning, content = self._sendable(text)
        return self._advance(reasoning, content)

    def finish(self, reasoning: str | None, content: str | None) -> dict[str, str]:
        """The delta that completes the reply as parsed: what it holds beyond what was sent."""
        return self._advance(reasoning or "", content or "")

    def _advance(self, reasoning: str, content: str) -> dict[str, str]:
        delta = {}
        for key, value in (("reasoning_content", reasoning), ("content", content)):
            sent = self.sent[key]
            if len(value) > len(sent) and value.startswith(sent):
                delta[key], self.sent[key] = value[len(sent):], value
        return delta

    def _sendable(self, text: str) -> tuple[str, str]:
        cut = min((at for at in (text.find(s) for s in self.stops if s) if at >= 0), default=-1)
        text = text[:cut] if cut >= 0 else _hold(text, self.stops)
        reasoning, content = "", text
        if self.thinking is not None:
            body: str | None = text
            if not self.thinking.opened_by_prompt:
                stripped = text.lstrip()
                if THINK.startswith(stripped):  # nothing yet, or the tag half written
                    return "", ""
                body = stripped[len(THINK):] if stripped.startswith(THINK) else None
            if body is not None:
                reasoning, closed, rest = body.partition(END_THINK)
                if not closed:
                    return _hold(reasoning, (END_THINK,)), ""
                content = rest.lstrip()
        if self.hold_content:
            return reasoning, ""
        if self.marker is not None:
            at = content.find(self.marker)
            content = content[:at] if at >= 0 else _hold(content, (self.marker,))
        return reasoning, content.rstrip()


def for_chat(choice: tool_choice.ToolChoice, thinking: Thinking | None, parser: ToolFormat,
             stops: list[str]) -> ReplyStream:
    """The stream of a chat reply. A forced call sends nothing before the end (its text is
    a call, and holds no reasoning: the call opens the reply); a reply read for calls
    sends content up to where one may begin, or none under a format that cannot say."""
    forced = choice.opening is not None
    marker = call_marker(parser) if choice.parse and not forced else None
    return ReplyStream(thinking=None if forced else thinking, marker=marker,
                       hold_content=forced or (choice.parse and marker is None), stops=tuple(stops))


def _hold(text: str, markers: tuple[str, ...] | list[str]) -> str:
    """``text`` without its longest ending that begins one of ``markers``: text that the
    next token may turn into one."""
    held = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:n]):
                held = n
                break
    return text[:len(text) - held]
