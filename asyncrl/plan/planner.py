"""``asyncrl plan``: the real trainer on a virtual clock against cost models, for one
configuration, its ``sync`` baseline and a sweep over η and the rollout/learner split.

Each simulated run is an ordinary ``Trainer`` whose runtime is ``simulated.py``'s, run on
``virtual_clock.py``'s loop; it writes a run directory like any other (``metrics.jsonl``,
``samples.jsonl``, ``timeline.jsonl``), and the figures below are read back from those
files exactly as ``asyncrl bench modes`` reads its runs.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from asyncrl.config import Config, ConfigError, load_config
from asyncrl.jsonl import read_jsonl
from asyncrl.orchestrator.metrics import run_figures
from asyncrl.orchestrator.trainer import Trainer
from asyncrl.plan.costs import Costs, cluster_costs, fit_run, read_cluster
from asyncrl.plan.engine import unit_for
from asyncrl.plan.fleet import SERVER_KINDS, ServerKind, describe_fleet, print_fleet, probed
from asyncrl.plan.simulated import simulated_runtime
from asyncrl.plan.virtual_clock import run_virtual

ETAS = (1, 2, 4, 8)
"""The async η a sweep tries, besides ``sync`` (η = 0) and ``one_step_off``."""


@dataclass(frozen=True)
class Schedule:
    name: str
    mode: str
    eta: float
    partial: str

    @classmethod
    def of(cls, cfg: Config) -> Schedule:
        eta, partial = cfg.effective_max_staleness, cfg.effective_partial_rollout
        name = cfg.mode if cfg.mode != "async" else f"async_eta{eta}_{partial}"
        return cls(name, cfg.mode, eta, partial)


SYNC = Schedule("sync", "sync", 0, "off")


class _PlannedTrainer(Trainer):
    """Keeps no checkpoints: nothing resumes a plan, and encoding a large buffer is real time."""

    async def _save(self, step: int) -> None:
        self._saved_step = step


def simulate(cfg: Config, costs: Costs, out: Path) -> dict[str, Any]:
    """One simulated run of ``cfg`` into ``out``; its figures, read from its files."""
    # the simulated handles carry the sync's cost themselves; evaluations are left out
    cfg = changed(cfg, output_dir=str(out), resume=False, save_every=0, save_every_minutes=0, eval_every=0,
                  weight_sync={**cfg.weight_sync.model_dump(), "method": "object_store"})
    unit = unit_for(min(costs.workload.max_response, cfg.sampling.max_tokens))
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # banners and bars of many runs
    with open(out.with_name(out.name + ".log"), "w") as log, contextlib.redirect_stderr(log):
        trainer = _PlannedTrainer(cfg, runtime=simulated_runtime(costs, unit))
        _, simulated_s = run_virtual(trainer.run_async())
    summary = run_figures(out)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "time/step" in r]
    t_r, t_t, t_w = (statistics.mean(f(r) for r in rows) for f in (
        lambda r: r["time/step"] * r["trainer/idle_ratio"], lambda r: r["time/learner"],
        lambda r: r["time/weight_sync"]))
    # Slime's bound on overlapping this run's phases: (t_R + t_T + t_W) / (max(t_R, t_T) + t_W)
    summary["overlap_bound"] = (t_r + t_t + t_w) / (max(t_r, t_t) + t_w)
    return {**summary, "simulated_s": simulated_s, "real_s": time.perf_counter() - start, "tokens_per_unit": unit}


def changed(cfg: Config, **changes: Any) -> Config:
    """``cfg`` with ``changes``, validated as a whole (a mode and its partial rollout together)."""
    return Config.model_validate({**cfg.model_dump(), **changes})


def with_schedule(cfg: Config, schedule: Schedule, costs: Costs) -> Config:
    """``cfg`` on ``schedule``; a colocated sync baseline trains only after generating (its
    devices do one or the other), so it does not stream."""
    streaming = cfg.learner.streaming and not (schedule.mode == "sync" and costs.sync_engines is not None)
    return changed(cfg, mode=schedule.mode, max_staleness=max(1, schedule.eta), partial_rollout=schedule.partial,
                   learner={**cfg.learner.model_dump(), "streaming": streaming})


def sweep_schedules(cfg: Config) -> list[Schedule]:
    partial = cfg.partial_rollout if cfg.partial_rollout != "off" else "continue"
    return [SYNC, Schedule("one_step_off", "one_step_off", 1, "off"),
            *[Schedule(f"async_eta{eta}_{partial}", "async", eta, partial) for eta in ETAS]]


def splits(costs: Costs) -> list[tuple[str, Costs]]:
    """The rollout/learner splits a sweep tries: a cluster's devices divided anew (the same
    total), or a measured run's engine replicated beside its one learner."""
    if costs.table is not None:
        total = costs.table["rollout_devices"] + costs.table["learner_devices"]
        per_engine = costs.table.get("devices_per_engine", 1)
        out = []
        for ratio in (1, 2, 3, 4, 7):  # rollout devices per learner device
            learners = total // (ratio + 1)
            rollout = (total - learners) // per_engine * per_engine
            if learners >= 1 and rollout >= per_engine and f"{rollout}:{learners}" not in dict(out):
                table = {**costs.table, "rollout_devices": rollout, "learner_devices": learners}
                out.append((f"{rollout}:{learners}", cluster_costs(table)))
        return out
    return [(f"{k} engine{'s' if k > 1 else ''}:1 learner", replace(costs, engines=k)) for k in (1, 2, 4)]


def plan(cfg: Config, costs: Costs, out: Path, sweep: bool = True,
         progress: Any = None) -> dict[str, Any]:
    """The configuration as given, its sync baseline and (``sweep``) the η × split grid."""
    out.mkdir(parents=True, exist_ok=True)
    here = Schedule.of(cfg)
    runs = {"sync": simulate(with_schedule(cfg, SYNC, costs), costs, out / "runs" / "sync")}
    if here != SYNC:
        runs[here.name] = simulate(cfg, costs, out / "runs" / here.name)
    result: dict[str, Any] = {
        "config": {"mode": cfg.mode, "max_staleness": here.eta, "partial_rollout": here.partial,
                   "batch_size": cfg.batch_size, "group_size": cfg.group_size, "total_steps": cfg.total_steps,
                   "max_tokens": cfg.sampling.max_tokens},
        "costs": costs.describe(), "notes": costs.notes, "source": costs.source,
        "prediction": {**runs[here.name],
                       "speedup_vs_sync": runs[here.name]["samples_per_s"] / runs["sync"]["samples_per_s"]},
        "sync": runs["sync"],
    }
    if sweep:
        grid: dict[str, dict[str, Any]] = {}
        for label, split in splits(costs):
            grid[label] = {}
            for schedule in sweep_schedules(cfg):
                name = f"{label.replace(':', '-').replace(' ', '_')}/{schedule.name}"
                grid[label][schedule.name] = simulate(with_schedule(cfg, schedule, split), split,
                                                      out / "sweep" / name)
                if progress is not None:
                    progress()
            base = grid[label]["sync"]["samples_per_s"]
            for cell in grid[label].values():
                cell["speedup_vs_sync"] = cell["samples_per_s"] / base
        result["sweep"] = grid
        result["figure"] = _figure(grid, out / "plan.png")
    return result


def _figure(grid: dict[str, dict[str, Any]], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, cells in grid.items():
        names = list(cells)
        left.plot(range(len(names)), [cells[n]["samples_per_s"] for n in names], marker="o", label=label)
        right.plot(range(len(names)), [cells[n]["speedup_vs_sync"] for n in names], marker="o", label=label)
    for ax, title in ((left, "samples/s"), (right, "speed-up over the sync baseline")):
        ax.set_xticks(range(len(names)), [n.replace("async_", "").replace("_", "\n", 1) for n in names], fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.legend(title="rollout:learner", fontsize=8)
    fig.suptitle("asyncrl plan: the trainer on a simulated clock")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def print_plan(result: dict[str, Any]) -> None:
    p, s = result["prediction"], result["sync"]
    print(f"costs: {result['source']}")
    for line in result["costs"]:
        print(f"  {line}")
    for note in result["notes"]:
        print(f"  note: {note}")
    c = result["config"]
    print(f"{c['mode']} (η = {c['max_staleness']}, {c['partial_rollout']}), {c['batch_size']} × {c['group_size']}, "
          f"{c['total_steps']} steps: {p['samples_per_s']:.2f} samples/s, {p['speedup_vs_sync']:.2f}× sync "
          f"({s['samples_per_s']:.2f} samples/s); idle: trainer {p['trainer_idle_ratio']:.2f}, rollout "
          f"{p['rollout_idle_ratio']:.2f}, learner {p['learner_idle_ratio']:.2f}; staleness "
          + " ".join(f"{k}:{v}" for k, v in p["staleness_hist"].items())
          + f"; {_duration(p['simulated_s'])} simulated in {p['real_s']:.1f} s")
    print(f"sync's phases (generation wait, learner, weight sync) overlapped perfectly would give "
          f"{s['overlap_bound']:.2f}× (Slime's bound; removing sync's long-tail bubble can beat it)")
    if "sweep" in result:
        names = list(next(iter(result["sweep"].values())))
        print(f"{'samples/s (× sync)':22s} " + " ".join(f"{n:>20s}" for n in names))
        for label, cells in result["sweep"].items():
            print(f"{label:22s} " + " ".join(
                f"{cells[n]['samples_per_s']:10.2f} ({cells[n]['speedup_vs_sync']:4.2f}×)" for n in names))
        if result.get("figure"):
            print(f"figure: {result['figure']}")


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 else \
        f"{seconds:.1f} s"




def run_plan_command(config: str | None, overrides: list[str], from_run: str | None, cluster: str | None,
                     out: str | None, sweep: bool = True, probe: bool = False,
                     server: ServerKind | None = None) -> dict[str, Any]:
    """``asyncrl plan``: the costs from ``--from RUN_DIR`` or ``--cluster TABLE`` (whose
    ``run:`` and ``servers:`` settings sit between the config file and the command line's
    overrides), the plan printed and written to ``OUT/plan.json`` (with ``plan.png``). With
    ``engine: remote`` the fleet too (``fleet.py``; ``probe``: each server asked now), each
    server simulated as one engine; with neither costs option, the fleet alone."""
    if from_run is not None and cluster is not None:
        raise ConfigError("asyncrl plan takes the costs from one of --from RUN_DIR or --cluster TABLE, not both")
    settings: list[str] = []
    costs: Costs | None = None
    try:
        if from_run is not None:
            costs = fit_run(Path(from_run))
        elif cluster is not None:
            costs, run = read_cluster(Path(cluster))
            settings = [f"{key}={_plain(value)}" for key, value in run.items()]
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    cfg = load_config(config, [*settings, *overrides])
    fleet = None
    if cfg.engine_kind.fleet:  # servers by URL: their commands, their start order
        kind = server or ((costs.table or {}).get("servers") or {}).get("kind") if costs is not None else server
        if (kind or "asyncrl") not in SERVER_KINDS:
            raise ConfigError(f"the cluster table's servers.kind is {kind!r}: one of {', '.join(SERVER_KINDS)}")
        try:
            fleet = describe_fleet(cfg, config, [*settings, *overrides], kind or "asyncrl")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if probe:
            fleet = probed(fleet, cfg.remote.api_key)
        if costs is not None:
            costs = per_server(costs, len(cfg.training_urls))
    elif probe or server is not None:
        raise ConfigError("--probe and --server describe engine=remote's servers: give engine=remote "
                          "\"remote.urls=[http://h1:8100,...]\" (or a cluster table's servers:)")
    if costs is None:
        if fleet is None:
            raise ConfigError("asyncrl plan needs the costs from one of --from RUN_DIR (a finished asyncrl train run) "
                              "or --cluster TABLE (a cluster table, docs/planner.md); with engine=remote and neither, "
                              "it describes the fleet alone")
        print_fleet(fleet)
        print("no throughput prediction: give --from RUN_DIR (each server costing what that run's engine did) or "
              "--cluster TABLE")
        return {"fleet": fleet.to_json()}
    target = Path(out or f"plan/{time.strftime('%Y%m%d-%H%M%S')}")
    if target.exists() and any(target.iterdir()):
        if not (target / PLAN_FILE).is_file():
            raise ConfigError(f"--out {target} is not empty and holds no {PLAN_FILE}: choose a new directory "
                              "(a plan replaces only its own)")
        for part in ("runs", "sweep"):  # a plan's own simulated runs, replaced by this one's
            shutil.rmtree(target / part, ignore_errors=True)
    steps = len(splits(costs)) * len(sweep_schedules(cfg)) if sweep else 0
    with tqdm(total=steps + 2, desc="plan", unit="run", file=sys.stderr) as bar:
        result = plan(cfg, costs, target, sweep=sweep, progress=lambda: bar.update())
    if fleet is not None:
        result["fleet"] = {**fleet.to_json(), "scaling": fleet_scaling(cfg, costs, result, target)}
    (target / PLAN_FILE).write_text(json.dumps(result, indent=2))
    print_plan(result)
    if fleet is not None:
        print_fleet(fleet)
        print(result["fleet"]["scaling"]["said"])
    print(f"plan: {target / PLAN_FILE}")
    return result


PLAN_FILE = "plan.json"


def _plain(value: Any) -> str:
    """``value`` as an override's YAML, written as a user would where that reads back the same
    (``engine=remote``, ``remote.urls=[http://h1:8100,http://h2:8100]``), else as JSON."""
    if isinstance(value, str):
        candidate = value
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        candidate = "[" + ",".join(value) + "]"
    else:
        return json.dumps(value)
    try:
        return candidate if yaml.safe_load(candidate) == value else json.dumps(value)
    except yaml.YAMLError:
        return json.dumps(value)


def per_server(costs: Costs, servers: int) -> Costs:
    """``costs`` with one engine per server of the fleet, said in its notes where the costs
    gave another number."""
    if costs.engines == servers:
        return costs
    note = (f"engines: {servers}, one per server training uses (remote.urls less eval.urls; the costs gave "
            f"{costs.engines}); each server "
            "simulated as one engine of these costs")
    return replace(costs, engines=servers, notes=[*costs.notes, note])


def fleet_scaling(cfg: Config, costs: Costs, result: dict[str, Any], out: Path) -> dict[str, Any]:
    """The configuration's samples/s on the whole fleet against one of its servers alone,
    both simulated: what the planner's model says adding servers buys."""
    n = costs.engines
    many = result["prediction"]["samples_per_s"]
    one = many if n == 1 else simulate(cfg, replace(costs, engines=1), out / "runs" / "one_server")["samples_per_s"]
    said = (f"throughput: {many:.3g} samples/s on {n} server{'s' if n != 1 else ''}"
            + (f" against {one:.3g} on one ({many / one:.2f}× for {n}×)" if n > 1 else "")
            + ": each server simulated as one engine of the costs above (its decode steps, prefills and weight "
              "load), the learner and the schedule as in a run; the network between the trainer and the servers "
              "and the prefix cache a group shares on its server are not modelled")
    return {"servers": n, "samples_per_s": many, "one_server_samples_per_s": one, "said": said}
