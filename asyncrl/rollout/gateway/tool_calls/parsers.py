"""The tool-call formats models are taught, each a parser ``text -> ParsedReply``.

Each reads what one family's chat template renders for a call, with the whitespace a
sampling model varies (the formats as vLLM's tool parsers of the same names read them).
Each returns text that is not a call unchanged and without ``error``; text that looks like
a call and does not parse comes back whole as content, ``error`` saying why (see
``reply.py``). Content is the text around the calls, stripped; None when nothing is left.
"""

from __future__ import annotations

import ast
import re
import uuid
from typing import Any

from asyncrl.rollout.gateway.tool_calls.reply import (
    BrokenCall,
    ParsedReply,
    ToolCall,
    arguments_json,
    call_from_object,
    json_at,
    json_value,
    never_raises,
)

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _blocks(text: str) -> tuple[list[str], str]:
    """The insides of ``<tool_call>…</tool_call>`` blocks, and the text around them."""
    rest = _TOOL_CALL_BLOCK.sub("", text)
    if "<tool_call>" in rest or "</tool_call>" in rest:
        raise BrokenCall("unclosed <tool_call>")
    return _TOOL_CALL_BLOCK.findall(text), rest


def _reply(rest: str, calls: list[ToolCall]) -> ParsedReply:
    return ParsedReply(rest.strip() or None, tuple(calls))


@never_raises
def hermes(text: str) -> ParsedReply:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` blocks (Qwen2.5/Qwen3,
    Hermes; asyncrl's fallback for templates without tools writes them); the text around
    them is the content. One broken block returns the whole reply as content."""
    if "<tool_call>" not in text:
        return ParsedReply(text)
    inside, rest = _blocks(text)
    return _reply(rest, [call_from_object(json_value(raw)) for raw in inside])


_PYTHON_TAG = "<|python_tag|>"
_LLAMA_CALL = re.compile(r'\s*\{\s*"name"\s*:')
_NEXT_LLAMA_CALL = re.compile(r"\s*;?\s*(?=\{)")


@never_raises
def llama3_json(text: str) -> ParsedReply:
    """Llama 3.x's calls: ``{"name": "f", "parameters": {...}}`` (``arguments`` read too)
    beginning the reply or after ``<|python_tag|>``, several separated by ``;``. Text after
    the calls, and before the tag, is content. Without the tag a reply is a call only when
    it begins with an object holding ``name`` and ``parameters``/``arguments``: a model
    answering in JSON (``{"name": "Ada", "age": 36}``) is not calling anything."""
    before, tag, body = text.partition(_PYTHON_TAG)
    if not tag:
        before, body = "", text
        if not _LLAMA_CALL.match(body):
            return ParsedReply(text)
    call, at = json_at(body, len(body) - len(body.lstrip()))
    if not tag and not (isinstance(call, dict) and ("parameters" in call or "arguments" in call)):
        return ParsedReply(text)
    calls = []
    while True:
        calls.append(call_from_object(call, ("parameters", "arguments")))
        more = _NEXT_LLAMA_CALL.match(body, at)
        if more is None:
            return _reply(before + body[at:], calls)
        call, at = json_at(body, more.end())


_MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_MISTRAL_NAME = re.compile(r"[\w.\-]+")


def _mistral_id(written: Any = None) -> str:
    """The model's own call id where it wrote a valid one, else a fresh one: Mistral's
    templates refuse any id that is not 9 alphanumerics when the call comes back."""
    return written if isinstance(written, str) and _MISTRAL_ID.fullmatch(written) else uuid.uuid4().hex[:9]


@never_raises
def mistral(text: str) -> ParsedReply:
    """``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (Mistral 7B v0.3,
    Nemo, Small 3.1), or the newer ``[TOOL_CALLS]name[ARGS]{...}`` once per call
    (Small 3.2, Devstral, Magistral; an optional ``[CALL_ID]id`` before ``[ARGS]``). Text
    before the first marker and after each call is content."""
    if _MISTRAL_CALLS not in text:
        return ParsedReply(text)
    content, *segments = text.split(_MISTRAL_CALLS)
    pieces, calls = [content], []
    for segment in segments:
        body = segment.lstrip()
        if body.startswith(("[", "{")):
            written, end = json_at(body)
            items = written if isinstance(written, list) else [written]
            if not items:
                raise BrokenCall("[TOOL_CALLS] holds an empty list")
            calls += [call_from_object(item, id=_mistral_id(item.get("id") if isinstance(item, dict) else None))
                      for item in items]
        else:
            head, marker, body = segment.partition("[ARGS]")
            name, _, call_id = head.partition("[CALL_ID]")
            if not marker or not _MISTRAL_NAME.fullmatch(name.strip()):
                raise BrokenCall("[TOOL_CALLS] is followed by neither a JSON list nor name[ARGS]{…}")
            arguments, end = json_at(body, len(body) - len(body.lstrip()))
            calls.append(ToolCall(name.strip(), arguments_json(arguments), id=_mistral_id(call_id.strip())))
        pieces.append(body[end:])
    return _reply("".join(pieces), calls)


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# A value ends at </parameter>, or where a model that forgot it starts the next one.
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def _xml_value(raw: str) -> Any:
    """A parameter's value: the template puts it on its own line (one newline each side is
    layout, not value). JSON where it parses (numbers, true/false/null, objects, lists)
    and Python's True/False/None (Qwen3-Coder's template writes non-strings with Jinja's
    ``string``); else the text as a string. No schema is consulted, so a string argument
    that reads as JSON (``"42"``) comes back as that JSON value."""
    value = raw.removeprefix("\n").removesuffix("\n")
    if value in _PYTHON_LITERALS:
        return _PYTHON_LITERALS[value]
    try:
        return json_value(value) if value.strip() else value
    except BrokenCall:
        return value


@never_raises
def qwen3_xml(text: str) -> ParsedReply:
    """Qwen3-Coder's calls: ``<tool_call>`` blocks of ``<function=f>`` holding
    ``<parameter=p>\\nvalue\\n</parameter>`` lines (values converted by :func:`_xml_value`).
    One broken block returns the whole reply as content."""
    if "<tool_call>" not in text:
        return ParsedReply(text)
    inside, rest = _blocks(text)
    calls = []
    for raw in inside:
        functions = _XML_FUNCTION.findall(raw)
        if not functions or _XML_FUNCTION.sub("", raw).strip():
            raise BrokenCall("<tool_call> does not hold <function=name>…</function>")
        calls += [ToolCall(name.strip(), arguments_json(
            {key.strip(): _xml_value(value) for key, value in _XML_PARAMETER.findall(body)}))
            for name, body in functions]
    return _reply(rest, calls)


_PYTHONIC_START = re.compile(r"\s*(<\|python_start\|>)?\s*(?=\[\s*[A-Za-z_]\w*\s*\()")
_JSON_NAMES = {"true": True, "false": False, "null": None}  # what a model used to JSON may write


@never_raises
def pythonic(text: str) -> ParsedReply:
    """Llama 3.2's and Llama 4's pythonic calls, ``[f(a=1, b="x"), g()]``, beginning the
    reply (Llama 4 wraps them in ``<|python_start|>…<|python_end|>``). Read with
    :mod:`ast` and literals only (never evaluated): keyword arguments whose values are
    strings, numbers, booleans, None, lists, tuples and dicts with string keys. Text
    after the list is content."""
    start = _PYTHONIC_START.match(text)
    if start is None:
        return ParsedReply(text)
    listed, end = _python_list(text, start.end())
    rest = text[end:]
    if start.group(1):
        rest = rest.lstrip().removeprefix("<|python_end|>")
    return _reply(rest, [_pythonic_call(node) for node in listed.elts])


def _python_list(text: str, start: int) -> tuple[ast.List, int]:
    """The list expression that begins at ``text[start]`` and the index past its ``]``.
    The closing bracket is found by one scan (brackets inside string literals do not
    count) and the list parsed once: parsing at every ``]`` in turn would be quadratic in
    a reply's length, and a model can write thousands of brackets."""
    close = _closing_bracket(text, start)
    if close is None:
        raise BrokenCall("pythonic tool call does not parse (no closing ])")
    try:
        node = ast.parse(text[start:close + 1], mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise BrokenCall(f"pythonic tool call does not parse ({getattr(exc, 'msg', None) or exc})") from None
    if not isinstance(node, ast.List):
        raise BrokenCall("pythonic tool call does not parse (not a list of calls)")
    return node, close + 1


def _closing_bracket(text: str, start: int) -> int | None:
    """The index of the bracket that closes the one at ``text[start]``, skipping Python
    string literals (quotes, triple quotes, backslash escapes); None when it never closes."""
    depth, i, quote = 0, start, None
    while i < len(text):
        if quote is not None:
            if text[i] == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i, quote = i + len(quote), None
                continue
        elif text[i] in "'\"":
            quote = text[i:i + 3] if text[i:i + 3] in ("'''", '"""') else text[i]
            i += len(quote)
            continue
        elif text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _pythonic_call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise BrokenCall("pythonic tool call: each item must be name(argument=value, …)")
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        raise BrokenCall(f"pythonic tool call {node.func.id}: arguments must be written argument=value")
    return ToolCall(node.func.id, arguments_json({k.arg: _literal(k.value) for k in node.keywords}))


def _literal(node: ast.expr) -> Any:
    """A JSON value written as a Python literal; raises :class:`BrokenCall` for anything
    else (a name, a call, an operator beyond a sign)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise BrokenCall("pythonic tool call: a dict argument needs string keys")
        return dict(zip(keys, (_literal(value) for value in node.values)))
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError):
        raise BrokenCall(f"pythonic tool call: {ast.unparse(node)[:80]!r} is not a literal") from None
    if value is None or isinstance(value, (str, int, float)):  # bool is an int
        return value
    raise BrokenCall(f"pythonic tool call: {ast.unparse(node)[:80]!r} is not a JSON value")
