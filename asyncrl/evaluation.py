"""Scoring a policy on a task's validation split: mean reward and pass@k.

``evaluate`` is shared by ``asyncrl eval`` and by the trainer's periodic evaluation.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from asyncrl.client import LLMClient
from asyncrl.config import Config, save_config
from asyncrl.engine import RolloutEngine, require_engine
from asyncrl.policy import check_policy, load_policy
from asyncrl.tasks.base import Task
from asyncrl.types import Episode, SamplingParams
from asyncrl.workflows.base import Workflow, run_episode
from asyncrl.workflows.registry import build_tasks, check_tokenizer


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


async def evaluate(
    engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, workflow: Workflow, tasks: list[Task], *,
    samples_per_task: int, sampling: SamplingParams, timeout_s: float, max_retries: int,
    success_threshold: float = 1.0, on_episode: Callable[[Episode], None] | None = None,
) -> EvalResult:
    """Run every task ``samples_per_task`` times at once (the engine batches them)."""
    async def one(task: Task) -> Episode:
        episode = await run_episode(workflow, task, lambda: LLMClient(engine, tokenizer, sampling),
                                    timeout_s=timeout_s, max_retries=max_retries)
        if on_episode is not None:
            on_episode(episode)
        return episode

    async with asyncio.TaskGroup() as tg:
        futures = [[tg.create_task(one(task)) for _ in range(samples_per_task)] for task in tasks]
    grouped = [[f.result() for f in row] for row in futures]
    episodes = [e for row in grouped for e in row]
    ks = sorted({1, *(k for k in (2, 4, 8, 16, 32, 64) if k <= samples_per_task), samples_per_task})
    solved = [sum(e.reward >= success_threshold for e in row) for row in grouped]
    return EvalResult(
        mean_reward=sum(e.reward for e in episodes) / max(len(episodes), 1),
        pass_at={k: sum(pass_at_k(samples_per_task, c, k) for c in solved) / max(len(tasks), 1) for k in ks},
        num_tasks=len(tasks), samples_per_task=samples_per_task,
        num_errors=sum(e.status == "error" for e in episodes), episodes=episodes,
    )


def write_eval(result: EvalResult, output_dir: Path) -> None:
    (output_dir / "eval.json").write_text(json.dumps(result.summary(), indent=2) + "\n")
    with open(output_dir / "eval_samples.jsonl", "w") as f:
        for episode in result.episodes:
            f.write(json.dumps(_sample_row(episode)) + "\n")


def _sample_row(episode: Episode) -> dict:
    row = {"task_id": episode.task_id, "reward": episode.reward, "status": episode.status,
           "finish_reason": episode.finish_reason, "response": episode.metadata.get("response")}
    if episode.error:
        row["error"] = episode.error
    row["trajectories"] = [t.to_dict() for t in episode.trajectories]
    return row


def run_eval(cfg: Config) -> EvalResult:
    """``asyncrl eval``: everything is validated (model, tasks, workflow) before any
    generation starts, so bad input fails fast with exit status 2."""
    from asyncrl.runtime.rollout_worker import RolloutWorker  # it builds on this module

    require_engine(cfg.engine)
    if cfg.engine == "vllm":  # vLLM loads the weights itself
        model, tokenizer = None, check_policy(cfg.model)
    else:
        model, tokenizer = load_policy(cfg.model)
    check_tokenizer(cfg, tokenizer)
    tasks = build_tasks(cfg).validation[: cfg.eval.num_tasks]
    worker = RolloutWorker(cfg, model=model, tokenizer=tokenizer, seed=cfg.seed)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, output_dir / "config.yaml")

    async def main() -> EvalResult:
        total = len(tasks) * cfg.eval.samples_per_task
        with tqdm(total=total, desc="eval", unit="sample", dynamic_ncols=True) as bar:
            rewards: list[float] = []

            def progress(episode: Episode) -> None:
                rewards.append(episode.reward)
                bar.update()
                bar.set_postfix(reward=f"{sum(rewards) / len(rewards):.3f}", refresh=False)

            try:
                await worker.start()
                return await worker.evaluate(tasks, on_episode=progress)
            finally:
                await worker.shutdown()

    result = asyncio.run(main())
    write_eval(result, output_dir)
    return result
