"""The one contract an agent's tools meet, whoever provides them: MCP servers
(``mcp_tools.MCPTools``) or a ``verifiers`` task's toolsets
(``asyncrl/rollout/workflows/verifiers_agent.py``). An agent loop written against it
(``verifiers_agent.converse``) runs either.

What fails and what answers: a call the *model* got wrong (a name not offered, arguments
that are not a JSON object) is answered with a tool message saying so — the model's
mistake is the episode's information; the tool box's own failure (a server gone, a
timeout) raises, failing the episode, which asyncrl counts and retries.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ToolBox(Protocol):
    @property
    def openai_tools(self) -> list[dict[str, Any]]:
        """The tools as OpenAI ``tools`` (what ``chat.completions.create(tools=...)`` takes)."""
        ...

    async def call(self, tool_call: Any) -> str:
        """The text of the ``tool`` message answering one of the model's calls (an SDK
        ``tool_call`` or its dict form)."""
        ...


def call_parts(tool_call: Any) -> tuple[str, Any]:
    """A model's call as (function name, its arguments as written: a JSON string, or
    already an object), from an SDK ``tool_call`` or its dict form."""
    function = tool_call["function"] if isinstance(tool_call, dict) else tool_call.function
    if isinstance(function, dict):
        return function["name"], function.get("arguments")
    return function.name, function.arguments


def call_arguments(arguments: Any) -> dict[str, Any] | None:
    """The arguments as an object (empty or absent: no arguments); None where they are not
    a JSON object, which the tool box answers as the model's mistake."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else (arguments or {})
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
