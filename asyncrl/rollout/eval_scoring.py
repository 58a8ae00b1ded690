"""Scoring a policy on tasks: mean reward and pass@k, with a bound on episodes in flight.

``evaluate`` knows nothing of engines or runtimes: it is handed a function that runs one
episode of a task (the rollout worker binds the engine, the workflow and the shared
episode bound into it). ``asyncrl eval``, the trainer's evaluations and the supervised
warm-up's scoring all come through here.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import Task
from asyncrl.types import Episode


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c succeeded: 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalResult:
    mean_reward: float
    pass_at: dict[int, float]
    num_tasks: int
    samples_per_task: int
    num_errors: int
    episodes: list[Episode]

    @classmethod
    def merge(cls, parts: list[EvalResult]) -> EvalResult:
        """One result from disjoint shards of the tasks (scored by different workers)."""
        episodes = [e for p in parts for e in p.episodes]
        tasks = sum(p.num_tasks for p in parts)
        return cls(
            mean_reward=sum(e.reward for e in episodes) / max(len(episodes), 1),
            pass_at={k: sum(p.pass_at[k] * p.num_tasks for p in parts) / max(tasks, 1) for k in parts[0].pass_at},
            num_tasks=tasks, samples_per_task=parts[0].samples_per_task,
            num_errors=sum(p.num_errors for p in parts), episodes=episodes)

    def summary(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"mean_reward": self.mean_reward}
        out.update({f"pass@{k}": v for k, v in self.pass_at.items()})
        out.update(num_tasks=self.num_tasks, samples_per_task=self.samples_per_task, num_errors=self.num_errors)
        return out


EVAL_SAMPLE = "eval_sample"
"""``Episode.metadata`` key :func:`evaluate` sets on each episode it runs: the sample's index
among its task's (0 to ``samples_per_task`` - 1), so a row written as the episode ends,
before the whole result is in order, names it."""


async def evaluate(
    run_episode: Callable[..., Awaitable[Episode]], tasks: list[Task], *, samples_per_task: int,
    max_concurrent: int, success_threshold: float = 1.0, on_episode: Callable[[Episode], None] | None = None,
    indexed: bool = False,
) -> EvalResult:
    """Run every task ``samples_per_task`` times, never more than ``max_concurrent``
    episodes at once: ``max_concurrent`` runners pull (task, sample) pairs in order, so a
    service behind the workflow sees a bounded load however many tasks there are.
    ``run_episode(task)``, or with ``indexed`` ``run_episode(task, sample)`` (the sample's
    index among the task's, to seed it). Episodes come back in (task, sample) order,
    whatever order they finished in."""
    if max_concurrent < 1:
        raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
    grouped: list[list[Episode | None]] = [[None] * samples_per_task for _ in tasks]
    todo = iter([(i, task, s) for i, task in enumerate(tasks) for s in range(samples_per_task)])

    async def runner() -> None:
        for i, task, s in todo:  # one shared iterator: each pair is taken by exactly one runner
            episode = await (run_episode(task, s) if indexed else run_episode(task))
            episode.metadata[EVAL_SAMPLE] = s
            grouped[i][s] = episode
            if on_episode is not None:
                on_episode(episode)

    async with asyncio.TaskGroup() as tg:
        for _ in range(min(max_concurrent, len(tasks) * samples_per_task)):
            tg.create_task(runner())
    episodes = [e for row in grouped for e in row if e is not None]  # every one is, once the runners are done
    ks = sorted({1, *(k for k in (2, 4, 8, 16, 32, 64) if k <= samples_per_task), samples_per_task})
    solved = [sum(e is not None and e.reward >= success_threshold for e in row) for row in grouped]
    return EvalResult(
        mean_reward=sum(e.reward for e in episodes) / max(len(episodes), 1),
        pass_at={k: sum(pass_at_k(samples_per_task, c, k) for c in solved) / max(len(tasks), 1) for k in ks},
        num_tasks=len(tasks), samples_per_task=samples_per_task,
        num_errors=sum(e.status == "error" for e in episodes), episodes=episodes,
    )


def write_eval(result: EvalResult, output_dir: Path, rows: list[dict[str, Any]]) -> None:
    """``eval.json`` (the scores) and ``eval_samples.jsonl`` rewritten whole from ``rows``
    (every episode's, in (task, sample) order, where the evaluation appended them in the
    order they finished), through a temporary file: a crash here leaves the appended ones."""
    (output_dir / "eval.json").write_text(json.dumps(result.summary(), indent=2) + "\n")
    tmp = output_dir / "eval_samples.jsonl.tmp"
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, output_dir / "eval_samples.jsonl")
