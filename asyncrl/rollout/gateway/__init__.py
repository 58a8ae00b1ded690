"""An OpenAI-compatible gateway in front of a rollout engine, so agent code written
against the OpenAI API trains unchanged: it gets a session base URL, and every call it
makes is recorded token-exact into its episode."""

from asyncrl.rollout.gateway.server import Gateway
from asyncrl.rollout.gateway.tool_calls import PARSERS, ParsedReply, ToolCall, get_parser, hermes

__all__ = ["PARSERS", "Gateway", "ParsedReply", "ToolCall", "get_parser", "hermes"]
