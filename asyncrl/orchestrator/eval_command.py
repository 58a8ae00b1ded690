"""``asyncrl eval``: score a policy on a task's validation split, with the same pre-flight,
runtime and episode bound as training, and a progress bar. Each scored episode is
appended to ``eval_samples.jsonl`` as it finishes (flushed per line), so a stopped
evaluation keeps what it scored."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from asyncrl.config import Config, save_config
from asyncrl.orchestrator.announce import run_tool_format, template_notes
from asyncrl.orchestrator.metrics import eval_sample_row, text_decoder
from asyncrl.orchestrator.preflight import preflight
from asyncrl.rollout.eval_scoring import EvalResult, write_eval
from asyncrl.runtime import start
from asyncrl.tasks.base import TaskSplits
from asyncrl.types import Episode

EVAL_SAMPLES_FILE = "eval_samples.jsonl"


def run_eval(cfg: Config, splits: TaskSplits | None = None) -> EvalResult:
    """Everything is validated (model, tasks, workflow) before any generation starts, so
    bad input fails fast with exit status 2; the results go to ``eval.json`` and
    ``eval_samples.jsonl`` in ``output_dir`` (the latter row by row as episodes finish,
    then rewritten in (task, sample) order at the end). ``splits``: from ``check_inputs``,
    where it ran."""
    checked = preflight(cfg, "eval", splits)
    tasks = checked.splits.validation[: cfg.eval.num_tasks]
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, output_dir / "config.yaml")
    tokenizer, tool_format = checked.tokenizer, run_tool_format(cfg, checked.tokenizer)
    notes = template_notes(tokenizer, templated=cfg.workflow.use_chat_template, tool_format=tool_format)
    print("\n".join([f"asyncrl eval → {output_dir}", *(f"  {note}" for note in notes)]), file=sys.stderr, flush=True)

    def row(episode: Episode) -> dict:
        return eval_sample_row(episode, 0, text_decoder(tokenizer), tool_format)

    async def main(samples: TextIO) -> EvalResult:
        with tqdm(total=len(tasks) * cfg.eval.samples_per_task, desc="eval", unit="sample",
                  dynamic_ncols=True) as bar:
            rewards: list[float] = []

            def progress(episode: Episode) -> None:
                samples.write(json.dumps(row(episode)) + "\n")
                samples.flush()
                rewards.append(episode.reward)
                bar.update()
                bar.set_postfix(reward=f"{sum(rewards) / len(rewards):.3f}", refresh=False)

            async with start(cfg, model=checked.model, tokenizer=tokenizer, train=False) as runtime:
                return await runtime.rollout.evaluate(tasks, version=0, on_episode=progress)

    with open(output_dir / EVAL_SAMPLES_FILE, "w") as samples:
        result = asyncio.run(main(samples))
    write_eval(result, output_dir, [row(episode) for episode in result.episodes])
    return result
