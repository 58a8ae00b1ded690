"""``task.name: verifiers``: train on a `verifiers` taskset (prime-rl's environment format,
``pip install -e ".[verifiers]"``), its own tasks and its own rubric, unchanged.

This is the task source and its scoring: ``load_verifiers_splits`` loads the taskset that
``task.options.environment`` names — an installed taskset package id (what ``vf-run <id>``
takes, e.g. ``reverse-text``) or ``path/to/file.py`` exporting its ``vf.Taskset`` subclass
in ``__all__`` — with ``task.options.config`` as its ``TasksetConfig`` fields. Its tasks in
``load()`` order are the rows: the last ``num_validation`` held out, the first
``num_train`` (0: all) of the rest trained on. ``prompt_messages`` is what a task asks,
``score_conversation`` what its rubric (its ``@vf.reward`` methods and judges,
``Task.score``) makes of a conversation: ``trace.reward``, the weighted sum.

The episode — the conversation with the model through the gateway, the task's tools
answered — is an agent on the rollout side, ``asyncrl/rollout/workflows/verifiers_agent.py``
(``workflow.agent: asyncrl.rollout.workflows.verifiers_agent:run``).

What it does not run: verifiers' own harnesses (the programs, e.g. ``bash`` or
``claude_code``, that verifiers launches in a runtime through its interception server),
toolsets that need a runtime or state channel of their own, multi-agent ``Env``s
(``user-sim``), and runtime-dependent rewards (a reward that takes a ``runtime`` argument
is skipped, as ``Task.score`` does offline).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from asyncrl.plugins import _import_file
from asyncrl.tasks.base import Task, TaskSplits

INSTALL_HINT = 'pip install -e ".[verifiers]"  (the `verifiers` package, verifiers>=0.4)'
DEFAULT_MAX_TURNS = 4  # model calls per episode, where the taskset's tools keep being called
_loaded: dict[str, list[Any]] = {}  # (environment, config) as JSON -> the taskset's tasks


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
            taskset_id = "" if environment.endswith(".py") else environment
            taskset = cls(config_type.model_validate({**config, "id": taskset_id}))
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
