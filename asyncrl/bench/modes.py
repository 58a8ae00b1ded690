"""``asyncrl bench modes``: sync, one_step_off and async (η ∈ {1, 2, 4}, abort and
continue) side by side in one run, the same policy, samples and steps for each, on one of
two workloads:

- ``task=longtail`` (default): ``tasks/longtail.py`` with a random-init policy that rarely
  stops, so response lengths follow the task's long tail;
- ``task=search``: the search agent of ``examples/search_agent`` (its ``sync.yaml``, the
  shipped ``models/search-tiny``, the OpenAI-SDK agent through the gateway) with every
  search delayed by ``tool_latency_s``, as a remote retrieval service would: episodes of
  one to four turns that spend part of their time waiting on a tool, not on the engine.

Besides each mode's wall time and idle ratios it measures, with nothing else running,
the pure generation time T_gen of the same number of samples and the pure training time
T_train of the same number of steps. Perfect overlap would take max(T_gen, T_train)
instead of T_gen + T_train, so the ideal speedup is (T_gen + T_train) / max(...), and
``overlap_efficiency`` is the achieved async speedup over sync divided by that bound.

``streaming=both`` runs every mode twice, side by side — the learner training on a whole
batch, then streaming (``learner.streaming``: forward and backward on each group as it
arrives, the optimizer step once the batch is in) — and reports each mode's
``streaming_speedup`` (batched wall / streamed wall) and both runs' learner idle ratio
(``trainer/learner_idle_ratio``: the part of a step the learner is not computing).

Each mode trains in a child process of its own (``asyncrl train`` on the mode's config,
written beside its run directory), so its ``peak_rss_mb`` is that run's alone
(``bench/child.py``); the pure times are measured in this process.
"""

from __future__ import annotations

import asyncio
import copy
import os
import statistics
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from asyncrl.bench.child import train_in_child
from asyncrl.bench.progress import phase
from asyncrl.config import Section, apply_overrides, load_config, validate
from asyncrl.jsonl import read_jsonl
from asyncrl.learner import Learner, pack_batch
from asyncrl.modes import staleness_lag
from asyncrl.orchestrator.metrics import run_figures
from asyncrl.policy import load_policy
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.tiny import build_char_tokenizer, build_tiny_model, save_tiny_policy
from asyncrl.rollout.workflows.registry import build_tasks

SEARCH_EXAMPLE = "examples/search_agent/sync.yaml"
# per-step agent metrics averaged over a run: the profile of the search workload
AGENT_PROFILE = ("agent/turns_mean", "agent/tool_calls_mean", "agent/tool_latency_s_mean",
                 "agent/tokens_per_turn_mean")


class ModesBenchSettings(Section):
    task: Literal["longtail", "search"] = "longtail"
    tool_latency_s: float = Field(0.2, ge=0)
    """``task=search``: seconds added to every search (``ASYNCRL_RETRIEVAL_LATENCY_S``)."""
    steps: int = Field(60, ge=1)
    batch_size: int = Field(4, ge=1)
    group_size: int = Field(8, ge=1)
    max_tokens: int = Field(160, ge=1)
    lr: float = Field(3e-4, gt=0)
    stalenesses: list[int | float] = [1, 2, 4]
    partial_rollouts: list[str] = ["abort", "continue"]
    streaming: Literal["off", "on", "both"] = "off"
    """``learner.streaming`` in every run (``on``), in none, or each mode both ways (``both``:
    the streamed run named ``<mode>_streamed``, run right after the batched one)."""
    stale_groups: Literal["wait", "drop"] = "wait"
    """Every run's ``stale_groups``: ``drop`` shows what dropping groups older than η costs
    (how many, and their mean response length against the trained ones')."""
    seed: int = 0


def _config(s: ModesBenchSettings, policy: Path, out: Path, mode: str, eta: float, partial: str,
            streaming: bool = False) -> Any:
    common = [
        f"output_dir={out}", f"seed={s.seed}", f"model.path={policy}",
        f"task.num_train={s.steps * s.batch_size * 4}", "task.num_validation=16", f"mode={mode}",
        f"max_staleness={eta}", f"partial_rollout={partial}", f"total_steps={s.steps}",
        f"batch_size={s.batch_size}", f"group_size={s.group_size}", "eval_every=0", "eval.num_tasks=16",
        "eval.samples_per_task=1", f"sampling.max_tokens={s.max_tokens}", f"optim.lr={s.lr}",
        "algorithm.filter_zero_variance=false", f"learner.streaming={str(streaming).lower()}",
        f"stale_groups={s.stale_groups}", "save_every_minutes=0",  # no save inside the timed steps
    ]
    if s.task == "search":  # the example's own config: agent, task, sampling, algorithm
        return load_config(SEARCH_EXAMPLE, common)
    return load_config(None, [*common, "task.name=longtail", "workflow.use_chat_template=false"])


def _summarise(run_dir: Path, eta: float) -> dict[str, Any]:
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    samples = read_jsonl(run_dir / "samples.jsonl")
    return {
        **run_figures(run_dir),
        "learner_s": sum(r["time/learner"] for r in rows),  # the learner computing, over the run
        "staleness_bound": staleness_lag(eta), "resumed_fraction": sum(s["resumed"] for s in samples) / len(samples),
        "final_reward": statistics.mean(r["reward/mean"] for r in rows[-max(1, len(rows) // 5):]),
        **{key: statistics.mean(r[key] for r in rows) for key in AGENT_PROFILE if key in rows[0]},
        **_stale_drops(rows[-1], samples),
    }


def _stale_drops(last: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Groups dropped as older than η, the learner's waits that kept one fresh, and the mean
    response length of the dropped trajectories against the trained ones'."""
    dropped, tokens = (last.get(f"rollout/stale_dropped_{k}_total") for k in ("trajectories", "tokens"))
    return {"stale_dropped": last["buffer/stale_dropped_total"],
            "deadline_waits": last.get("rollout/deadline_waits_total"),
            "trained_mean_tokens": statistics.mean(s["response_tokens"] for s in samples),
            "stale_dropped_mean_tokens": tokens / dropped if dropped else None}


def _pure_times(s: ModesBenchSettings, policy: Path, out: Path) -> tuple[float, float]:
    """T_gen and T_train for the same samples and steps, each alone on all cores."""
    cfg = _config(s, policy, out / "pure", "sync", 0, "off")
    cfg.eval.samples_per_task, cfg.eval.temperature = s.group_size, cfg.sampling.temperature  # as training samples
    model, tokenizer = load_policy(cfg.model)
    tasks = build_tasks(cfg).train[: s.steps * s.batch_size]

    async def generate():  # the trainer's rollout worker (gateway and agent included), nothing else running
        worker = RolloutWorker(cfg, model=copy.deepcopy(model), tokenizer=tokenizer, seed=s.seed)
        try:
            await worker.start()
            start = time.perf_counter()
            result = await worker.evaluate(tasks, version=0)
            return time.perf_counter() - start, result
        finally:
            await worker.shutdown()

    with phase("modes", "pure generation") as progress:
        t_gen, result = asyncio.run(generate())
        progress.figure = f"T_gen {t_gen:.1f} s, {len(result.episodes)} samples"
    learner = Learner(model, tokenizer, algorithm=cfg.algorithm, optim=cfg.optim, total_steps=s.steps,
                      temperature=1.0, share_prompts=cfg.learner.share_prompts)
    episodes = result.episodes
    per_step = s.batch_size * s.group_size
    t_train = 0.0
    with phase("modes", "pure training", total=s.steps, unit="step") as progress:
        for i in range(s.steps):
            start = time.perf_counter()  # per step, so that the bar advances outside the timing
            chunk = episodes[i * per_step:(i + 1) * per_step]
            trajectories = [t for e in chunk for t in e.trajectories]
            learner.train_step(pack_batch(trajectories, [0.5 - (j % 2) for j in range(len(trajectories))],
                                    tokenizer.pad_token_id or 0))
            t_train += time.perf_counter() - start
            progress.advance()
        progress.figure = f"T_train {t_train:.1f} s, {s.steps} steps"
    return t_gen, t_train


def _policy(s: ModesBenchSettings, out: Path) -> Path:
    if s.task == "search":  # the example's shipped policy: it searches, reads, answers
        return Path(load_config(SEARCH_EXAMPLE, []).model.path)
    policy = out / "policy"  # random init: it rarely stops, so response lengths follow the task's tail
    model, tokenizer = build_tiny_model(build_char_tokenizer(), seed=s.seed, max_position_embeddings=256)
    save_tiny_policy(model, tokenizer, policy)
    return policy


def run_modes_bench(overrides: list[str], out: Path) -> dict[str, Any]:
    s = validate(ModesBenchSettings, apply_overrides({}, overrides))
    out.mkdir(parents=True, exist_ok=True)
    if s.task == "search":  # read by the agent when it starts its retrieval service (once per process)
        os.environ["ASYNCRL_RETRIEVAL_LATENCY_S"] = str(s.tool_latency_s)
    policy = _policy(s, out)
    schedules = [("sync", "sync", 0, "off"), ("one_step_off", "one_step_off", 1, "off")]
    schedules += [(f"async_eta{eta}_{p}", "async", eta, p) for eta in s.stalenesses for p in s.partial_rollouts]
    ways = {"off": [False], "on": [True], "both": [False, True]}[s.streaming]
    runs = [(name + ("_streamed" if streamed and s.streaming == "both" else ""), mode, eta, partial, streamed)
            for name, mode, eta, partial in schedules for streamed in ways]
    modes: dict[str, Any] = {}
    for i, (name, mode, eta, partial, streamed) in enumerate(runs, 1):
        with phase("modes", f"{name} (run {i}/{len(runs)})") as progress:  # the trainer shows its own bar
            peak_mb = train_in_child(_config(s, policy, out / name, mode, eta, partial, streamed), out / f"{name}.yaml")
            modes[name] = {**_summarise(out / name, eta), "streaming": streamed, "peak_rss_mb": peak_mb}
            progress.figure = f"{modes[name]['samples_per_s']:.1f} samples/s, wall {modes[name]['wall_s']:.1f} s"
    # the figures below compare the schedules: each mode's first way (batched, unless streaming=on)
    streamed_too = {name: modes.pop(f"{name}_streamed") for name, *_ in schedules} if s.streaming == "both" else {}
    t_gen, t_train = _pure_times(s, policy, out)
    best_async = min((v["wall_s"], k) for k, v in modes.items() if k.startswith("async"))
    speedup = modes["sync"]["wall_s"] / best_async[0]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    result = {
        "settings": s.model_dump(), "modes": modes, "pure_generation_s": t_gen, "pure_training_s": t_train,
        "best_async": best_async[1], "async_speedup_vs_sync": speedup, "ideal_overlap_bound": bound,
        "overlap_efficiency": speedup / bound,
        # sync generates each step's groups alone and waits for the longest response: the
        # part of its wall time beyond T_gen + T_train is that bubble, which async also
        # removes, so the speedup can exceed the overlap bound. The other view: how close
        # the best async run came to perfect overlap of the pure times.
        "sync_bubble_s": modes["sync"]["wall_s"] - (t_gen + t_train),
        "ideal_async_wall_s": max(t_gen, t_train),
        "async_vs_ideal": max(t_gen, t_train) / best_async[0],
    }
    if streamed_too:
        result["modes"] = {k: v for name, m in streamed_too.items()
                           for k, v in ((name, modes[name]), (f"{name}_streamed", m))}
        result["streaming_speedup"] = {name: modes[name]["wall_s"] / m["wall_s"] for name, m in streamed_too.items()}
    print(f"{'mode':28s} {'wall_s':>8s} {'samples/s':>10s} {'trainer idle':>12s} {'learner idle':>12s} "
          f"{'rollout idle':>12s} {'stale max':>9s} {'reward':>7s} {'peak MB':>8s}")
    for name, m in result["modes"].items():
        print(f"{name:28s} {m['wall_s']:8.1f} {m['samples_per_s']:10.1f} {m['trainer_idle_ratio']:12.2f} "
              f"{m['learner_idle_ratio']:12.2f} {m['rollout_idle_ratio']:12.2f} {m['staleness_max']:9d} "
              f"{m['final_reward']:7.3f} {m['peak_rss_mb']:8.0f}")
    print(f"stale_groups={s.stale_groups}: groups dropped as older than η (mean response tokens trained / dropped)")
    for name, m in result["modes"].items():
        dropped = m["stale_dropped_mean_tokens"]
        print(f"{name:28s} {m['stale_dropped']:4d} dropped, {m['deadline_waits'] or 0:4d} waits "
              f"({m['trained_mean_tokens']:.1f} / {'-' if dropped is None else f'{dropped:.1f}'})")
    if s.task == "search":
        print(f"{'agent profile':28s} " + " ".join(f"{k.split('/')[1]:>20s}" for k in AGENT_PROFILE))
        for name, m in result["modes"].items():
            print(f"{name:28s} " + " ".join(f"{m.get(k, float('nan')):20.3f}" for k in AGENT_PROFILE))
    print(f"T_gen={t_gen:.1f}s T_train={t_train:.1f}s ideal_overlap_bound={bound:.2f} "
          f"async_speedup_vs_sync={speedup:.2f} ({best_async[1]}) overlap_efficiency={speedup / bound:.2f}")
    for name, ratio in result.get("streaming_speedup", {}).items():
        print(f"streaming {name}: wall {modes[name]['wall_s']:.1f} s → {streamed_too[name]['wall_s']:.1f} s "
              f"({ratio:.2f}×), learner idle {modes[name]['learner_idle_ratio']:.2f} → "
              f"{streamed_too[name]['learner_idle_ratio']:.2f}")
    print(f"sync bubble (wall beyond T_gen + T_train) = {result['sync_bubble_s']:.1f}s; best async reached "
          f"{result['async_vs_ideal']:.2f} of perfect overlap (max(T_gen, T_train) / its wall)")
    return result
