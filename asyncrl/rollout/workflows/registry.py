"""Build what a config names: the task splits, the reward function, the workflow
(built-in by name, or a user's class).

The workflow constructor contract. ``workflow.name`` is ``single_turn`` or a class named
``module:Class`` or ``path/to/file.py:Class``; the class is called

- ``Class(ctx, **workflow.options)`` when its signature accepts that (``ctx`` its first
  positional parameter): ``ctx`` is a :class:`WorkflowContext` (the reward function
  resolved from ``task.reward_fn`` or the task's default, the reward timeout, the
  chat-template switch); or else
- ``Class(**workflow.options)``: a class that needs nothing from the run (a
  ``MultiTurnWorkflow`` subclass that scores by itself, or any class with a
  no-argument constructor when there are no options).

Options are keyword arguments so that the class's own signature names, defaults and
checks them: ``workflow.options.max_turn=3`` against ``__init__(self, ctx, *, max_turns=4)``
exits 2 naming ``workflow.name`` and the stray keyword, before any work. A constructor may
refuse its configuration by raising ``ValueError`` (also exit 2, with its message); any
other exception is a bug in the class and fails the run with its traceback.
See ``examples/retry/workflow.py`` for a complete multi-turn workflow.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.config import Config, ConfigError
from asyncrl.rollout.gateway.server import Gateway
from asyncrl.rollout.gateway.tool_calls import check_format_name
from asyncrl.plugins import load_named
from asyncrl.tasks.from_config import build_reward_fn, build_tasks
from asyncrl.rollout.workflows.base import Workflow, WorkflowContext
from asyncrl.rollout.workflows.openai_agent import OpenAIAgentWorkflow
from asyncrl.rollout.workflows.single_turn import SingleTurnWorkflow

__all__ = ["build_context", "build_reward_fn", "build_tasks", "build_workflow", "check_tokenizer"]


def build_context(cfg: Config) -> WorkflowContext:
    """What a user's workflow class gets from the run (its ``ctx``)."""
    has_reward = cfg.task.reward_fn is not None or cfg.task.name not in ("jsonl", "hf")
    return WorkflowContext(reward_fn=build_reward_fn(cfg) if has_reward else None,
                           reward_timeout_s=cfg.workflow.timeout_s, use_chat_template=cfg.workflow.use_chat_template)


def build_workflow(cfg: Config, gateway: Gateway | None = None) -> Workflow:
    """``gateway``: the rollout worker's, which ``openai_agent`` sessions run on (None
    where the workflow is only being checked)."""
    name, options = cfg.workflow.name, cfg.workflow.options
    if name == "openai_agent":
        if not cfg.workflow.agent:
            raise ConfigError("workflow.name 'openai_agent' needs workflow.agent: your agent as module:function "
                              "or path/to/file.py:function, async def run(task, base_url) -> float")
        if cfg.task.reward_fn is not None:
            raise ConfigError("task.reward_fn: with workflow.name 'openai_agent' the agent returns the reward")
        if options:
            raise ConfigError(f"workflow.options {options}: workflow 'openai_agent' takes none (configure your agent "
                              "in its own code)")
        try:
            check_format_name(cfg.gateway.tool_parser)  # auto is read from the chat template once it is loaded
            return OpenAIAgentWorkflow(load_named(cfg.workflow.agent, key="workflow.agent"), gateway)
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from None
    if name == "single_turn":
        if options:
            raise ConfigError(f"workflow.options {options}: workflow 'single_turn' takes no options")
        return SingleTurnWorkflow(build_reward_fn(cfg), use_chat_template=cfg.workflow.use_chat_template,
                                  reward_timeout_s=cfg.workflow.timeout_s)
    if ":" not in name:
        raise ConfigError(f"workflow.name {name!r}: expected 'single_turn', 'openai_agent', 'module:Class' or "
                          "'path/to/file.py:Class'")
    try:
        cls = load_named(name, key="workflow.name")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    args = _constructor_args(cls, name, options, build_context(cfg))
    try:
        workflow = cls(*args, **options)
    except ValueError as exc:  # the class refusing its configuration
        raise ConfigError(f"workflow.name {name!r}: {exc}") from None
    if not callable(getattr(workflow, "run", None)):
        raise ConfigError(f"workflow.name {name!r} has no run(task, llm) method")
    return workflow


def _constructor_args(cls: Any, name: str, options: dict[str, Any], ctx: WorkflowContext) -> tuple[Any, ...]:
    """``(ctx,)`` or ``()``, whichever the class's signature accepts with ``options``; a
    ``ConfigError`` naming ``workflow.name`` when neither does."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature (a C type): the contract's first form
        return (ctx,)
    try:
        signature.bind(ctx, **options)
        return (ctx,)
    except TypeError as with_ctx:
        try:
            signature.bind(**options)
            return ()
        except TypeError as without_ctx:
            params = signature.parameters
            positional = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                             for p in params.values())
            reason = with_ctx if positional else without_ctx  # the form the class was written for
            hint = ""
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                for key in (k for k in options if k not in params):
                    close = difflib.get_close_matches(key, list(params), n=1, cutoff=0.6)
                    hint += f"; workflow.options.{key}: did you mean {close[0]!r}?" if close else ""
            shown = signature.replace(return_annotation=inspect.Signature.empty)
            raise ConfigError(
                f"workflow.name {name!r}: cannot call {getattr(cls, '__qualname__', cls)}{shown} with "
                f"workflow.options {options}: {reason}{hint}. A workflow class is called as Class(ctx, **options) "
                "(ctx: asyncrl.rollout.workflows.WorkflowContext) or Class(**options)") from None


def check_tokenizer(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse, before any work, a chat workflow over a tokenizer that cannot render chats."""
    if cfg.workflow.name == "single_turn" and cfg.workflow.use_chat_template and tokenizer.chat_template is None:
        raise ConfigError(f"model.path {cfg.model.path!r}: its tokenizer has no chat template, which "
                          "workflow.use_chat_template=true needs (set it to false to send raw prompts)")
