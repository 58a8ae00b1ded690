"""The episode of a ``task.name: verifiers`` task: an ``openai_agent`` agent
(``workflow.agent: asyncrl.rollout.workflows.verifiers_agent:run``).

It sends the task's prompt (its system prompt first) to the model through
``openai.AsyncOpenAI`` at the episode's gateway session, so every call is recorded
token-exact like any agent's, and returns what the task's rubric makes of the conversation
(``asyncrl/tasks/verifiers_tasks.py``, where the tasks and the scoring live).

Why an agent and not a workflow class of its own: the ``openai_agent`` workflow already
gives each episode its gateway session, the token-exact trajectories, the timeout, retry
and error rules; the agent only has to be the conversation.

Multi-turn: the task's toolsets (``Task.toolsets``) are built here and their ``@vf.tool``
methods offered as OpenAI tools and answered in this process (not served over MCP), up to
``task.options.max_turns`` model calls on the one session. They are a ``ToolBox``
(``asyncrl/tools/toolbox.py``), the contract MCP servers' tools (``MCPTools``) meet too, so
``converse`` runs an agent over either.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
import weakref
from collections.abc import Mapping
from typing import Any

from asyncrl.tasks.base import Task
from asyncrl.tasks.verifiers_tasks import DEFAULT_MAX_TURNS, prompt_messages, score_conversation, verifiers_tasks
from asyncrl.tools.toolbox import ToolBox, call_parts

_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _client(base_url: str) -> Any:
    """One SDK client per event loop, pointed at each episode's session URL."""
    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = AsyncOpenAI(base_url=base_url, api_key="asyncrl", max_retries=0)
    return _clients[loop].with_options(base_url=base_url)


class TasksetTools:
    """A ``verifiers`` task's tools (its toolsets' ``@vf.tool`` methods) as a ``ToolBox``,
    called in this process. Names as verifiers advertises them: ``<prefix>_<tool>``. A call
    the tool refuses is answered with the reason (as an MCP tool error is), not an episode
    failure."""

    def __init__(self, vf_task: Any) -> None:
        import pydantic
        from verifiers.v1.utils.decorators import discover_decorated

        self.vf_task = vf_task
        self._tools: dict[str, tuple[Any, Any]] = {}  # name -> (the bound method, its arguments' pydantic model)
        self.openai_tools: list[dict[str, Any]] = []
        for toolset in type(vf_task).toolsets(vf_task.config):
            for fn in discover_decorated(toolset, "tool"):
                raw = getattr(fn, "tool_name", None) or fn.__name__
                name = f"{toolset.server_name}_{raw}" if toolset.server_name else raw
                hints = typing.get_type_hints(fn)
                fields = {n: (hints.get(n, Any), ... if p.default is p.empty else p.default)
                          for n, p in inspect.signature(fn).parameters.items()}
                args = pydantic.create_model(f"{name}_arguments", **fields)
                self._tools[name] = (fn, args)
                self.openai_tools.append({"type": "function", "function": {
                    "name": name, "description": (fn.__doc__ or "").strip(), "parameters": args.model_json_schema()}})

    async def setup(self) -> None:
        """What verifiers runs as a toolset server starts, then per task."""
        for toolset in {id(fn.__self__): fn.__self__ for fn, _ in self._tools.values()}.values():
            await toolset.setup()
            await toolset.setup_task(self.vf_task)

    async def call(self, tool_call: Any) -> str:
        name, arguments = call_parts(tool_call)
        if name not in self._tools:
            return f"error: no tool {name!r}; the tools are {sorted(self._tools)}"
        fn, model = self._tools[name]
        try:  # arguments that are not an object fail validation: the reason goes back to the model
            parsed = (model.model_validate_json(arguments or "{}") if isinstance(arguments, str | None)
                      else model.model_validate(arguments))
            result = fn(**{k: getattr(parsed, k) for k in type(parsed).model_fields})
            if asyncio.iscoroutine(result):
                result = await result
        except Exception as exc:  # noqa: BLE001 - the tool's own failure goes back to the model
            return f"error: {type(exc).__name__}: {exc}"
        return result if isinstance(result, str) else json.dumps(result, default=str)


async def converse(client: Any, messages: list[dict[str, Any]], tools: ToolBox, *, max_turns: int,
                   model: str = "policy") -> list[dict[str, Any]]:
    """The conversation after ``messages``: the model's replies through ``client`` (an
    ``openai.AsyncOpenAI``), each of its tool calls answered by ``tools``, until a reply
    calls none or ``max_turns`` model calls are made. Returns the whole conversation."""
    extra = {"tools": tools.openai_tools} if tools.openai_tools else {}
    conversation = list(messages)
    for _ in range(max_turns):
        reply = (await client.chat.completions.create(model=model, messages=conversation, **extra)).choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                 for c in reply.tool_calls or []]
        conversation.append({"role": "assistant", "content": reply.content or "", **({"tool_calls": calls}
                                                                                     if calls else {})})
        if not calls:
            break
        for call in calls:
            conversation.append({"role": "tool", "tool_call_id": call["id"], "content": await tools.call(call)})
    return conversation


async def run(task: Task, base_url: str) -> float:
    """One episode of a ``task.name: verifiers`` task: the conversation with the model
    through the gateway (its tool calls answered by the task's toolsets, up to
    ``max_turns`` model calls), scored by the taskset's rubric."""
    ref = task.data.get("verifiers")
    if not isinstance(ref, Mapping):
        raise ValueError(f"task {task.id}: not a task.name 'verifiers' task; this agent only runs those")
    vf_task = verifiers_tasks(ref["environment"], ref["config"])[ref["index"]]
    messages = prompt_messages(vf_task)
    tools = TasksetTools(vf_task)
    await tools.setup()
    conversation = await converse(_client(base_url), messages, tools,
                                  max_turns=ref.get("max_turns", DEFAULT_MAX_TURNS))
    return await score_conversation(vf_task, conversation, len(messages), what=f"task {task.id}")
