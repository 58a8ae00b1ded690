"""Model text → OpenAI ``tool_calls``, in the format the model was taught.

``reply.py``: what a parser returns (content, calls, and the error of a call that did not
parse, never an exception); ``parsers.py``: the built-in formats; ``formats.py``: a
format by name or ``auto`` from the chat template, with the opening a forced call
begins with.
"""

from asyncrl.rollout.gateway.tool_calls.formats import (
    AUTO,
    PARSERS,
    ToolFormat,
    check_format_name,
    get_format,
    get_parser,
    resolve_format,
)
from asyncrl.rollout.gateway.tool_calls.parsers import hermes, llama3_json, mistral, pythonic, qwen3_xml
from asyncrl.rollout.gateway.tool_calls.reply import ParsedReply, ToolCall, ToolParser

__all__ = ["AUTO", "PARSERS", "ParsedReply", "ToolCall", "ToolFormat", "ToolParser", "check_format_name",
           "get_format", "get_parser", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml",
           "resolve_format"]
