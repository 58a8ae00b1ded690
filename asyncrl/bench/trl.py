"""``asyncrl bench trl``: TRL's ``GRPOTrainer`` against asyncrl ``sync`` and ``async`` in
one run, same model directory, task, reward function, group size, batch and learning
rate (optional dependency ``trl``).

Matched: model and tokenizer (the same directory), Countdown train tasks (same seed),
reward function, n samples per task, tasks per step, learning rate, temperature, max
response length, ε_low/ε_high, no KL (β = 0), group-normalised advantages, token-level
loss aggregation, no zero-variance filtering. Not matched, and why: TRL generates with
``model.generate`` in the training process (asyncrl uses its own engine — that is what
is being compared); TRL computes the old-policy logprobs itself while asyncrl uses the
engine's behavior logprobs with a truncated importance weight.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from asyncrl.bench.progress import phase
from asyncrl.config import Section, apply_overrides, load_config, validate
from asyncrl.jsonl import read_jsonl
from asyncrl.orchestrator.task_stream import TaskStream
from asyncrl.orchestrator.trainer import Trainer
from asyncrl.tasks import countdown_reward
from asyncrl.tasks.base import Task
from asyncrl.workflows.registry import build_tasks


class TrlBenchSettings(Section):
    model_path: str = "models/countdown-tiny"
    steps: int = Field(40, ge=2)
    batch_size: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    lr: float = Field(3e-4, gt=0)
    max_tokens: int = Field(24, ge=1)
    smooth: int = Field(5, ge=1)
    seed: int = 0


def _smoothed(curve: list[tuple[float, float]], k: int) -> list[tuple[float, float]]:
    return [(t, statistics.mean(r for _, r in curve[max(0, i - k + 1):i + 1])) for i, (t, _) in enumerate(curve)]


def _time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, r in curve if r >= target - 1e-9), None)


def _asyncrl_curve(s: TrlBenchSettings, out: Path, mode: str) -> list[tuple[float, float]]:
    cfg = load_config(None, [
        f"output_dir={out}", f"seed={s.seed}", f"model.path={s.model_path}", "task.name=countdown",
        f"mode={mode}", "max_staleness=2", f"partial_rollout={'abort' if mode == 'async' else 'off'}",
        f"total_steps={s.steps}", f"batch_size={s.batch_size}", f"group_size={s.group_size}", "eval_every=0",
        "eval.num_tasks=8", "eval.samples_per_task=1", f"sampling.max_tokens={s.max_tokens}",
        f"optim.lr={s.lr}", "algorithm.filter_zero_variance=false",
    ])
    Trainer(cfg).run()
    rows = read_jsonl(out / "metrics.jsonl")[1:]
    t0 = rows[0]["time/elapsed"] - rows[0]["time/step"]  # the first step's start
    return [(r["time/elapsed"] - t0, r["reward/mean"]) for r in rows]


def _trl_curve(s: TrlBenchSettings, out: Path) -> list[tuple[float, float]]:
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

    curve: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not hasattr(self, "t0"):
                self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                curve.append((time.perf_counter() - self.t0, float(logs["reward"])))

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
    return curve


def run_trl_bench(overrides: list[str], out: Path) -> dict[str, Any]:
    s = validate(TrlBenchSettings, apply_overrides({}, overrides))
    runs = {"trl": lambda: _trl_curve(s, out / "trl"),  # TRL and the trainer show their own bars
            "asyncrl_sync": lambda: _asyncrl_curve(s, out / "asyncrl_sync", "sync"),
            "asyncrl_async": lambda: _asyncrl_curve(s, out / "asyncrl_async", "async")}
    samples = s.steps * s.batch_size * s.group_size
    curves = {}
    for i, (name, run) in enumerate(runs.items(), 1):
        with phase("trl", f"{name} (run {i}/{len(runs)})") as progress:
            curves[name] = curve = run()
            progress.figure = (f"{samples / curve[-1][0]:.1f} samples/s, "
                               f"final reward {_smoothed(curve, s.smooth)[-1][1]:.3f}")
    target = _smoothed(curves["trl"], s.smooth)[-1][1]  # TRL's final (smoothed) reward
    systems = {}
    for name, curve in curves.items():
        wall = curve[-1][0]
        systems[name] = {"samples_per_s": samples / wall, "wall_s": wall,
                         "final_reward": _smoothed(curve, s.smooth)[-1][1],
                         "time_to_target_s": _time_to(_smoothed(curve, s.smooth), target), "curve": curve}
    trl_t, async_t = systems["trl"]["time_to_target_s"], systems["asyncrl_async"]["time_to_target_s"]
    result = {
        "settings": s.model_dump(), "target_reward": target, "systems": systems,
        "sync_vs_trl_samples_per_s": systems["asyncrl_sync"]["samples_per_s"] / systems["trl"]["samples_per_s"],
        "async_vs_trl_time_to_target": async_t / trl_t if async_t is not None and trl_t else None,
        "unmatched": __doc__.split("Not matched, and why: ")[1].strip(),
    }
    print(f"{'system':14s} {'wall_s':>7s} {'samples/s':>10s} {'final reward':>12s} {'time to target':>14s}")
    for name, v in systems.items():
        ttt = "never" if v["time_to_target_s"] is None else f"{v['time_to_target_s']:.1f}s"
        print(f"{name:14s} {v['wall_s']:7.1f} {v['samples_per_s']:10.1f} {v['final_reward']:12.3f} {ttt:>14s}")
    print(f"target = TRL's final reward {target:.3f}; sync_vs_trl_samples_per_s="
          f"{result['sync_vs_trl_samples_per_s']:.2f}; async_vs_trl_time_to_target={result['async_vs_trl_time_to_target']}")
    print("not matched:", result["unmatched"])
    return result
