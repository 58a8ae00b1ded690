"""``asyncrl eval``: score a policy on a task's validation split, with the same pre-flight,
runtime and episode bound as training, and a progress bar."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tqdm import tqdm

from asyncrl.config import Config, save_config
from asyncrl.rollout.eval_scoring import EvalResult, write_eval
from asyncrl.orchestrator.preflight import preflight
from asyncrl.runtime import start
from asyncrl.tasks.base import TaskSplits
from asyncrl.types import Episode


def run_eval(cfg: Config, splits: TaskSplits | None = None) -> EvalResult:
    """Everything is validated (model, tasks, workflow) before any generation starts, so
    bad input fails fast with exit status 2; the results go to ``eval.json`` and
    ``eval_samples.jsonl`` in ``output_dir``. ``splits``: from ``check_inputs``, where it ran."""
    checked = preflight(cfg, "eval", splits)
    tasks = checked.splits.validation[: cfg.eval.num_tasks]
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, output_dir / "config.yaml")

    async def main() -> EvalResult:
        with tqdm(total=len(tasks) * cfg.eval.samples_per_task, desc="eval", unit="sample",
                  dynamic_ncols=True) as bar:
            rewards: list[float] = []

            def progress(episode: Episode) -> None:
                rewards.append(episode.reward)
                bar.update()
                bar.set_postfix(reward=f"{sum(rewards) / len(rewards):.3f}", refresh=False)

            async with start(cfg, model=checked.model, tokenizer=checked.tokenizer, train=False) as runtime:
                return await runtime.rollout.evaluate(tasks, version=0, on_episode=progress)

    result = asyncio.run(main())
    write_eval(result, output_dir)
    return result
