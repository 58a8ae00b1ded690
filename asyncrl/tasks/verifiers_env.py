"""``task.name: verifiers``: train on a `verifiers` taskset (prime-rl's environment format,
``pip install -e ".[verifiers]"``), its own tasks and its own rubric, unchanged.

Two halves, both here:

- the tasks: ``load_verifiers_splits`` loads the taskset that ``task.options.environment``
  names — an installed taskset package id (what ``vf-run <id>`` takes, e.g.
  ``reverse-text``) or ``path/to/file.py`` exporting its ``vf.Taskset`` subclass in
  ``__all__`` — with ``task.options.config`` as its ``TasksetConfig`` fields. Its tasks in
  ``load()`` order are the rows: the last ``num_validation`` held out, the first
  ``num_train`` (0: all) of the rest trained on;
- the episode: ``run(task, base_url)`` is an ``openai_agent`` agent
  (``workflow.agent: asyncrl.tasks.verifiers_env:run``). It sends the task's prompt (its
  system prompt first) to the model through ``openai.AsyncOpenAI`` at the episode's gateway
  session, so every call is recorded token-exact like any agent's, records the conversation
  on a ``vf.Trace`` and returns what the task's rubric (its ``@vf.reward`` methods and judges,
  ``Task.score``) makes of it: ``trace.reward``, the weighted sum.

Why an agent and not a workflow class of its own: the ``openai_agent`` workflow already
gives each episode its gateway session, the token-exact trajectories, the timeout, retry
and error rules; the adapter only has to be the conversation and the scoring.

Multi-turn: the task's toolsets (``Task.toolsets``) are built here and their ``@vf.tool``
methods offered as OpenAI tools and answered in this process (not served over MCP), up to
``task.options.max_turns`` model calls on the one session.

What it does not run: verifiers' own harnesses (the programs, e.g. ``bash`` or
``claude_code``, that verifiers launches in a runtime through its interception server),
toolsets that need a runtime or state channel of their own, multi-agent ``Env``s
(``user-sim``), and runtime-dependent rewards (a reward that takes a ``runtime`` argument
is skipped, as ``Task.score`` does offline).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Mapping
from typing import Any

from asyncrl.plugins import _import_file
from asyncrl.tasks.base import Task, TaskSplits

INSTALL_HINT = 'pip install -e ".[verifiers]"  (the `verifiers` package, verifiers>=0.4)'
DEFAULT_MAX_TURNS = 4  # model calls per episode, where the taskset's tools keep being called
_loaded: dict[str, list[Any]] = {}  # (environment, config) as JSON -> the taskset's tasks
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ValueError(f"task 'verifiers' needs the verifiers package ({exc}); install it: {INSTALL_HINT}") from None
    return vf


def _taskset_class(environment: str) -> Any:
    """The ``vf.Taskset`` subclass a path or an installed id names."""
    vf = _vf()
    from verifiers.v1.utils.loaders import taskset_class

    if environment.endswith(".py"):
        module = _import_file(environment, environment, "task.options.environment")  # ValueError names it
        found = [obj for n in getattr(module, "__all__", [])
                 if isinstance(obj := getattr(module, n, None), type) and issubclass(obj, vf.Taskset)
                 and obj is not vf.Taskset]
        if len(found) != 1:
            raise ValueError(f"task.options.environment {environment!r} must export exactly one vf.Taskset "
                             f"subclass in __all__, found {[c.__name__ for c in found]}")
        return found[0]
    try:
        return taskset_class(environment)
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"task.options.environment {environment!r} cannot be loaded: {exc} "
                         "(an installed verifiers taskset id, or path/to/file.py exporting a vf.Taskset)") from None


def verifiers_tasks(environment: str, config: Mapping[str, Any]) -> list[Any]:
    """The taskset's tasks (``vf.Task``) in ``load()`` order, loaded once per process."""
    key = json.dumps([environment, dict(config)], sort_keys=True, default=str)
    if key not in _loaded:
        vf = _vf()
        from verifiers.v1.utils.generic import concrete_type

        cls = _taskset_class(environment)
        config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        try:
            taskset = cls(config_type.model_validate({**config, "id": "" if environment.endswith(".py") else environment}))
            if not taskset.bounded:
                raise ValueError("it is infinite; bound it in its own config")
            _loaded[key] = list(taskset)
        except ValueError as exc:  # pydantic's ValidationError included
            raise ValueError(f"task.options.environment {environment!r}: {exc}") from None
    return _loaded[key]


def load_verifiers_splits(options: Mapping[str, Any], *, num_train: int, num_validation: int) -> TaskSplits:
    """Train/validation splits of the taskset ``options['environment']`` names."""
    _vf()  # the package first: its absence is the first thing to say
    unknown = set(options) - {"environment", "config", "max_turns"}
    if unknown:
        raise ValueError(f"task 'verifiers': unknown options {sorted(unknown)}; it takes `environment` "
                         "(an installed taskset id or path/to/file.py), `config` (its TasksetConfig fields) "
                         f"and `max_turns` (model calls per episode, default {DEFAULT_MAX_TURNS})")
    environment = options.get("environment")
    if not isinstance(environment, str) or not environment:
        raise ValueError("task 'verifiers' needs task.options.environment: an installed verifiers taskset id "
                         "or path/to/file.py exporting a vf.Taskset")
    config = options.get("config") or {}
    max_turns = options.get("max_turns", DEFAULT_MAX_TURNS)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"task.options.max_turns {max_turns!r}: expected a whole number of model calls, 1 or more")
    loaded = verifiers_tasks(environment, config)
    rows = []
    for index, vf_task in enumerate(loaded):
        ref = {"environment": environment, "config": dict(config), "index": index,
               "max_turns": max_turns}
        text = vf_task.data.prompt_text
        rows.append(Task(id=f"{vf_task.data.id or index}", prompt=text, data={"verifiers": ref}))
    cut = len(rows) - num_validation
    if cut < 1:
        raise ValueError(f"task.options.environment {environment!r}: {len(rows)} tasks is too few to hold out "
                         f"{num_validation} for validation and still train; lower num_validation")
    train, validation = rows[:cut], rows[cut:]
    return TaskSplits(train=train[:num_train] if num_train > 0 else train, validation=validation)


def prompt_messages(vf_task: Any) -> list[dict[str, Any]]:
    """The chat the model is sent: the task's system prompt, then its prompt (text or messages)."""
    data = vf_task.data
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages.extend(m.model_dump(exclude_none=True) for m in data.prompt or [])
    return messages


def _client(base_url: str) -> Any:
    """One SDK client per event loop, pointed at each episode's session URL."""
    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = AsyncOpenAI(base_url=base_url, api_key="asyncrl", max_retries=0)
    return _clients[loop].with_options(base_url=base_url)


def task_tools(vf_task: Any) -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """The tools of the task's toolsets (``Task.toolsets``), called in this process rather
    than served over MCP: name -> (the bound ``@vf.tool`` method, its arguments' pydantic
    model, its OpenAI schema). Names as verifiers advertises them: ``<prefix>_<tool>``."""
    import inspect
    import typing

    import pydantic
    from verifiers.v1.utils.decorators import discover_decorated

    tools: dict[str, tuple[Any, Any, dict[str, Any]]] = {}
    for toolset in type(vf_task).toolsets(vf_task.config):
        for fn in discover_decorated(toolset, "tool"):
            raw = getattr(fn, "tool_name", None) or fn.__name__
            name = f"{toolset.server_name}_{raw}" if toolset.server_name else raw
            hints = typing.get_type_hints(fn)
            fields = {n: (hints.get(n, Any), ... if p.default is p.empty else p.default)
                      for n, p in inspect.signature(fn).parameters.items()}
            args = pydantic.create_model(f"{name}_arguments", **fields)
            tools[name] = (fn, args, {"type": "function", "function": {
                "name": name, "description": (fn.__doc__ or "").strip(), "parameters": args.model_json_schema()}})
    return tools


async def _call_tool(tools: dict[str, tuple[Any, Any, dict[str, Any]]], name: str, arguments: str) -> str:
    """A tool's result as the model reads it; a call the tool refuses is answered with the
    reason (as an MCP tool error is), not an episode failure."""
    if name not in tools:
        return f"error: no tool {name!r}; the tools are {sorted(tools)}"
    fn, model, _ = tools[name]
    try:
        parsed = model.model_validate_json(arguments or "{}")
        result = fn(**{k: getattr(parsed, k) for k in type(parsed).model_fields})
        if asyncio.iscoroutine(result):
            result = await result
    except Exception as exc:  # noqa: BLE001 - the tool's own failure goes back to the model
        return f"error: {type(exc).__name__}: {exc}"
    return result if isinstance(result, str) else json.dumps(result, default=str)


async def run(task: Task, base_url: str) -> float:
    """One episode of a ``task.name: verifiers`` task: the conversation with the model
    through the gateway (its tool calls answered by the task's toolsets, up to
    ``max_turns`` model calls), scored by the taskset's rubric."""
    ref = task.data.get("verifiers")
    if not isinstance(ref, Mapping):
        raise ValueError(f"task {task.id}: not a task.name 'verifiers' task; this agent only runs those")
    vf_task = verifiers_tasks(ref["environment"], ref["config"])[ref["index"]]
    messages = prompt_messages(vf_task)
    tools = task_tools(vf_task)
    for toolset in {id(fn.__self__): fn.__self__ for fn, _, _ in tools.values()}.values():
        await toolset.setup()  # what verifiers runs as a toolset server starts, then per task
        await toolset.setup_task(vf_task)
    extra = {"tools": [schema for _, _, schema in tools.values()]} if tools else {}
    conversation = list(messages)
    for _ in range(ref.get("max_turns", DEFAULT_MAX_TURNS)):
        reply = (await _client(base_url).chat.completions.create(model="policy", messages=conversation,
                                                                  **extra)).choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                 for c in reply.tool_calls or []]
        conversation.append({"role": "assistant", "content": reply.content or "", **({"tool_calls": calls}
                                                                                     if calls else {})})
        if not calls:
            break
        for call in calls:
            content = await _call_tool(tools, call["function"]["name"], call["function"]["arguments"])
            conversation.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return await score_conversation(vf_task, conversation, len(messages), what=f"task {task.id}")


async def score_reply(vf_task: Any, messages: list[dict[str, Any]], text: str, *, what: str = "the task") -> float:
    """The rubric's verdict on the one reply ``text`` to ``messages``."""
    return await score_conversation(vf_task, [*messages, {"role": "assistant", "content": text}], len(messages),
                                    what=what)


async def score_conversation(vf_task: Any, conversation: list[dict[str, Any]], prompt_len: int, *,
                             what: str = "the task") -> float:
    """The rubric's verdict (``trace.reward``, its rewards' weighted sum) on
    ``conversation``, recorded on a ``vf.Trace`` as verifiers records one: the first
    ``prompt_len`` messages the prompt, each later assistant message a sampled turn."""
    vf = _vf()
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    trace = vf.Trace(task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key,
                                    hash=vf_task.hash),
                     agent=AgentInfo(config=vf.AgentConfig()))
    for i, message in enumerate(conversation):
        if message.get("tool_calls"):  # verifiers' ToolCall is flat: name and arguments beside the id
            message = {**message, "tool_calls": [{"id": c["id"], **c["function"]} for c in message["tool_calls"]]}
        trace.nodes.append(MessageNode.model_validate({"parent": i - 1 if i else None, "message": message,
                                                       "sampled": i >= prompt_len and message["role"] == "assistant"}))
    trace.is_completed = trace.ok = True
    await vf_task.score(trace)
    missing = [name for name, r in trace.rewards.items() if r is None]
    if missing:
        raise RuntimeError(f"{what}: the rubric left rewards {missing} unscored")
    return float(trace.reward)
