"""Conversations for ``asyncrl sft``: read from JSONL, every line checked before training.

A line is ``{"messages": [...], "tools": [...]}`` (``tools`` optional; other keys are
ignored) or a bare list of messages, in OpenAI's chat format: ``system``/``developer``,
``user``, ``assistant`` (``content`` and/or ``tool_calls``, each call's ``arguments`` a
JSON object as a string or an object) and ``tool`` results. Each message is then put in
the form the gateway hands the chat template (``Message.plain``): the same text parts
joined, ``content: None`` as empty text, nothing else kept. So SFT renders a conversation
exactly as the gateway renders an agent's request for it.

Every problem of every line is collected and raised at once as :class:`DataError`
(a ``ConfigError``: the CLI exits 2), each naming ``file:line``, the message and the fix,
so a bad dataset fails in seconds, not after the model has loaded or a step has run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.config import ConfigError
from asyncrl.rollout.gateway.openai_api import Message
from asyncrl.seeding import derive_seed

if TYPE_CHECKING:
    from asyncrl.sft.config import SFTDataConfig

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LISTED = 20  # problems listed in one DataError; the rest are counted


class DataError(ConfigError):
    """Conversations that cannot be trained on; the message names each ``file:line``."""


@dataclass(frozen=True)
class Conversation:
    source: str  # "file:line", for every message about it
    messages: list[dict[str, Any]]  # as the gateway hands them to the template (Message.plain)
    tools: list[dict[str, Any]] | None


def load_conversations(paths: list[str]) -> list[Conversation]:
    """Every conversation of ``paths`` in order; raises :class:`DataError` listing every bad
    line (and a missing or empty file)."""
    found: list[Conversation] = []
    problems: list[str] = []
    for path in paths:
        if not Path(path).is_file():
            problems.append(f"{path}: no such file")
            continue
        before = len(found)
        for source, line in _lines(Path(path)):
            errors = check_line(line)
            if errors:
                problems += [f"{source}: {e}" for e in errors]
            else:
                found.append(_conversation(source, line))
        if len(found) == before and not any(p.startswith(f"{path}:") for p in problems):
            problems.append(f"{path}: holds no conversation (one JSON object per line)")
    if problems:
        raise data_error("conversations that cannot be trained on", problems)
    return found


def train_and_held_out(data: SFTDataConfig, seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """The train and held-out conversations of ``data`` (``data.eval`` files, or a seeded
    ``data.eval_fraction`` of the train files), every line checked before anything loads."""
    train = load_conversations(data.train)
    held_out = load_conversations(data.eval) if data.eval else []
    if data.eval_fraction:
        if len(train) < 2:
            raise ConfigError(f"data.eval_fraction={data.eval_fraction}: {len(train)} conversation cannot be "
                              "split; give data.eval files or more conversations")
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(
            derive_seed(seed, "sft-eval-split"))).tolist()
        n = min(len(train) - 1, max(1, round(len(train) * data.eval_fraction)))
        held_out, train = [train[i] for i in sorted(order[:n])], [train[i] for i in sorted(order[n:])]
    return train, held_out


def data_error(head: str, problems: list[str]) -> DataError:
    """One error listing the first :data:`MAX_LISTED` problems, one a line, and counting the rest."""
    listed = problems[:MAX_LISTED] + ([f"... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED
                                      else [])
    return DataError(f"{head} (nothing was trained):\n  " + "\n  ".join(listed))


def _lines(path: Path) -> Iterator[tuple[str, Any]]:
    """(``file:line``, the parsed line or a :class:`_NotJSON`), blank lines skipped."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                yield f"{path}:{number}", _NotJSON(f"{exc.msg} at column {exc.colno}")
            except (ValueError, RecursionError) as exc:  # nested past the parser's depth, an over-long number
                yield f"{path}:{number}", _NotJSON(str(exc) or type(exc).__name__)


@dataclass(frozen=True)
class _NotJSON:
    why: str


def check_line(line: Any) -> list[str]:
    """What is wrong with one parsed line, each a sentence with its fix; [] when it trains."""
    if isinstance(line, _NotJSON):
        return [f"not JSON ({line.why}); write one conversation per line as a JSON object"]
    if isinstance(line, list):
        messages, tools = line, None
    elif isinstance(line, dict):
        if "messages" not in line:
            return [(f"no 'messages' (keys: {', '.join(map(str, line)) or 'none'}); write "
                     '{"messages": [...], "tools": [...]} or a bare list of messages')]
        messages, tools = line["messages"], line.get("tools")
    else:
        return [f"a {type(line).__name__}, not a conversation; write {{\"messages\": [...]}} or a list of messages"]
    if not isinstance(messages, list) or not messages:
        return ["'messages' must be a non-empty list of messages"]
    errors = _check_tools(tools)
    for i, message in enumerate(messages):
        errors += [f"messages[{i}]{e}" for e in _check_message(message)]
    if errors:
        return errors
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return ["no assistant message: nothing to train on (the loss is on assistant turns only)"]
    if roles[0] == "assistant":
        return [("messages[0] is an assistant message: a reply needs a message before it (the gateway "
                 "never generates without a prompt); start with a system or user message")]
    return []


def _check_tools(tools: Any) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        return [f"'tools' must be a list of tool definitions, got {type(tools).__name__}"]
    errors = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            errors.append(f'tools[{i}]: each tool is {{"type": "function", "function": {{"name": ..., '
                          f'"parameters": ...}}}} (got {json.dumps(tool)[:80]})')
    return errors


def _check_message(message: Any) -> list[str]:
    if not isinstance(message, dict):
        return [f": a message is an object with 'role' and 'content', got {json.dumps(message)[:80]}"]
    role = message.get("role")
    if role not in ROLES:
        return [f": role {role!r} is not one of {', '.join(ROLES)}"]
    where = f" ({role})"
    content = message.get("content")
    errors = []
    if not (content is None or isinstance(content, str) or _text_parts(content)):
        errors.append(f"{where}: 'content' must be a string, null or a list of text parts, "
                      f"got {json.dumps(content)[:80]}")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        errors.append(f"{where}: only an assistant message has 'tool_calls'")
    elif calls is not None:
        if not isinstance(calls, list):
            errors.append(f"{where}: 'tool_calls' must be a list of calls")
        else:
            errors += [f"{where}: tool_calls[{j}]{e}" for j, call in enumerate(calls) for e in _check_call(call)]
    if role == "assistant" and not errors and not calls and not _text(content):
        errors.append(f"{where}: neither content nor tool_calls: an empty reply teaches the model to say "
                      "nothing; drop the message or give it text")
    if role == "tool" and not isinstance(content, str | list):
        errors.append(f"{where}: a tool result needs 'content' (the tool's output as text)")
    return errors


def _check_call(call: Any) -> list[str]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return ['.function: a call is {"type": "function", "function": {"name": ..., "arguments": ...}}']
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        return [".function.name: a call needs the function's name"]
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            return [f".function.arguments is not JSON ({exc}); write a JSON object, as a string or an object"]
    if not isinstance(arguments, dict):
        return [(f".function.arguments must be a JSON object (the gateway's parser reads no other), "
                 f"got {json.dumps(arguments)[:80]}")]
    return []


def _text_parts(content: Any) -> bool:
    return isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str)
                                             for p in content)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content or ""


def _conversation(source: str, line: Any) -> Conversation:
    messages, tools = (line, None) if isinstance(line, list) else (line["messages"], line.get("tools"))
    plain = [Message.model_validate(m).plain() for m in messages]
    return Conversation(source, plain, tools or None)
