"""Deprecated path (``workflow.agent: asyncrl.tasks.verifiers_env:run`` was taught): the
tasks and the rubric are ``asyncrl.tasks.verifiers_tasks``, the agent is
``asyncrl.rollout.workflows.verifiers_agent`` (the rollout side). Imports both, warning."""

from asyncrl import moved
from asyncrl.rollout.workflows.verifiers_agent import TasksetTools, converse, run
from asyncrl.tasks.verifiers_tasks import (
    DEFAULT_MAX_TURNS,
    INSTALL_HINT,
    load_verifiers_splits,
    prompt_messages,
    score_conversation,
    score_reply,
    verifiers_tasks,
)

__all__ = ["DEFAULT_MAX_TURNS", "INSTALL_HINT", "TasksetTools", "converse", "load_verifiers_splits", "prompt_messages",
           "run", "score_conversation", "score_reply", "verifiers_tasks"]

moved.warn(__name__, "asyncrl.rollout.workflows.verifiers_agent (run) and asyncrl.tasks.verifiers_tasks")
