"""Pre-flight's first phase: the inputs a config names, checked with neither torch nor the
model loaded, so a mistake in them is reported in about a second rather than after the
weights load (``asyncrl train`` and ``eval`` run it before importing the trainer).

Checked here: the data files and their rows and columns (``task.path``, ``hf``'s schemas),
the reward functions (``task.reward_fn``: the module or file imports, the function is
there, its parameters fit one of the reward forms and the dataset's columns, the weights
fit the list), the agent (``workflow.agent``: it loads and takes ``(task, base_url)``) and
a workflow class named ``module:Class`` (it loads). Loading a user's module runs its
imports: if it imports torch, that time is the user's.

This module must stay free of torch, transformers and numpy at import (a test checks it);
``preflight.py`` runs it again as part of the whole pre-flight, or takes its result."""

from __future__ import annotations

from typing import Literal

from asyncrl.config import Config, ConfigError
from asyncrl.plugins import check_call, load_named
from asyncrl.tasks.base import TaskSplits
from asyncrl.tasks.from_config import build_reward_fn, build_tasks


def check_inputs(cfg: Config, command: Literal["train", "eval", "plan"]) -> TaskSplits:
    """The task splits, every named input checked; a ``ConfigError`` naming the key, the
    file, the column or the function (exit 2)."""
    splits = build_tasks(cfg)  # files, rows, columns; task.reward_fn against the columns
    if command != "eval" and not splits.train:
        raise ConfigError("task: the train split is empty")
    workflow = cfg.workflow
    try:
        if workflow.name == "single_turn":
            build_reward_fn(cfg)  # the task's own reward where none is named
        elif workflow.name == "openai_agent" and workflow.agent:
            check_call(load_named(workflow.agent, key="workflow.agent"), workflow.agent, key="workflow.agent",
                       args=("task", "base_url"))
        elif ":" in workflow.name:
            load_named(workflow.name, key="workflow.name")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return splits
