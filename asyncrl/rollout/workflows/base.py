"""The workflow contract and the runner that keeps a failing workflow from taking a run down.

A workflow is one async method, ``run(task, llm) -> Episode``. ``run_episode`` wraps it:
a workflow (or the reward function inside it) that raises or runs past its timeout is
retried up to a limit, then returned as an episode with status ``error`` that keeps the
exception and traceback. Only cancellation and a dead engine propagate: those are the
run's failures, not the workflow's.

The timeout counts the attempt's time without progress, not its waits for engine calls
that move — queued at a working engine, or receiving tokens (``asyncrl/rollout/deadline.py``):
under load a healthy episode waits there behind hundreds of others, and only a stuck one
should time out.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from asyncrl.rollout.client import LLMClient
from asyncrl.engine.protocol import EngineClosedError
from asyncrl.rollout.deadline import EpisodeDeadline
from asyncrl.rollout.journal import Journal
from asyncrl.tasks.base import RewardFn, Task
from asyncrl.types import AttemptError, Episode


class Workflow(Protocol):
    async def run(self, task: Task, llm: LLMClient) -> Episode: ...


@dataclass(frozen=True)
class WorkflowContext:
    """What a run hands a ``module:Class`` workflow besides its own ``workflow.options``:
    ``Class(ctx, **options)``. One object rather than more keyword arguments, so a field
    added here later breaks no user's constructor."""

    reward_fn: RewardFn | None
    """From ``task.reward_fn``, else the task's built-in reward; ``None`` for a ``jsonl``
    task without ``task.reward_fn`` (then the workflow scores by itself, or refuses in
    its constructor with a ``ValueError``, which exits 2)."""
    reward_timeout_s: float
    """``workflow.timeout_s``: pass it to ``score(ctx.reward_fn, task, text, timeout_s=...)``."""
    use_chat_template: bool
    """``workflow.use_chat_template``."""


async def run_episode(
    workflow: Workflow, task: Task, make_client: Callable[[], LLMClient], *, timeout_s: float, max_retries: int,
    seed: Callable[[int], int] | None = None, journal: Callable[[int], Journal] | None = None,
) -> Episode:
    """Run ``workflow`` on ``task`` with a fresh client per attempt; never raises for a
    workflow's own failure. ``seed(attempt)`` (attempts count from 1): the sampling seed
    of that attempt's client, so each attempt samples anew and every one reproducibly.
    ``journal(attempt)``: where that attempt's client records what it generates (and what
    it replays after a restart: ``asyncrl/rollout/journal.py``). ``timeout_s``: each
    attempt's deadline (``EpisodeDeadline``), handed to its client as ``llm.deadline``."""
    error, errors = "", []
    for attempt in range(1, max_retries + 2):
        start = time.perf_counter()
        llm = make_client()
        if seed is not None:
            llm.sampling = dataclasses.replace(llm.sampling, seed=seed(attempt))
        if journal is not None:
            llm.journal = journal(attempt)
        llm.deadline = EpisodeDeadline(timeout_s)
        try:
            async with llm.deadline:
                episode = await workflow.run(task, llm)
        except EngineClosedError:
            raise
        except Exception as exc:  # TimeoutError included; kept, counted, retried
            timed_out = isinstance(exc, TimeoutError)
            kind = "timed out" if timed_out else "raised"
            trace = "".join(traceback.format_exception(exc))
            error = f"workflow {type(workflow).__name__} {kind} on task {task.id} (attempt {attempt}):\n{trace}"
            errors.append(AttemptError(attempt, f"{type(exc).__name__}: {exc}" if str(exc) else
                                       f"{type(exc).__name__} ({kind})", trace, timed_out=timed_out))
            continue
        if not isinstance(episode, Episode):
            error = f"workflow {type(workflow).__name__}.run returned {type(episode).__name__}, not Episode"
            errors.append(AttemptError(attempt, f"TypeError: {error}", ""))
            continue
        episode.attempts, episode.errors = attempt, errors
        if llm.template_rewrites:
            episode.metadata["template_rewrites"] = llm.template_rewrites
        episode.timings.setdefault("total_s", time.perf_counter() - start)
        return episode
    return Episode(task_id=task.id, trajectories=llm.trajectories, status="error", error=error,
                   attempts=max_retries + 1, errors=errors)
