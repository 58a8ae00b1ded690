"""``asyncrl bench trl``: TRL's ``GRPOTrainer`` against asyncrl ``sync`` and ``async`` in
one run, same model directory, task, reward function, group size, batch and learning
rate (optional dependency ``trl``), each run in a fresh process of its own.

Matched: model and tokenizer (the same directory), Countdown train tasks (same seed),
reward function, n samples per task, tasks per step, learning rate, temperature, max
response length, ε_low/ε_high, no KL (β = 0), group-normalised advantages, token-level
loss aggregation, no zero-variance filtering. Not matched, and why: TRL generates with
``model.generate`` in the training process (asyncrl uses its own engine — that is what
is being compared); TRL computes the old-policy logprobs itself while asyncrl uses the
engine's behavior logprobs with a truncated importance weight.

Held-out time-to-target. Each system saves a Hugging Face checkpoint every ``eval_every``
steps and at its last step (asyncrl: ``save_every``; TRL: a callback calling
``save_pretrained``), stamped with the training wall time at which it was taken. After
all three runs, every checkpoint, and the start policy once (step 0, time 0, shared by
all three), is scored by the same evaluator: ``asyncrl eval``'s ``run_eval`` on the
Countdown validation split (the first ``eval_tasks`` tasks, ``eval_samples`` samples
each, the evaluator's temperature, ``max_tokens``; per-sample seeds, so every checkpoint
sees the same draws). Evaluation runs after training, so it slows none of the clocks.
Saving does run inside them, and is material: ~20 ms per TRL save (weights and
tokenizer), ~0.2 s per asyncrl save (it also writes the optimizer state and flushes the
logs), a few % of a 40-step run. So each save is timed and its duration subtracted from
every later time stamp and from ``wall_s`` (``save_s``: the total subtracted).

Target rule (``target_rule``): the held-out reward of TRL's last checkpoint. A system's
``time_to_target_s`` is the time stamp of its first checkpoint (step 0 included) whose
held-out reward reaches it, ``None`` if none does. Where TRL ends no better than it
started (``target_above_start`` false: short runs, as held-out reward moves slowly on
this task), every system is at the target at time 0 and the ratio is ``None``; the
table says so. The training reward curve stays in ``train_curve``; ``final_reward`` is
its mean over the last ``smooth`` steps.

Several batch sizes in one sitting (``batch_sizes=[4,8,16]``, groups per step; it
overrides ``batch_size``): the three systems train at each size in turn, smallest first
as listed, and each size's results go under ``sizes``, keyed ``"BxG"`` (``"4x8"``); the
top-level keys are the first size's, as for a single one. ``held_out=false``: a
speed-only run: no checkpoints are saved inside the clocks and none is scored
(``time_to_target_s`` is then ``None`` and the table says skipped).
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from asyncrl.bench.progress import phase
from asyncrl.config import EvalConfig, Section, apply_overrides, load_config, validate
from asyncrl.jsonl import read_jsonl
from asyncrl.orchestrator.eval_command import run_eval
from asyncrl.orchestrator.task_stream import TaskStream
from asyncrl.orchestrator.trainer import Trainer
from asyncrl.tasks import countdown_reward
from asyncrl.tasks.base import Task
from asyncrl.rollout.workflows.registry import build_tasks

SYSTEMS = ("trl", "asyncrl_sync", "asyncrl_async")
TARGET_RULE = "held-out reward of TRL's last checkpoint (step = steps)"


class TrlBenchSettings(Section):
    model_path: str = "models/countdown-tiny"
    steps: int = Field(40, ge=2)
    batch_size: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    lr: float = Field(3e-4, gt=0)
    max_tokens: int = Field(24, ge=1)
    smooth: int = Field(5, ge=1)
    seed: int = 0
    eval_every: int = Field(10, ge=1)
    """Steps between checkpoints scored on held-out tasks (the last step always is)."""
    eval_tasks: int = Field(128, ge=1)
    """Countdown validation tasks per held-out evaluation (the first N of the split)."""
    eval_samples: int = Field(2, ge=1)
    """Samples per validation task."""
    batch_sizes: list[Annotated[int, Field(ge=1)]] | None = None
    """Tasks per step for each size to measure, one after another (overrides ``batch_size``)."""
    held_out: bool = True
    """Save and score checkpoints on held-out tasks; false: samples/s only (no saves, no evaluation)."""

    def sizes(self) -> list[int]:
        return list(self.batch_sizes) if self.batch_sizes else [self.batch_size]

    def label(self) -> str:
        """This size's key in ``sizes``: tasks × samples per step."""
        return f"{self.batch_size}x{self.group_size}"


class Run:
    """One system's training: its reward curve and its checkpoints, on a clock that starts
    at the first step and excludes the time spent saving."""

    def __init__(self) -> None:
        self.train_curve: list[tuple[float, float]] = []  # (time s, training reward) per step
        self.checkpoints: list[tuple[int, float, Path]] = []  # (step, time s, HF model directory)
        self.save_s = 0.0  # time spent saving inside the clock (subtracted from it)
        self.wall_s = 0.0


def checkpoint_steps(s: TrlBenchSettings) -> list[int]:
    if not s.held_out:
        return []
    return sorted({*range(s.eval_every, s.steps + 1, s.eval_every), s.steps})


def _smoothed(curve: list[tuple[float, float]], k: int) -> list[tuple[float, float]]:
    return [(t, statistics.mean(r for _, r in curve[max(0, i - k + 1):i + 1])) for i, (t, _) in enumerate(curve)]


def time_to_target(held_out: list[dict[str, Any]], target: float) -> float | None:
    """The time of the first checkpoint, in step order, whose held-out reward reaches ``target``."""
    return next((p["time_s"] for p in sorted(held_out, key=lambda p: p["step"])
                 if p["reward_mean"] >= target - 1e-9), None)


def _asyncrl_run(s: TrlBenchSettings, out: Path, mode: str) -> Run:
    steps = checkpoint_steps(s)
    cfg = load_config(None, [
        f"output_dir={out}", f"seed={s.seed}", f"model.path={s.model_path}", "task.name=countdown",
        f"mode={mode}", "max_staleness=2", f"partial_rollout={'abort' if mode == 'async' else 'off'}",
        f"total_steps={s.steps}", f"batch_size={s.batch_size}", f"group_size={s.group_size}", "eval_every=0",
        "eval.num_tasks=8", "eval.samples_per_task=1", f"sampling.max_tokens={s.max_tokens}",
        f"optim.lr={s.lr}", "algorithm.filter_zero_variance=false",
        f"save_every={s.eval_every if s.held_out else 0}", f"keep_last={len(steps) + 1}",
    ])
    trainer = Trainer(cfg)
    trainer.run()
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]  # the step rows
    t0 = rows[0]["time/elapsed"] - rows[0]["time/step"]  # the first step's start

    def clock(row: dict[str, Any]) -> float:  # saves after earlier steps fall inside this step's time
        return row["time/elapsed"] - t0 - sum(d for k, d in trainer.save_seconds.items() if k < row["step"])

    run = Run()
    run.train_curve = [(clock(r), r["reward/mean"]) for r in rows]
    at = {r["step"]: clock(r) for r in rows}
    run.checkpoints = [(k, at[k], out / "checkpoints" / f"step_{k}") for k in steps]
    run.save_s = sum(d for k, d in trainer.save_seconds.items() if k < s.steps)
    run.wall_s = run.train_curve[-1][0]
    return run


def _trl_run(s: TrlBenchSettings, out: Path) -> Run:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = load_config(None, [f"seed={s.seed}", "task.name=countdown"])
    stream = TaskStream(build_tasks(cfg).train, s.seed)  # the order asyncrl's trainer draws them in
    tasks = [stream.next() for _ in range(s.steps * s.batch_size)]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": t.prompt}], "task_id": t.id,
                               "numbers": t.data["numbers"], "target": t.data["target"]} for t in tasks])

    def reward(prompts, completions, numbers, target, **_: Any) -> list[float]:
        return [countdown_reward(Task("trl", "", {"numbers": n, "target": g}), c[0]["content"])
                for c, n, g in zip(completions, numbers, target)]

    run, due = Run(), set(checkpoint_steps(s))

    class Clock(TrainerCallback):
        """Starts at the first step; saves at the checkpoint steps, off the clock."""

        def on_step_begin(self, args, state, control, **kwargs):
            if not hasattr(self, "t0"):
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if state.global_step in due:  # on_step_end comes before the step's on_log
                start = time.perf_counter()
                path = out / "checkpoints" / f"step_{state.global_step}"
                model.save_pretrained(path)
                processing_class.save_pretrained(path)
                run.checkpoints.append((state.global_step, start - self.t0 - run.save_s, path))
                run.save_s += time.perf_counter() - start

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                run.train_curve.append((time.perf_counter() - self.t0 - run.save_s, float(logs["reward"])))

    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=s.batch_size * s.group_size,
        num_generations=s.group_size, max_completion_length=s.max_tokens, temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, max_steps=s.steps, beta=0.0,
        epsilon=0.2, epsilon_high=0.28, scale_rewards="group", loss_type="dapo", use_cpu=True, bf16=False,
        report_to="none", logging_steps=1, save_strategy="no", seed=s.seed, shuffle_dataset=False,
    )
    trainer = GRPOTrainer(model=s.model_path, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(s.model_path), callbacks=[Clock()])
    trainer.train()
    run.wall_s = run.train_curve[-1][0]  # the last save came before the last log: already off the clock
    return run


def held_out_eval(s: TrlBenchSettings, model_dir: Path, out: Path) -> dict[str, float]:
    """``asyncrl eval``'s evaluation of ``model_dir`` (written to ``out``): mean reward and pass@1."""
    cfg = load_config(None, [
        f"output_dir={out}", f"seed={s.seed}", f"model.path={model_dir}", "task.name=countdown",
        f"task.num_validation={max(s.eval_tasks, 128)}", f"eval.num_tasks={s.eval_tasks}",
        f"eval.samples_per_task={s.eval_samples}", f"sampling.max_tokens={s.max_tokens}",
    ])
    result = run_eval(cfg)
    return {"reward_mean": result.mean_reward, "pass@1": result.pass_at[1]}


def run_trl_bench(overrides: list[str], out: Path) -> dict[str, Any]:
    s = validate(TrlBenchSettings, apply_overrides({}, overrides))
    sizes = [s.model_copy(update={"batch_size": b, "batch_sizes": None}) for b in s.sizes()]
    if len(sizes) == 1:  # one size: its directories and phase names as they always were
        result = {"settings": s.model_dump(), **_bench_size(sizes[0], out, "")}
        _print_table(result)
        return result
    per_size = {}
    for size in sizes:
        per_size[size.label()] = _bench_size(size, out / size.label(), f"{size.label()}: ")
    result = {"settings": s.model_dump(), **per_size[sizes[0].label()], "sizes": per_size}
    for label, size_result in per_size.items():
        print(f"--- {label} ({size_result['samples_per_step']} samples per step)")
        _print_table(size_result)
    _print_size_table(per_size)
    return result


def _in_own_process(train: Callable[..., Run], *args: Any) -> Run:
    """``train(*args)`` in a fresh (spawned) process, as a user runs either system: what one
    run leaves in a process slows the next — TRL trains on the main thread, whose OpenMP
    team then sits idle beside asyncrl's threads (``asyncrl.runtime.one_torch_thread``) —
    and each system's clock starts at its first step, so start-up is not counted."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(train, *args).result()


def _bench_size(s: TrlBenchSettings, out: Path, prefix: str) -> dict[str, Any]:
    """The three systems at ``s.batch_size``: trained in turn, then (``held_out``) their
    checkpoints scored; ``prefix`` starts each phase's name."""
    trainers = {"trl": (_trl_run, s, out / "trl"),  # TRL and the trainer show their own bars
                "asyncrl_sync": (_asyncrl_run, s, out / "asyncrl_sync", "sync"),
                "asyncrl_async": (_asyncrl_run, s, out / "asyncrl_async", "async")}
    samples = s.steps * s.batch_size * s.group_size
    runs: dict[str, Run] = {}
    for i, (name, (train, *args)) in enumerate(trainers.items(), 1):
        with phase("trl", f"{prefix}{name} (run {i}/{len(trainers)})") as progress:
            runs[name] = run = _in_own_process(train, *args)
            progress.figure = (f"{samples / run.wall_s:.1f} samples/s, "
                               f"final reward {_smoothed(run.train_curve, s.smooth)[-1][1]:.3f}")

    # held-out evaluation, after all training: the start policy once, then every checkpoint
    held_out: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    start = None
    if s.held_out:
        with phase("trl", f"{prefix}held-out eval: start policy") as progress:
            start = held_out_eval(s, Path(s.model_path), out / "start_policy_eval")
            progress.figure = f"reward {start['reward_mean']:.3f}, pass@1 {start['pass@1']:.3f}"
        for name, run in runs.items():
            with phase("trl", f"{prefix}held-out eval: {name} ({len(run.checkpoints)} checkpoints)",
                       total=len(run.checkpoints), unit="checkpoint") as progress:
                held_out[name] = [{"step": 0, "time_s": 0.0, **start}]
                for step, t, path in run.checkpoints:
                    scores = held_out_eval(s, path, out / name / "held_out_eval" / f"step_{step}")
                    held_out[name].append({"step": step, "time_s": t, **scores})
                    progress.advance()
                progress.figure = " → ".join(f"{p['reward_mean']:.3f}" for p in held_out[name])

    target = held_out["trl"][-1]["reward_mean"] if s.held_out else None
    systems = {}
    for name, run in runs.items():
        systems[name] = {
            "samples_per_s": samples / run.wall_s, "wall_s": run.wall_s,
            "final_reward": _smoothed(run.train_curve, s.smooth)[-1][1],
            "time_to_target_s": time_to_target(held_out[name], target) if s.held_out else None,
            "final_held_out_reward": held_out[name][-1]["reward_mean"] if s.held_out else None,
            "held_out": held_out[name], "save_s": run.save_s, "train_curve": run.train_curve,
        }
    trl_t, async_t = systems["trl"]["time_to_target_s"], systems["asyncrl_async"]["time_to_target_s"]
    trl_rate = systems["trl"]["samples_per_s"]
    return {
        "batch_size": s.batch_size, "samples_per_step": s.batch_size * s.group_size,
        "target_reward": target, "target_rule": TARGET_RULE,
        "held_out_eval": {"split": "countdown validation", "tasks": s.eval_tasks, "samples_per_task": s.eval_samples,
                          "max_tokens": s.max_tokens, "temperature": EvalConfig().temperature,
                          "evaluator": "asyncrl eval (run_eval) on each checkpoint directory"} if s.held_out else None,
        "target_above_start": target > start["reward_mean"] + 1e-9 if s.held_out else None,
        "systems": systems,
        "sync_vs_trl_samples_per_s": systems["asyncrl_sync"]["samples_per_s"] / trl_rate,
        "async_vs_trl_samples_per_s": systems["asyncrl_async"]["samples_per_s"] / trl_rate,
        "async_vs_trl_time_to_target": async_t / trl_t if async_t is not None and trl_t else None,
        "unmatched": " ".join(__doc__.split("Not matched, and why: ")[1].split("\n\n")[0].split()),
    }


def _print_table(result: dict[str, Any]) -> None:
    systems = result["systems"]
    print(f"{'system':14s} {'wall_s':>7s} {'save_s':>6s} {'samples/s':>10s} {'train reward':>12s} "
          f"{'held-out final':>14s} {'time to target':>14s}")
    held = result["target_reward"] is not None
    for name, v in systems.items():
        ttt = "never" if v["time_to_target_s"] is None else f"{v['time_to_target_s']:.1f}s"
        final = f"{v['final_held_out_reward']:14.3f}" if held else f"{'skipped':>14s}"
        print(f"{name:14s} {v['wall_s']:7.1f} {v['save_s']:6.2f} {v['samples_per_s']:10.1f} {v['final_reward']:12.3f} "
              f"{final} {ttt if held else 'skipped':>14s}")
    if not held:
        print(f"held-out evaluation skipped (held_out=false); sync_vs_trl_samples_per_s="
              f"{result['sync_vs_trl_samples_per_s']:.2f}; async_vs_trl_samples_per_s="
              f"{result['async_vs_trl_samples_per_s']:.2f}")
        print("not matched:", result["unmatched"])
        return
    steps = [p["step"] for p in systems["trl"]["held_out"]]
    print("held-out reward (pass@1) [time s] by step:")
    print(f"{'step':14s} " + " ".join(f"{k:>20d}" for k in steps))
    for name, v in systems.items():
        cells = [f"{p['reward_mean']:.3f} ({p['pass@1']:.3f}) [{p['time_s']:.1f}]" for p in v["held_out"]]
        print(f"{name:14s} " + " ".join(f"{c:>20s}" for c in cells))
    ratio = result["async_vs_trl_time_to_target"]
    print(f"target = {result['target_rule']}: {result['target_reward']:.3f}; sync_vs_trl_samples_per_s="
          f"{result['sync_vs_trl_samples_per_s']:.2f}; async_vs_trl_samples_per_s="
          f"{result['async_vs_trl_samples_per_s']:.2f}; async_vs_trl_time_to_target="
          f"{'n/a' if ratio is None else f'{ratio:.2f}'}")
    if not result["target_above_start"]:
        print(f"note: TRL's last held-out reward does not exceed the start policy's "
              f"({systems['trl']['held_out'][0]['reward_mean']:.3f}), so every system is at the target at step 0: "
              "the run is too short for time-to-target to rank anything (raise steps)")
    print("not matched:", result["unmatched"])


def _print_size_table(per_size: dict[str, dict[str, Any]]) -> None:
    """samples/s of each system at each size, and asyncrl's ratios to TRL."""
    print(f"{'size':8s} {'trl':>10s} {'asyncrl_sync':>13s} {'asyncrl_async':>14s} {'sync/trl':>9s} {'async/trl':>10s}")
    for label, r in per_size.items():
        rate = {name: v["samples_per_s"] for name, v in r["systems"].items()}
        print(f"{label:8s} {rate['trl']:10.1f} {rate['asyncrl_sync']:13.1f} {rate['asyncrl_async']:14.1f} "
              f"{r['sync_vs_trl_samples_per_s']:9.2f} {r['async_vs_trl_samples_per_s']:10.2f}")
