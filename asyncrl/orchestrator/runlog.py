"""Where a run's numbers go — the one place a step is logged: ``metrics.jsonl`` (one
object per optimizer step, in step order), ``samples.jsonl`` (one per trained
trajectory), ``timeline.jsonl`` (when each group was generated, each step trained, each
weight sync and evaluation ran: what the report's overlap timeline draws),
``errors.jsonl`` (failed episode attempts, capped per step), ``eval_samples.jsonl`` (each
evaluation episode as it finishes, with the step evaluated), TensorBoard or W&B when
asked, and a live progress bar.

A step whose evaluation runs in the background is queued until that evaluation ends;
later steps queue behind it, so ``metrics.jsonl`` stays in step order and each step
appears once, with its ``eval/*`` keys.

A row that cannot be written fails the run (exit 1) naming its step, wherever the write
happens: on the train loop's own call, or in the evaluation's completion callback, where
an exception would otherwise go to the event loop's handler, be printed and lost while
the run went on and exited 0. That one is kept (:attr:`RunLog.failure`) and raised by
:meth:`RunLog.failed`, which the trainer runs beside training, and by the next
:meth:`RunLog.step` or :meth:`RunLog.flushed`. After a failure no row is written: the rows
on disk are those before it, in order, each once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from asyncrl.config import Config, ConfigError
from asyncrl.types import Episode

LOG_FILES = ("metrics.jsonl", "samples.jsonl", "timeline.jsonl", "errors.jsonl", "eval_samples.jsonl")


class LogWriteError(RuntimeError):
    """A step's row could not be written (``metrics.jsonl``, TensorBoard, W&B): the run fails."""


class RunLog:
    def __init__(self, cfg: Config, output_dir: Path, resume_step: int | None = None) -> None:
        self.tensorboard = None
        self.wandb = None
        if cfg.logging.tensorboard:  # the optional loggers first: a missing extra fails before a file is opened
            with _extra("logging.tensorboard=true", "tensorboard"):
                from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))
        if cfg.logging.wandb:
            with _extra("logging.wandb=true", "wandb"):
                import wandb

            self.wandb = wandb.init(project=cfg.logging.wandb_project, dir=str(output_dir),
                                    config=cfg.model_dump())
        # A fresh run starts fresh files: appending would splice two runs under one config.
        # A resumed one appends to files already rolled back to its checkpoint.
        mode = "w" if resume_step is None else "a"
        self.files = {name: open(output_dir / name, mode) for name in LOG_FILES}
        self.max_errors_per_step = cfg.logging.max_errors_per_step
        self.errors_unlogged = 0
        self._shown: dict[str, str] = {}  # the bar's figures: the latest of each, eval's kept between evals
        self._errors_at: Counter[int] = Counter()
        self._queue: deque[tuple[dict[str, Any], asyncio.Future[dict[str, Any]] | None]] = deque()
        self.failure: LogWriteError | None = None  # the first row that could not be written
        self._failed = asyncio.Event()
        self._label = f"train[{cfg.mode}]"
        self.bar = tqdm(total=cfg.total_steps, initial=resume_step or 0, desc=self._label, unit="step",
                        dynamic_ncols=True)

    # -- metrics, in step order -----------------------------------------------
    def step(self, row: dict[str, Any], evaluation: asyncio.Future[dict[str, Any]] | None = None) -> None:
        """Queue a step's row; it is written once ``evaluation`` (if any) has its ``eval/*`` keys.
        Raises :class:`LogWriteError` for this row, or for an earlier one that failed."""
        self._raise_failure()
        self._queue.append((row, evaluation))
        if evaluation is not None:
            evaluation.add_done_callback(self._drain_after_evaluation)
        self._drain()

    async def flushed(self) -> None:
        """Every queued row written (before a checkpoint, at the end of a run); raises
        :class:`LogWriteError` if one could not be."""
        pending = [ev for _, ev in self._queue if ev is not None]
        if pending:
            await asyncio.wait(pending)
        self._drain()
        self._raise_failure()

    async def failed(self) -> None:
        """Raises the first :class:`LogWriteError` of a row written in an evaluation's
        completion callback once there is one; until then it waits. Run beside training,
        so that such a failure stops the run at once, as one on the train loop's call does."""
        await self._failed.wait()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _drain_after_evaluation(self, _: asyncio.Future[dict[str, Any]]) -> None:
        """The evaluation's completion callback: nothing it raises may reach the event loop's
        handler, which would print it and let the run go on."""
        with contextlib.suppress(LogWriteError):  # kept in self.failure: failed() raises it
            self._drain()

    def _drain(self) -> None:
        while self._queue and self.failure is None:
            row, evaluation = self._queue[0]
            if evaluation is not None:
                if not evaluation.done() or (not evaluation.cancelled() and evaluation.exception() is not None):
                    return  # a failed evaluation fails the run through its task group
                if not evaluation.cancelled():  # cancelled: cut short by a stop, the row is written without it
                    row = {**row, **evaluation.result()}
            self._queue.popleft()
            try:
                self._write_metrics(row)
            except Exception as exc:
                written = "once its evaluation had finished" if evaluation is not None else "at the end of the step"
                self.failure = LogWriteError(f"writing the metrics row of step {row['step']} ({written}) failed: "
                                             f"{type(exc).__name__}: {exc}")
                self._failed.set()
                raise self.failure from exc

    def _write_metrics(self, row: dict[str, Any]) -> None:
        self._write("metrics.jsonl", [row])
        step = row["step"]
        if self.tensorboard is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        shown = {"reward": "reward/mean", "eval": "eval/reward_mean", "stale": "staleness/mean",
                 "samples/s": "throughput/samples_per_s", "errors": "rollout/episodes_error_total",
                 "filtered": "rollout/groups_filtered_total", "mismatch": "mismatch/k3_lag0"}
        self._shown.update({k: f"{row[v]:.3g}" for k, v in shown.items() if row.get(v) is not None})
        self.bar.set_postfix(self._shown)

    def starved(self, status: str | None) -> None:
        """The bar's label says when the learner starves (``status``: why), None when not."""
        self.bar.set_description(self._label + (f" STARVED ({status})" if status else ""))

    # -- the other files --------------------------------------------------------
    def samples(self, rows: list[dict[str, Any]]) -> None:
        self._write("samples.jsonl", rows)

    def eval_samples(self, rows: list[dict[str, Any]]) -> None:
        """Scored evaluation episodes, each as it finishes (an evaluation cut short keeps its rows)."""
        self._write("eval_samples.jsonl", rows)

    def event(self, kind: str, start: float, end: float, **extra: Any) -> None:
        """An interval of work; times are seconds since the run started."""
        self._write("timeline.jsonl", [{"kind": kind, "start": start, "end": end, **extra}])

    def errors(self, step: int, phase: str, episode: Episode) -> None:
        """Each failed attempt of ``episode`` (also of one a retry saved), up to the cap per step."""
        for error in episode.errors:
            if self._errors_at[step] >= self.max_errors_per_step:
                self.errors_unlogged += 1
                continue
            self._errors_at[step] += 1
            self._write("errors.jsonl", [{"step": step, "phase": phase, "task_id": episode.task_id,
                                          "attempt": error.attempt, "exception": error.exception,
                                          "traceback": error.traceback}])

    def _write(self, name: str, rows: list[dict[str, Any]]) -> None:
        f = self.files[name]
        f.writelines(json.dumps(_strict_json(r), allow_nan=False) + "\n" for r in rows)
        f.flush()

    def close(self) -> None:
        self.bar.close()
        for f in self.files.values():
            f.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


@contextlib.contextmanager
def _extra(setting: str, extra: str) -> Iterator[None]:
    """An optional package a setting needs, missing: a usage error (exit 2) saying how to
    install it, before any step."""
    try:
        yield
    except ImportError as exc:
        raise ConfigError(f"{setting} needs the {extra!r} extra ({exc}): pip install -e '.[{extra}]', or set "
                          f"{setting.split('=')[0]}=false") from None


def _strict_json(value: Any) -> Any:
    """``value`` with every NaN or infinity as ``null``: Python's ``json`` writes them as bare
    ``NaN``/``Infinity``, which other JSON readers refuse (a mean over no rewards is NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value
