"""Model text → OpenAI ``tool_calls``, in the format the model was taught.

``reply.py``: what a parser returns (content, calls, and the error of a call that did not
parse, never an exception); ``parsers.py``: the built-in formats' parsers; ``formats.py``:
``FORMATS``, the one table of format records (parser, opening, where a call's parts are in
a template's rendering), a format by name or ``auto`` from the chat template.
"""

from typing import Any

from asyncrl.rollout.gateway.tool_calls import formats
from asyncrl.rollout.gateway.tool_calls.formats import (
    AUTO,
    FORMATS,
    ToolFormat,
    check_format_name,
    get_format,
    resolve_format,
)
from asyncrl.rollout.gateway.tool_calls.parsers import hermes, llama3_json, mistral, pythonic, qwen3_xml
from asyncrl.rollout.gateway.tool_calls.reply import ParsedReply, ToolCall, ToolParser

__all__ = ["AUTO", "FORMATS", "ParsedReply", "ToolCall", "ToolFormat", "ToolParser", "check_format_name",
           "get_format", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "resolve_format"]


def __getattr__(name: str, stacklevel: int = 2) -> Any:
    """Names this package exported before the formats were one table (``formats.RENAMED``):
    still there, with a ``DeprecationWarning`` naming what replaced them (a format is
    itself a parser). ``stacklevel``: for a package that hands these names on, where its
    caller is."""
    return formats.renamed(__name__, name, stacklevel)
