"""Deprecated path of :mod:`asyncrl.rollout.workflows` (moved with the rollout side; the
retry example taught ``from asyncrl.workflows import MultiTurnWorkflow, WorkflowContext,
score``). Imports it and the modules it had then, warning."""

from asyncrl import moved
from asyncrl.rollout import workflows
from asyncrl.rollout.workflows import base, multi_turn, openai_agent, registry, single_turn

moved.alias(__name__, workflows, base, multi_turn, openai_agent, registry, single_turn)
