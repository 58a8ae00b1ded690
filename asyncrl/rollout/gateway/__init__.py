"""An OpenAI-compatible gateway in front of a rollout engine, so agent code written
against the OpenAI API trains unchanged: it gets a session base URL, and every call it
makes is recorded token-exact into its episode."""

from typing import Any

from asyncrl.rollout.gateway import tool_calls
from asyncrl.rollout.gateway.sdk import set_turn_reward
from asyncrl.rollout.gateway.server import Gateway
from asyncrl.rollout.gateway.tool_calls import FORMATS, ParsedReply, ToolCall, get_format, hermes

__all__ = ["FORMATS", "Gateway", "ParsedReply", "ToolCall", "get_format", "hermes", "set_turn_reward"]


def __getattr__(name: str) -> Any:
    """``PARSERS`` and ``get_parser``, exported here before the formats were one table:
    ``tool_calls`` hands them out with a ``DeprecationWarning``."""
    if name in ("PARSERS", "get_parser"):
        return tool_calls.__getattr__(name, stacklevel=3)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
