"""``asyncrl bench staleness``: what staleness does to learning, AReaL's table at CPU scale.

Rows: maximum staleness η × objective, several seeds each, every run the same policy,
task, batch and learning rate; per row the final held-out reward with a 95 % confidence
interval over seeds, the held-out gain per sample consumed, wall time, the staleness the
learner actually saw (mean, max, histogram) and the importance weights π_prox/μ (mean
after truncation, truncated fraction, effective sample size). The objectives:

- ``decoupled``: decoupled PPO, trust region against π_prox, truncated IS weight
  min(π_prox/μ, C) against staleness (the default);
- ``bypass``: no recompute, PPO against μ itself (π_prox := μ, w = 1);
- ``naive``: π_prox recomputed but no IS weight (w = 1): stale tokens trained as if the
  current policy had sampled them;
- ``gspo``, ``cispo``, ``icepop``: those losses (``algorithm.policy_loss``);
- ``token_mask``, ``sequence_mask``, ``geometric_mask``: decoupled PPO with
  ``algorithm.is_mask`` dropping tokens, or whole sequences, whose π_prox/μ leaves the band.

``OBJECTIVE_KEYS`` maps each to its config keys. The ones that act only through
k = π_prox/μ (``SAME_ON_POLICY``) are decoupled PPO's update when k = 1, that is at η = 0
with no mismatch: there they share decoupled PPO's run per seed (``shared_with``).

``mismatch`` > 0 is the second workload: the engine samples from a perturbed copy of the
weights while the learner computes on the exact ones, so k ≠ 1 even on-policy, as on a
GPU whose engine computes in bf16. Each row reports the k3 estimate of KL(μ‖π) on tokens
of the trained version (``mismatch_k3``), so the magnitude a value stands for is measured
in every run, not assumed.

The workload, and why: the Countdown policy gains too little in minutes to separate
curves in a CPU budget (the figures: docs/design.md, "Measurements behind choices in the
code"). Here a 91k-parameter policy (``asyncrl.tiny.addition_sft``,
the recipe of ``models/addition-tiny``, remade by every run) is first taught two-operand
addition ``a+b=`` (a, b ≤ 19) with ``label_noise`` of its labels replaced by random
numbers, so it answers right about a third of the time at T = 1
while the right answer is its single most likely one; RL has the rest to gain by
concentrating on it, and a synchronous run gains in seconds. Higher learning rates make
it unstable even on-policy (1e-3 rose, then fell back; 3e-3 collapsed to a constant answer:
docs/design.md, same section), so the default is 5e-4. The warm-up saw every prompt (it
plays the pretrained model); RL trains on the task's train split and is scored on its validation prompts.
Responses are two or three tokens, so generation easily outruns the learner and an
asynchronous run actually consumes trajectories η versions old (``staleness_hist``).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from asyncrl.bench.progress import phase
from asyncrl.config import ConfigError, Section, apply_overrides, load_config, validate
from asyncrl.jsonl import read_jsonl
from asyncrl.modes import trajectory_staleness
from asyncrl.orchestrator.metrics import training_seconds
from asyncrl.orchestrator.trainer import Trainer
from asyncrl.tiny.addition_sft import make_addition_policy

Objective = Literal["decoupled", "bypass", "naive", "gspo", "cispo", "icepop", "token_mask", "sequence_mask",
                    "geometric_mask"]
_DECOUPLED = ["algorithm.policy_loss=decoupled_ppo", "algorithm.bypass=false", "algorithm.is_correction=true",
              "algorithm.is_mask=none"]
OBJECTIVE_KEYS: dict[str, list[str]] = {
    "decoupled": _DECOUPLED,
    "bypass": [*_DECOUPLED, "algorithm.bypass=true"],
    "naive": [*_DECOUPLED, "algorithm.is_correction=false"],
    "gspo": [*_DECOUPLED, "algorithm.policy_loss=gspo"],
    "cispo": [*_DECOUPLED, "algorithm.policy_loss=cispo"],
    "icepop": [*_DECOUPLED, "algorithm.policy_loss=icepop"],
    "token_mask": [*_DECOUPLED, "algorithm.is_mask=token"],
    "sequence_mask": [*_DECOUPLED, "algorithm.is_mask=sequence"],
    "geometric_mask": [*_DECOUPLED, "algorithm.is_mask=geometric"],
}
"""Each objective as config keys (later keys override earlier ones), all spelled out so a
row never inherits another's setting."""
SAME_ON_POLICY = ("decoupled", "bypass", "naive", "icepop", "token_mask", "sequence_mask", "geometric_mask")
"""Objectives that differ from decoupled PPO only through k = π_prox / μ (its weight, its
cap, a band that drops tokens or sequences): on-policy with the engine computing as the
learner does, k = 1 to float32 rounding and all of them are decoupled PPO's update, so at
η = 0 without ``mismatch`` they share its runs. GSPO's and CISPO's clips differ from PPO's
at the second optimizer step of a batch (``mini_batches`` > 1): they run their own."""
# two-sided 95 % Student t quantiles by degrees of freedom (n seeds - 1); the normal's 1.96 beyond 30
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}


class StalenessBenchSettings(Section):
    etas: list[int] = [0, 1, 2, 4, 8]
    objectives: list[Objective] = ["decoupled", "bypass", "naive"]
    seeds: int = Field(3, ge=1)
    steps: int = Field(300, ge=1)
    batch_size: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    lr: float = Field(5e-4, gt=0)
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per batch (``optim.mini_batches``): with more than one, the clip
    against π_prox bounds how far a batch moves the policy (with one it is inactive)."""
    eval_every: int = Field(60, ge=1)
    eval_tasks: int = Field(48, ge=1)
    eval_samples: int = Field(8, ge=1)
    max_operand: int = Field(19, ge=1)
    label_noise: float = Field(0.45, ge=0, le=1)
    warmup_steps: int = Field(2500, ge=1)
    hidden_size: int = Field(64, ge=8)
    policy: str | None = None
    """A warm-up made by an earlier run of this bench (its ``policy/``), to skip making it."""
    mismatch: float = Field(0.0, ge=0)
    """The training–inference mismatch workload: the engine samples from a copy of the
    weights with each element multiplied by (1 + mismatch·ε), ε ~ N(0, 1) afresh at every
    sync (``rollout.engine_weight_noise``), while the learner computes on the exact ones,
    as a bf16 GPU engine beside a float32 learner does. 0: none (float32 on both sides).
    What a value does to the logprobs is measured per row (``mismatch_k3``, at lag 0)."""
    threads: int = Field(1, ge=1)
    """torch threads of the engine and of the learner each: 1 + 1 fills a 2-core machine."""


# ----------------------------------------------------------------------------- the runs


def run_config(s: StalenessBenchSettings, policy: Path, out: Path, eta: int, objective: str, seed: int) -> Any:
    return load_config(None, [
        f"output_dir={out}", f"seed={seed}", f"model.path={policy}", "task.name=arithmetic",
        f"task.options={{low: 0, high: {s.max_operand}}}", f"task.num_train={s.steps * s.batch_size}",
        f"task.num_validation={s.eval_tasks}", "workflow.use_chat_template=false",
        "mode=async", f"max_staleness={eta}", "partial_rollout=off", f"total_steps={s.steps}",
        f"batch_size={s.batch_size}", f"group_size={s.group_size}", f"eval_every={s.eval_every}",
        f"eval.num_tasks={s.eval_tasks}", f"eval.samples_per_task={s.eval_samples}", "sampling.max_tokens=4",
        "save_every_minutes=0",
        f"optim.lr={s.lr}", f"optim.mini_batches={s.mini_batches}", "algorithm.filter_zero_variance=false",
        "algorithm.advantage=grpo",
        f"rollout.num_threads={s.threads}", f"rollout.learner_threads={s.threads}",
        *OBJECTIVE_KEYS[objective],
        *([f"rollout.engine_weight_noise={s.mismatch}", "weight_sync.check_every=0"] if s.mismatch else []),
    ])


def shares_on_policy_run(s: StalenessBenchSettings, eta: int, objective: str) -> bool:
    """At η = 0 without mismatch the ``SAME_ON_POLICY`` objectives train on decoupled PPO's runs."""
    return eta == 0 and not s.mismatch and objective in SAME_ON_POLICY


# ----------------------------------------------------------------------------- one run, one row


def summarise_run(run_dir: Path) -> dict[str, Any]:
    """A run's held-out curve against samples consumed, staleness, IS weights, wall time."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    samples = read_jsonl(run_dir / "samples.jsonl")
    per_step: dict[int, int] = {}
    for sample in samples:
        per_step[sample["step"]] = per_step.get(sample["step"], 0) + 1
    consumed, curve = 0, []
    for row in rows:
        consumed += per_step.get(row["step"], 0)
        if "eval/reward_mean" in row:
            curve.append((consumed, row["eval/reward_mean"]))
    staleness = [trajectory_staleness(x["trained_version"], x["behavior_version_min"]) for x in samples]
    trained = [r for r in rows if r["step"] > 0]

    def mean_of(key: str) -> float | None:
        values = [r[key] for r in trained if r.get(key) is not None and math.isfinite(r[key])]
        return statistics.mean(values) if values else None

    return {
        "curve": curve, "start_reward": curve[0][1], "final_reward": curve[-1][1], "samples": len(samples),
        "wall_s": training_seconds(trained),
        "staleness_mean": statistics.mean(staleness), "staleness_max": max(staleness),
        "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
        "is_weight_mean": mean_of("actor/is_weight_mean"),
        "is_truncated_fraction": mean_of("actor/is_truncated_fraction"), "ess": mean_of("actor/is_ess"),
        "entropy_final": trained[-1].get("actor/entropy"),
        # the engine's logprobs against the learner's on tokens sampled by the trained version
        "mismatch_k3": mean_of("mismatch/k3_lag0"), "mismatch_max_abs": _max_of(trained, "mismatch/max_abs_lag0"),
        "clip_fraction": mean_of("actor/clip_fraction"),
        "masked_fraction": _first(mean_of("actor/is_masked_fraction"), mean_of("actor/icepop_masked_fraction")),
    }


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _max_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return max(values) if values else None


def ci95(values: list[float]) -> float:
    """Half-width of the 95 % confidence interval of the mean (Student t); 0 for one value."""
    if len(values) < 2:
        return 0.0
    return _T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def summarise_row(eta: int, objective: str, runs: list[dict[str, Any]], *, bypass: bool) -> dict[str, Any]:
    """One table row from its seeds' runs. Bypass has no π_prox, so no IS statistics."""
    finals = [r["final_reward"] for r in runs]
    gains = [(r["final_reward"] - r["start_reward"]) / r["samples"] for r in runs]
    hist: dict[str, int] = {}
    for r in runs:
        for k, v in r["staleness_hist"].items():
            hist[k] = hist.get(k, 0) + v

    def mean(key: str, *, of_weights: bool = True) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.mean(values) if values and not (bypass and of_weights) else None

    return {
        "eta": eta, "objective": objective, "num_seeds": len(runs),
        "final_reward_mean": statistics.mean(finals), "final_reward_ci95": ci95(finals), "final_rewards": finals,
        "start_reward": statistics.mean(r["start_reward"] for r in runs),
        "reward_per_sample": statistics.mean(gains),
        "wall_s": statistics.mean(r["wall_s"] for r in runs),
        "staleness_mean": statistics.mean(r["staleness_mean"] for r in runs),
        "staleness_max": max(r["staleness_max"] for r in runs), "staleness_hist": hist,
        "is_weight_mean": mean("is_weight_mean"), "is_truncated_fraction": mean("is_truncated_fraction"),
        "ess": mean("ess"), "mismatch_k3": mean("mismatch_k3", of_weights=False),
        "mismatch_max_abs": max((r["mismatch_max_abs"] for r in runs if r.get("mismatch_max_abs") is not None),
                                default=None),
        "clip_fraction": mean("clip_fraction", of_weights=False),
        "masked_fraction": mean("masked_fraction", of_weights=False),
        "curve": _mean_curve([r["curve"] for r in runs]),
    }


def _mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[float, float]]:
    """Seeds evaluate at the same steps: average their points position by position."""
    n = min(len(c) for c in curves)
    return [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves)) for i in range(n)]


# ----------------------------------------------------------------------------- the bench


def plot_staleness_bench(result: dict[str, Any], path: Path) -> Path:
    """Held-out reward against samples consumed, one panel per objective, one line per
    η (mean over seeds); and the staleness the learner saw per η, as a CDF."""
    from asyncrl.report.figures import FIGURE_DPI, new_figure

    objectives = result["settings"]["objectives"]
    fig = new_figure(figsize=(4.2 * (len(objectives) + 1), 3.6))
    axes = fig.subplots(1, len(objectives) + 1, squeeze=False)[0]
    for ax in axes[1:-1]:
        ax.sharey(axes[0])
    rows = result["rows"]
    for ax, objective in zip(axes, objectives):
        for row in (r for r in rows if r["objective"] == objective):
            xs, ys = zip(*row["curve"])
            ax.plot(xs, ys, marker="o", markersize=3, label=f"η={row['eta']}")
        ax.set_title(f"{objective}: held-out reward")
        ax.set_xlabel("samples consumed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    hist_ax = axes[-1]
    by_eta = {}
    for row in rows:
        by_eta.setdefault(row["eta"], {})
        for k, v in row["staleness_hist"].items():
            by_eta[row["eta"]][int(k)] = by_eta[row["eta"]].get(int(k), 0) + v
    for eta, hist in sorted(by_eta.items()):  # a CDF: readable whatever the spread of η
        total, running, ks, cdf = sum(hist.values()), 0, [], []
        for k in sorted(hist):
            running += hist[k]
            ks.append(k)
            cdf.append(running / total)
        hist_ax.step([0, *ks], [0.0, *cdf], where="post", label=f"η={eta}")
    hist_ax.set_xscale("symlog", linthresh=1)
    hist_ax.set_title("staleness of trained samples (CDF)")
    hist_ax.set_xlabel("versions behind")
    hist_ax.set_ylabel("fraction at most this stale")
    hist_ax.grid(alpha=0.3)
    hist_ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    return path


def _finished(run_dir: Path, steps: int) -> bool:
    """A run of an earlier, interrupted bench that reached its last step (and logged it)."""
    metrics = run_dir / "metrics.jsonl"
    if not (metrics.is_file() and (run_dir / "samples.jsonl").is_file()):
        return False
    rows = read_jsonl(metrics)
    return bool(rows) and rows[-1].get("step") == steps and "eval/reward_mean" in rows[-1]


def _settings_guard(s: StalenessBenchSettings, out: Path) -> None:
    """Finished runs in ``out`` are reused only if they were made with these settings."""
    path = out / "settings.json"
    # what one run depends on: more seeds, η or objectives add runs beside the finished
    # ones, and threads change the speed, not what is learned
    mine = s.model_dump(exclude={"threads", "seeds", "etas", "objectives"})
    if path.is_file():
        # a setting added since those runs were made holds its default there: they ran without it
        defaults = StalenessBenchSettings().model_dump()
        theirs = {k: defaults[k] for k in mine if k in defaults} | json.loads(path.read_text())
        if theirs != mine:
            differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ConfigError(f"{out} holds runs of bench staleness with other settings ({', '.join(differ)}); "
                              "pass another --out, or remove it")
    else:
        path.write_text(json.dumps(mine, indent=2) + "\n")


def paired_difference(row: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    """Final held-out reward minus the baseline's, seed by seed (a seed fixes the task
    order, the sampling seeds and the validation prompts of both), with its CI95."""
    diffs = [a - b for a, b in zip(row["final_rewards"], baseline["final_rewards"], strict=True)]
    return {"mean": statistics.mean(diffs), "ci95": ci95(diffs)}


def tabulate(s: StalenessBenchSettings, runs: dict[tuple[int, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The table's rows, each against decoupled PPO at its η (paired by seed); a row that
    shares decoupled PPO's on-policy runs (``shares_on_policy_run``) says so instead."""
    rows = []
    for eta in s.etas:
        for objective in s.objectives:
            shared = shares_on_policy_run(s, eta, objective)
            row = summarise_row(eta, objective, runs[(eta, "decoupled" if shared else objective)],
                                bypass=objective == "bypass" and not shared)
            if shared:
                row["shared_with"] = [o for o in s.objectives if o != objective and shares_on_policy_run(s, eta, o)]
            rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["eta"] == row["eta"] and r["objective"] == "decoupled"), None)
        if base is not None and row is not base and "shared_with" not in row:
            row["vs_decoupled"] = paired_difference(row, base)
    return rows


def run_staleness_bench(overrides: list[str], out: Path) -> dict[str, Any]:
    """Every run, seeds outermost (an interrupted bench still holds whole seeds of every
    row); run again with the same ``--out`` it reuses the finished runs and the warm-up,
    so a table can also be widened (more seeds, η or objectives) without redoing it."""
    s = validate(StalenessBenchSettings, apply_overrides({}, overrides))
    out.mkdir(parents=True, exist_ok=True)
    _settings_guard(s, out)
    policy = Path(s.policy) if s.policy else out / "policy"
    record = policy / "base_policy.json"
    if s.policy:
        base = {"reused": s.policy}
    elif record.is_file():
        base = json.loads(record.read_text())
        print(f"[bench staleness] warm-up policy: reused {policy}")
    else:
        with phase("staleness", "warm-up policy (noisy addition)") as progress:
            base = make_addition_policy(policy, max_operand=s.max_operand, label_noise=s.label_noise,
                                        steps=s.warmup_steps, hidden_size=s.hidden_size)
            record.write_text(json.dumps(base, indent=2) + "\n")
            progress.figure = (f"{base['params']:,} params, {base['steps']} steps, loss {base['final_loss_ema']:.3f}, "
                               f"expected held-out reward {base['expected_val_reward']:.3f}")
    plan = list(dict.fromkeys((eta, "decoupled" if shares_on_policy_run(s, eta, objective) else objective)
                              for eta in s.etas for objective in s.objectives))
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    total = len(plan) * s.seeds
    done = 0
    for seed in range(s.seeds):
        for eta, objective in plan:
            done += 1
            name = f"eta{eta}_{objective}"
            with phase("staleness", f"{name} seed {seed} (run {done}/{total})") as progress:
                run_dir = out / "runs" / name / f"seed{seed}"
                reused = _finished(run_dir, s.steps)
                if not reused:
                    shutil.rmtree(run_dir, ignore_errors=True)  # a half run: its logs would mix with the new one
                    Trainer(run_config(s, policy, run_dir, eta, objective, seed)).run()
                summary = summarise_run(run_dir)
                runs.setdefault((eta, objective), []).append(summary)
                progress.figure = (f"held-out {summary['start_reward']:.3f} → {summary['final_reward']:.3f}, "
                                   f"staleness mean {summary['staleness_mean']:.2f} max {summary['staleness_max']}, "
                                   f"{summary['wall_s']:.1f} s" + (" (reused)" if reused else ""))
    result = {"settings": s.model_dump(), "base_policy": base, "rows": tabulate(s, runs),
              "runs": {f"eta{e}_{o}": v for (e, o), v in runs.items()}}
    _print_table(result)
    try:
        result["figure"] = str(plot_staleness_bench(result, out / "staleness.png"))
        print(f"figure: {result['figure']}")
    except ImportError as exc:  # matplotlib is optional
        print(f"no figure: {exc}")
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _paired(row: dict[str, Any]) -> str:
    diff = row.get("vs_decoupled")
    return "-" if diff is None else f"{diff['mean']:+.3f} ± {diff['ci95']:.3f}"


def _print_table(result: dict[str, Any]) -> None:
    print(f"{'η':>3s} {'objective':14s} {'held-out final ± CI95':>22s} {'start':>6s} {'gain/1k samples':>15s} "
          f"{'vs decoupled (paired)':>21s} {'wall s':>7s} {'stale mean':>10s} {'max':>4s} {'IS w':>6s} "
          f"{'trunc':>6s} {'ESS':>6s} {'clip':>6s} {'masked':>6s} {'k3 lag0':>8s}")
    for r in result["rows"]:
        print(f"{r['eta']:3d} {r['objective']:14s} {r['final_reward_mean']:14.3f} ± {r['final_reward_ci95']:5.3f} "
              f"{r['start_reward']:6.3f} {1000 * r['reward_per_sample']:15.3f} {_paired(r):>21s} {r['wall_s']:7.1f} "
              f"{r['staleness_mean']:10.2f} {r['staleness_max']:4d} {_fmt(r['is_weight_mean'], '6.3f')} "
              f"{_fmt(r['is_truncated_fraction'], '6.3f')} {_fmt(r['ess'], '6.3f')} "
              f"{_fmt(r.get('clip_fraction'), '6.3f')} {_fmt(r.get('masked_fraction'), '6.3f')} "
              f"{_fmt(r.get('mismatch_k3'), '8.2e')}")
    s = result["settings"]
    print(f"seeds per row: {s['seeds']}; mismatch {s['mismatch']:g}; η = 0 without mismatch is on-policy, one run per "
          f"seed shared by {', '.join(SAME_ON_POLICY)}")
