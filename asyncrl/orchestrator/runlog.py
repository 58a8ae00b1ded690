"""Where a run's numbers go: ``metrics.jsonl`` (one object per optimizer step),
``samples.jsonl`` (one per trained trajectory), ``timeline.jsonl`` (when each group was
generated, each step trained, each weight sync and evaluation ran: what the report's
overlap timeline draws), TensorBoard or W&B when asked, and a live progress bar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from asyncrl.config import Config


class RunLog:
    def __init__(self, cfg: Config, output_dir: Path, total_steps: int, resume_step: int | None = None) -> None:
        # A fresh run starts fresh files: appending would splice two runs under one config.
        # A resumed one appends to files already rolled back to its checkpoint.
        mode = "w" if resume_step is None else "a"
        self.metrics_file = open(output_dir / "metrics.jsonl", mode)
        self.samples_file = open(output_dir / "samples.jsonl", mode)
        self.timeline_file = open(output_dir / "timeline.jsonl", mode)
        self.bar = tqdm(total=total_steps, initial=resume_step or 0, desc=f"train[{cfg.mode}]", unit="step",
                        dynamic_ncols=True)
        self.tensorboard = None
        self.wandb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))
        if cfg.logging.wandb:
            import wandb  # optional dependency

            self.wandb = wandb.init(project=cfg.logging.wandb_project, dir=str(output_dir),
                                    config=cfg.model_dump())

    def metrics(self, row: dict[str, Any]) -> None:
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        step = row["step"]
        if self.tensorboard is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if step > 0:
            self.bar.update(step - self.bar.n)
        shown = {"reward": "reward/mean", "eval": "eval/reward_mean", "stale": "staleness/mean",
                 "samples/s": "throughput/samples_per_s"}
        self.bar.set_postfix({k: f"{row[v]:.3g}" for k, v in shown.items() if v in row})

    def samples(self, rows: list[dict[str, Any]]) -> None:
        self.samples_file.writelines(json.dumps(r) + "\n" for r in rows)
        self.samples_file.flush()

    def event(self, kind: str, start: float, end: float, **extra: Any) -> None:
        """An interval of work; times are seconds since the run started."""
        self.timeline_file.write(json.dumps({"kind": kind, "start": start, "end": end, **extra}) + "\n")
        self.timeline_file.flush()

    def close(self) -> None:
        self.bar.close()
        self.timeline_file.close()
        self.metrics_file.close()
        self.samples_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
