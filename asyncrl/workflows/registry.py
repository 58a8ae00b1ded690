"""Build what a config names: the task splits, the reward function, the workflow
(built-in by name, or a user's ``module:Class``)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from asyncrl.config import Config, ConfigError
from asyncrl.plugins import load_named
from asyncrl.tasks import default_reward_fn, load_tasks, resolve_reward_fn
from asyncrl.tasks.base import RewardFn, TaskSplits
from asyncrl.workflows.base import Workflow
from asyncrl.workflows.single_turn import SingleTurnWorkflow


def build_tasks(cfg: Config) -> TaskSplits:
    """The task splits, with any dataset problem reported as a config error (exit 2)."""
    t = cfg.task
    try:
        return load_tasks(t.name, path=t.path, validation_path=t.validation_path, seed=cfg.seed,
                          num_train=t.num_train, num_validation=t.num_validation)
    except ValueError as exc:  # TaskDataError included: it names the file and line
        raise ConfigError(f"task: {exc}") from None


def build_reward_fn(cfg: Config) -> RewardFn:
    try:
        return resolve_reward_fn(cfg.task.reward_fn) if cfg.task.reward_fn else default_reward_fn(cfg.task.name)
    except ValueError as exc:
        raise ConfigError(f"task.reward_fn: {exc}") from None


def build_workflow(cfg: Config) -> Workflow:
    name = cfg.workflow.name
    if name == "single_turn":
        return SingleTurnWorkflow(build_reward_fn(cfg), use_chat_template=cfg.workflow.use_chat_template,
                                  reward_timeout_s=cfg.workflow.timeout_s)
    if ":" not in name:
        raise ConfigError(f"workflow.name {name!r}: expected 'single_turn' or 'module:Class'")
    try:
        workflow = load_named(name, key="workflow.name")()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not callable(getattr(workflow, "run", None)):
        raise ConfigError(f"workflow.name {name!r} has no run(task, llm) method")
    return workflow


def check_tokenizer(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse, before any work, a chat workflow over a tokenizer that cannot render chats."""
    if cfg.workflow.name == "single_turn" and cfg.workflow.use_chat_template and tokenizer.chat_template is None:
        raise ConfigError(f"model.path {cfg.model.path!r}: its tokenizer has no chat template, which "
                          "workflow.use_chat_template=true needs (set it to false to send raw prompts)")
