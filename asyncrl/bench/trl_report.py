"""``asyncrl bench trl``'s reports: the tables it prints and the summary over seeds. Pure
functions of ``bench.json``'s dicts (``trl.py`` trains and measures; this module only reads
what it measured), so a sitting's results can be printed again from its file.
"""

from __future__ import annotations

import statistics
from typing import Any

from asyncrl.bench.staleness import ci95


def mean_ci(values: list[float]) -> dict[str, float | None]:
    return {"mean": statistics.mean(values) if values else None, "ci95": ci95(values) if values else None}


def summarise_seeds(sittings: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system over the sittings: time to target (each seed's; reached count; mean ± CI95
    over the seeds that reached it), held-out final and samples/s (mean ± CI95); and the
    seeds whose target lies above the start, without which a time to target ranks nothing."""
    systems = {}
    for name in sittings[0]["systems"]:  # SYSTEMS, an async system per async_sharing setting, a sync per ablation
        runs = [r["systems"][name] for r in sittings]
        times = [r["time_to_target_s"] for r in runs]
        reached = [t for t in times if t is not None]
        finals = [r["final_held_out_reward"] for r in runs if r["final_held_out_reward"] is not None]
        systems[name] = {"time_to_target_s": times, "reached": len(reached), "of": len(times),
                         "time_to_target": mean_ci(reached), "final_held_out_reward": mean_ci(finals),
                         "samples_per_s": mean_ci([r["samples_per_s"] for r in runs])}
    return {"systems": systems, "seeds": [r["seed"] for r in sittings],
            "targets": [r["target_reward"] for r in sittings],
            "target_above_start": [r["target_above_start"] for r in sittings]}


def print_seed_table(summary: dict[str, Any]) -> None:
    def cell(v: dict[str, float | None], spec: str) -> str:
        return "n/a" if v["mean"] is None else f"{v['mean']:{spec}} ± {v['ci95']:{spec}}"

    print(f"--- across seeds {summary['seeds']}; targets {[round(t, 3) for t in summary['targets'] if t is not None]}"
          f" (above the start: {summary['target_above_start']})")
    print(f"{'system':14s} {'time to target s (mean ± CI95 of those reached)':>48s} {'reached':>8s} "
          f"{'held-out final':>16s} {'samples/s':>14s}")
    for name, v in summary["systems"].items():
        print(f"{name:14s} {cell(v['time_to_target'], '.1f'):>48s} {v['reached']:>4d}/{v['of']:<3d} "
              f"{cell(v['final_held_out_reward'], '.3f'):>16s} {cell(v['samples_per_s'], '.1f'):>14s}")


def print_table(result: dict[str, Any]) -> None:
    systems = result["systems"]
    first = next(iter(systems.values()))
    if "device" in first:  # absent from a bench.json written before TRL followed asyncrl's device
        print(f"every system on {first['device']}: weights {first['dtype']}, autocast {first['autocast']}")
    print(f"{'system':14s} {'wall_s':>7s} {'save_s':>6s} {'samples/s':>10s} {'train reward':>12s} "
          f"{'held-out final':>14s} {'time to target':>14s}")
    held = result["target_reward"] is not None
    if "async_vs_sync_samples_per_s" in result:  # absent from a bench.json written before it
        print("async against sync, samples/s: " + ", ".join(
            f"{name} {ratio:.2f}×" for name, ratio in result["async_vs_sync_samples_per_s"].items()))
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
    steps = max(([p["step"] for p in v["held_out"]] for v in systems.values()), key=len)  # asyncrl_steps: longer
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


def print_size_table(per_size: dict[str, dict[str, Any]]) -> None:
    """samples/s of each system at each size, and asyncrl's ratios to TRL."""
    print(f"{'size':8s} {'trl':>10s} {'asyncrl_sync':>13s} {'asyncrl_async':>14s} {'sync/trl':>9s} {'async/trl':>10s}")
    for label, r in per_size.items():
        rate = {name: v["samples_per_s"] for name, v in r["systems"].items()}
        print(f"{label:8s} {rate['trl']:10.1f} {rate['asyncrl_sync']:13.1f} {rate['asyncrl_async']:14.1f} "
              f"{r['sync_vs_trl_samples_per_s']:9.2f} {r['async_vs_trl_samples_per_s']:10.2f}")
