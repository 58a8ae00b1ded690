"""Tool-call formats by name: how a reply is read, and how a forced call begins.

``gateway.tool_parser`` names one (``hermes``, ``llama3_json``, ``mistral``,
``qwen3_xml``, ``pythonic``, a user's ``module:function``) or ``auto``: the format the
model was taught, read from what its chat template renders for a call (the probe's call,
``chat_format.TemplateSupport.call_text``) — the built-in parser that reads that text back
wins. A template that renders no calls gets asyncrl's hermes fallback, so ``auto`` is
``hermes`` there. The same rendering gives a built-in format its ``opening``, byte for
byte as the template writes a call, so ``opening + the model's continuation`` parses.

A format warns once (per format object: one per gateway) the first time a reply that
looks like a call fails to parse, naming the format and why: a model writing another
format than the parser reads would otherwise only show as a counter.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.config import ConfigError
from asyncrl.plugins import load_named
from asyncrl.rollout import chat_format
from asyncrl.rollout.gateway.tool_calls.parsers import hermes, llama3_json, mistral, pythonic, qwen3_xml
from asyncrl.rollout.gateway.tool_calls.reply import ParsedReply, ToolParser

logger = logging.getLogger("asyncrl.rollout.gateway.tool_calls")

AUTO = "auto"


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call format: ``parse`` reads replies (a ToolFormat is itself a parser), and
    :meth:`opening` is the text a forced call (``tool_choice`` required or named) begins
    with. A built-in format also says where a call's parts are in a template's rendering
    (``markers``, ``arguments``), so ``auto`` fits its opening to the template's bytes."""

    name: str
    parse: ToolParser
    start: str | None = None  # a call's text up to its function's name; None: no fixed opening
    between: str = ""  # after the function's name, up to where its arguments begin
    origin: str = ""  # how the format was chosen, as the start banner says it
    markers: tuple[str, ...] = ()  # what a call begins with, the most specific first
    arguments: str = ""  # what the arguments begin with ("": the first argument's name)

    def __call__(self, text: str) -> ParsedReply:
        return self.parse(text)

    def opening(self, function: str | None) -> str | None:
        """The format's call marker (``function`` None: any function), or the marker and
        ``function``'s name up to where the arguments begin; None when the format has no
        fixed opening (a user's parser)."""
        if self.start is None:
            return None
        return self.start if function is None else self.start + function + self.between

    def fitted(self, shown: str) -> ToolFormat:
        """This format with ``start`` and ``between`` as ``shown`` (the probe's call, as a
        template renders it) writes them: from the marker the call begins with to the
        function's name, and from the name to where the arguments begin. Unchanged where
        ``shown`` has not that shape."""
        name_at = shown.find(chat_format.PROBE_FUNCTION)
        after = name_at + len(chat_format.PROBE_FUNCTION)
        argument_at = shown.find(next(iter(chat_format.PROBE_ARGUMENTS)), after)
        if name_at < 0 or argument_at < 0:
            return self
        begins = [at for at in (shown.rfind(marker, 0, name_at) for marker in self.markers) if at >= 0]
        arguments_at = shown.rfind(self.arguments, after, argument_at)
        if not begins or arguments_at < 0:
            return self
        return replace(self, start=shown[begins[0]:name_at], between=shown[after:arguments_at])


FORMATS: dict[str, ToolFormat] = {fmt.name: fmt for fmt in (
    ToolFormat("hermes", hermes, '<tool_call>\n{"name": "', '", "arguments": ', markers=("<tool_call>",),
               arguments="{"),
    ToolFormat("llama3_json", llama3_json, '{"name": "', '", "parameters": ', markers=("<|python_tag|>", "{"),
               arguments="{"),
    ToolFormat("mistral", mistral, "[TOOL_CALLS]", "[ARGS]", markers=("[TOOL_CALLS]",), arguments="{"),
    ToolFormat("qwen3_xml", qwen3_xml, "<tool_call>\n<function=", ">\n", markers=("<tool_call>",),
               arguments="<parameter="),
    ToolFormat("pythonic", pythonic, "[", "(", markers=("<|python_start|>", "["), arguments=""),
)}
"""The built-in formats, each with its opening as most of its templates write it; the
order is ``auto``'s, though no two read the same call."""


class _WarnOnce:
    """``parse``, logging the first reply that looks like a call and does not parse."""

    def __init__(self, name: str, parse: ToolParser) -> None:
        self.name, self.parse, self.warned = name, parse, False

    def __call__(self, text: str) -> ParsedReply:
        reply = self.parse(text)
        if reply.error is not None and not self.warned:
            self.warned = True
            logger.warning("gateway.tool_parser %s: a reply that looks like a tool call did not parse (%s) and went "
                           "back as content; further ones are only counted (rollout/tool_parse_errors_total). It "
                           "began %r. If the model writes calls in another format, set gateway.tool_parser to it "
                           "(auto reads the chat template's).", self.name, reply.error, text[:200])
        return reply


def get_format(name: str) -> ToolFormat:
    """A built-in format with its usual opening, or a user's ``module:function`` parser
    (no opening). Raises ``ConfigError`` naming the valid names."""
    if name == AUTO:
        raise ValueError("gateway.tool_parser auto is read from the chat template: use resolve_format")
    if name in FORMATS:
        return replace(FORMATS[name], parse=_WarnOnce(name, FORMATS[name].parse), origin="gateway.tool_parser")
    if ":" not in name:
        raise ConfigError(f"gateway.tool_parser {name!r}: valid: {AUTO}, {', '.join(FORMATS)}, or your parser "
                          "as module:function (text -> ParsedReply)")
    try:
        return ToolFormat(name, _WarnOnce(name, load_named(name, key="gateway.tool_parser")),
                          origin="gateway.tool_parser")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_format_name(name: str) -> None:
    """Refuse (``ConfigError``) a ``gateway.tool_parser`` that names no format, before
    any model is loaded; ``auto`` is resolved once the tokenizer is there."""
    if name != AUTO:
        get_format(name)


def resolve_format(name: str, tokenizer: PreTrainedTokenizerBase) -> ToolFormat:
    """``name``'s format for ``tokenizer``: ``auto`` is the built-in format whose parser
    reads back the call the chat template renders (see the module docstring); a built-in
    format that reads it takes its opening from that rendering. Raises ``ConfigError``
    for an unknown name, and for ``auto`` on a template whose calls no built-in reads."""
    support = chat_format.probe(tokenizer) if tokenizer.chat_template is not None else None
    shown = support.call_text if support is not None else None
    taught = next((n for n, fmt in FORMATS.items() if _reads_probe(fmt.parse, shown)), None) if shown else None
    if name != AUTO:
        fmt = get_format(name)
        if taught is not None and taught != name and name in FORMATS:
            writer = "the chat template" if support.tool_calls else "asyncrl's fallback for this template"
            fmt = replace(fmt, origin=f"gateway.tool_parser; {writer} writes calls as {taught}, which this parser "
                                      "does not read")
    elif support is None or shown is None:
        fmt = replace(get_format("hermes"), origin=f"{AUTO}: no chat template rendering to read, hermes")
    elif taught is None:
        raise ConfigError(f"gateway.tool_parser {AUTO}: the chat template renders a tool call as {shown[:160]!r}, "
                          f"which no built-in format reads ({', '.join(FORMATS)}); write a parser for it and set "
                          "gateway.tool_parser to it as module:function")
    else:
        fmt = replace(get_format(taught), origin=f"{AUTO}, from the chat template" if support.tool_calls else
                      f"{AUTO}: the chat template renders no tool calls; asyncrl's fallback writes hermes")
    return fmt.fitted(shown) if shown and fmt.name == taught else fmt


def _reads_probe(parse: ToolParser, text: str) -> bool:
    calls = parse(text).tool_calls
    return (len(calls) == 1 and calls[0].name == chat_format.PROBE_FUNCTION
            and json.loads(calls[0].arguments) == chat_format.PROBE_ARGUMENTS)


RENAMED = {"PARSERS": "FORMATS", "get_parser": "get_format"}
"""Names this module (and the package, which handed them on) held before the formats were
one table -> the name that replaced them. A moved name keeps working where it was."""


def renamed(module: str, name: str, stacklevel: int = 2) -> Any:
    """``name``'s replacement (see :data:`RENAMED`), with a ``DeprecationWarning`` naming it
    in ``module``; ``AttributeError`` for any other name. ``stacklevel``: the caller of
    the module ``__getattr__`` that asks is 2 (for a package that hands these names on,
    add one per module it passes through)."""
    if name not in RENAMED:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = RENAMED[name]
    warnings.warn(f"{module}.{name} is deprecated: use {module}.{new} (a ToolFormat is itself a parser)",
                  DeprecationWarning, stacklevel=stacklevel + 1)
    return globals()[new]


def __getattr__(name: str) -> Any:
    """``PARSERS`` and ``get_parser``, defined here before the formats were one table."""
    return renamed(__name__, name)
