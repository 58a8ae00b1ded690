"""Workflows: ``async run(task, llm) -> Episode``, and the runner that contains their failures."""

from asyncrl.rollout.workflows.base import Workflow, WorkflowContext, run_episode
from asyncrl.rollout.workflows.multi_turn import MultiTurnWorkflow
from asyncrl.rollout.workflows.single_turn import SingleTurnWorkflow, score

__all__ = ["MultiTurnWorkflow", "SingleTurnWorkflow", "Workflow", "WorkflowContext", "run_episode", "score"]
