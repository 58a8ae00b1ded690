"""PPO with a critic (GAE, ``ppo_gae.yaml``) against GRPO (``async.yaml``) on Countdown: the
same trained samples per step, the same number of steps, several seeds, each scored on the
held-out validation tasks; prints one Markdown table (docs/critic.md shows it).

    python examples/countdown/compare_critic.py [--steps 600] [--seeds 0 1 2] [--parallel 1] \
        [--arms GRPO PPO+GAE] [--out runs/compare-critic] [KEY=VALUE ...]

Each (arm, seed) is ``asyncrl train CONFIG seed=S total_steps=STEPS output_dir=OUT/ARM-sS
KEY=VALUE ...`` (the overrides go to both arms), ``--parallel`` of them at a time. A run
directory that already holds a finished run (its last evaluation at step STEPS) is read,
not re-run, so a second call only prints the table; an unfinished one is refused (nothing
is overwritten). The two configs must train the same samples per step (``batch_size`` ×
``group_size``), or the comparison is refused before anything runs.

"held-out" is each run's last evaluation (``eval.num_tasks`` validation tasks ×
``eval.samples_per_task``, the configs' own); "generated / step" counts every sample made,
trained or not: GRPO drops the groups whose samples all scored the same
(``algorithm.filter_zero_variance``) and generates more to fill its batch, PPO+GAE trains
every group it makes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.report.run import finite, load_run
from asyncrl.report.summary import summarize

HERE = Path(__file__).resolve().parent
ARMS = {"GRPO": HERE / "async.yaml", "PPO+GAE": HERE / "ppo_gae.yaml"}
"""Arm name → its config: the flagship GRPO example, and the critic's."""


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / f"{arm.lower().replace('+', '-')}-s{seed}"


def finished(path: Path, steps: int) -> bool:
    """``path`` holds a run whose last evaluation scored the policy after ``steps`` steps."""
    if not (path / "metrics.jsonl").is_file():
        return False
    return summarize(load_run(path))["last eval step"] == steps


def samples_per_step(overrides: list[str]) -> int:
    """The trained samples per step both arms share; SystemExit naming both when they differ."""
    shapes = {arm: load_config(config, overrides) for arm, config in ARMS.items()}
    counts = {arm: cfg.batch_size * cfg.group_size for arm, cfg in shapes.items()}
    if len(set(counts.values())) != 1:
        said = ", ".join(f"{arm} {shapes[arm].batch_size} × {shapes[arm].group_size}" for arm in counts)
        raise SystemExit(f"the arms train different samples per step ({said}); give both the same "
                         "batch_size × group_size")
    return next(iter(counts.values()))


def train(config: Path, seed: int, steps: int, path: Path, overrides: list[str]) -> None:
    """One arm's run, its output in ``path/train.log``; SystemExit naming the log if it fails."""
    path.mkdir(parents=True)
    command = [sys.executable, "-m", "asyncrl.cli", "train", str(config), f"seed={seed}", f"total_steps={steps}",
               f"output_dir={path}", *overrides]
    with open(path.parent / f"{path.name}.log", "w") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{' '.join(command)} exited {code}; see {path.parent / f'{path.name}.log'}")


def row(arm: str, paths: list[Path], per_step: int, steps: int) -> list[str]:
    """The table's row of one arm: held-out reward per seed and their mean, pass@1's mean,
    the samples trained and generated per step, the mean wall time."""
    summaries = [summarize(load_run(p)) for p in paths]
    rewards = [float(s["eval reward after (last eval)"]) for s in summaries]
    pass1 = [float(s["eval pass@1 after"]) for s in summaries]
    group = load_config(ARMS[arm]).group_size  # the overrides cannot change it: samples_per_step checked both
    generated = [s["groups generated"] * group / steps for s in summaries]
    minutes = [(finite(s["wall time (s)"]) or 0.0) / 60 for s in summaries]
    start = [float(s["eval reward before (step 0)"]) for s in summaries]
    return [arm, f"{statistics.mean(start):.3f}", *(f"{r:.3f}" for r in rewards), f"**{statistics.mean(rewards):.3f}**",
            f"{statistics.mean(pass1):.3f}", str(per_step), f"{statistics.mean(generated):.0f}",
            f"{statistics.mean(minutes):.1f}"]


def table(rows: list[list[str]], seeds: list[int], steps: int) -> str:
    head = ["arm", "held-out at step 0", *(f"seed {s}" for s in seeds), "mean", "pass@1 (mean)",
            "trained / step", "generated / step", "minutes (mean)"]
    lines = [f"held-out reward after {steps} steps", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="steps of every run (default: 600, the configs')")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                        help="the arms to run and show (default: both)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare-critic"))
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings for both arms")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.parallel < 1:
        parser.error("--steps and --parallel must be at least 1")
    per_step = samples_per_step(args.overrides)
    todo = []
    for arm in args.arms:
        for seed in args.seeds:
            path = run_dir(args.out, arm, seed)
            if finished(path, args.steps):
                continue
            if path.exists():
                raise SystemExit(f"{path} holds an unfinished or different run; delete it or give another --out")
            todo.append((ARMS[arm], seed, path))
    with ThreadPoolExecutor(args.parallel) as pool:
        for done in [pool.submit(train, config, seed, args.steps, path, args.overrides) for config, seed, path in todo]:
            done.result()
    rows = [row(arm, [run_dir(args.out, arm, s) for s in args.seeds], per_step, args.steps) for arm in args.arms]
    print(table(rows, args.seeds, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
