"""``tool_choice``: what an agent asks of the model's next turn, turned into what the
gateway does before and after it samples.

- ``auto`` (or absent): the model decides; calls are parsed from its reply.
- ``none``: the tools stay rendered — the prompt is the one the turns before and after
  render, so the trajectory goes on token-exact — and the reply is not parsed: a call the
  model writes anyway comes back as plain content (vLLM's default too).
- ``required`` or ``{"type": "function", "function": {"name": f}}``: the reply is made to
  begin with the tool format's opening of a call (naming ``f`` when named). That text is
  written into the context as environment tokens (mask 0, no version, logprob 0: the
  model did not sample it, so the learner never trains on it) and the model samples the
  rest, so every trained token is one the policy really sampled. A masked or
  grammar-constrained decode would record logprobs of a distribution other than the
  policy's; this one records the policy's, conditioned on the forced text.

What the gateway cannot honour is refused (400, ``param`` ``tool_choice``): a choice
without tools, a named function not among them, and a forced call under a tool format
with no fixed opening (a user's parser that is a plain function).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.json_api import Refused
from asyncrl.rollout.gateway.tool_calls import ToolFormat


@dataclass(frozen=True)
class ToolChoice:
    parse: bool  # read tool calls from the reply (False for "none")
    opening: str | None = None  # the text the reply is made to begin with; None: the model's own start
    function: str | None = None  # the function a named choice forces


AUTO = ToolChoice(parse=True)


def resolve(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None,
            parser: ToolFormat) -> ToolChoice:
    """What ``choice`` asks of the reply, or ``Refused(400)`` naming why it cannot be
    honoured. ``tools`` are validated already (each has a named function)."""
    if choice is None or choice == "auto":
        return AUTO
    if choice == "none":
        return ToolChoice(parse=False)
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise Refused(400, 'tool_choice: expected "auto", "none", "required" or {"type": "function", '
                               f'"function": {{"name": …}}}} (got {choice!r:.120})', "tool_choice")
    elif choice == "required":
        name = None
    else:
        raise Refused(400, f'tool_choice: expected "auto", "none", "required" or a named function (got {choice!r:.80})',
                      "tool_choice")
    names = [tool["function"]["name"] for tool in tools or []]
    if not names:
        raise Refused(400, f"tool_choice {_shown(name)} needs tools: send the functions the model may call in "
                           "`tools`", "tool_choice")
    if name is not None and name not in names:
        raise Refused(400, f"tool_choice names function {name!r}, which is not in tools (they are: "
                           f"{', '.join(map(repr, names))})", "tool_choice")
    forced = parser.opening(name)
    if forced is None:
        raise Refused(400, f"tool_choice {_shown(name)} cannot be honoured: the gateway's tool format "
                           f"({parser.name}) has no fixed "
                           "opening of a call to write before the model samples the rest. Use tool_choice "
                           '"auto", or a tool format that has one (gateway.tool_parser)', "tool_choice")
    return ToolChoice(parse=True, opening=forced, function=name)


def _shown(name: str | None) -> str:
    return '"required"' if name is None else f"naming {name!r}"
