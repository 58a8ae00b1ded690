"""Workflows: ``async run(task, llm) -> Episode``, and the runner that contains their failures."""

from asyncrl.workflows.base import Workflow, WorkflowContext, run_episode
from asyncrl.workflows.multi_turn import MultiTurnWorkflow
from asyncrl.workflows.single_turn import SingleTurnWorkflow, score

__all__ = ["MultiTurnWorkflow", "SingleTurnWorkflow", "Workflow", "WorkflowContext", "run_episode", "score"]
