"""``asyncrl bench precision``: float32 against bfloat16, for the learner and the built-in
engine, on the examples' own models, tasks and step sizes, measured side by side in one run.

For each example config (``configs``), from its float32 weights (``model.dtype``):

- **engine**: its rollout worker generates one step's samples (``batch_size`` tasks ×
  ``group_size``, the config's sampling) with the engine's weights in float32 and in
  bfloat16 (``rollout.dtype``), interleaved ``repeats`` times; tok/s = completion tokens /
  wall time of the whole step's generation.
- **mismatch**: the learner's π, float32 and under bf16 autocast (``learner.autocast``),
  scores the tokens each engine sampled, as its π_prox recompute does; per combination, over
  the response tokens: max |Δ| of the logprobs, mean k3 KL(μ ‖ π) and the importance
  weights π/μ (their spread: std, min, max): what the off-policy correction is handed.
  Also the delivery probe's max |Δ| (``weight_sync/delivery.py``: greedy tokens, the
  learner's plain forward in its weights' dtype), the figure ``weight_sync.check_tolerance``
  is compared with.
- **learner**: one ``train_step`` on the float32 engine's samples, float32 against bf16
  autocast, each from its own copy of the same weights, after a warm-up step each,
  interleaved ``repeats`` times; the median step time.

The machine may be shared: the ratios come from interleaved runs, and the load average
at start and end is reported beside them.
"""

from __future__ import annotations

import asyncio
import copy
import os
import statistics
import time
from typing import Any

import torch
from pydantic import Field

from asyncrl.algorithms import kl_k3
from asyncrl.bench.progress import phase
from asyncrl.config import Config, Section, apply_overrides, load_config, validate
from asyncrl.learner import Learner, TrainBatch, pack_batch
from asyncrl.policy import load_policy
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.rollout.workflows.registry import build_tasks
from asyncrl.weight_sync.delivery import engine_probe, forward_logprobs, max_abs_diff, probe_prompts

ENGINE_DTYPES = ("float32", "bfloat16")
AUTOCASTS = ("off", "bfloat16")


class PrecisionBenchSettings(Section):
    configs: list[str] = Field(["examples/countdown/async.yaml", "examples/smollm2/train.yaml"], strict=False)
    """Example configs: each one's model (in float32), task, step size and sampling."""
    repeats: int = Field(3, ge=1)
    """Interleaved repeats of each engine's generation and each learner step."""
    threads: int = Field(2, ge=1)
    """torch threads of the engine and of the learner (they run one at a time)."""
    seed: int = 0


def _config(path: str, s: PrecisionBenchSettings, engine_dtype: str) -> Config:
    cfg = load_config(path, [f"rollout.dtype={engine_dtype}", "model.dtype=float32", f"seed={s.seed}",
                             f"rollout.num_threads={s.threads}", "mode=sync", "partial_rollout=off"])
    cfg.eval.samples_per_task, cfg.eval.temperature = cfg.group_size, cfg.sampling.temperature  # a training step's
    return cfg


def _generate(cfg: Config, model: Any, tokenizer: Any, tasks: list[Any], seed: int
              ) -> tuple[float, list[Any], list[tuple[list[int], list[float]]]]:
    """One step's samples from a rollout worker on ``cfg``: (seconds, trajectories, the
    delivery probe's greedy (tokens, logprobs) per prompt)."""

    async def run():
        worker = RolloutWorker(cfg, model=copy.deepcopy(model), tokenizer=tokenizer, seed=seed)
        try:
            await worker.start()
            start = time.perf_counter()
            result = await worker.evaluate(tasks, version=0)
            seconds = time.perf_counter() - start
            (_, probed), = await engine_probe(worker, 0, probe_prompts(tokenizer))  # one in-process engine
            return seconds, [t for e in result.episodes for t in e.trajectories], [(t, lp) for t, lp, _ in probed]
        finally:
            await worker.shutdown()

    return asyncio.run(run())


def mismatch(engine: torch.Tensor, learner: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Engine (μ) against learner (π) logprobs on the ``mask``ed tokens, all (B, T): max |Δ|,
    mean k3 KL(μ ‖ π) (samples are μ's) and the importance weights π/μ's mean, std, min, max."""
    on = mask.bool()
    mu, pi = engine[on].double(), learner[on].double()
    weights = torch.exp(pi - mu)
    return {"max_abs_diff": float((pi - mu).abs().max()), "mean_abs_diff": float((pi - mu).abs().mean()),
            "kl_k3": float(kl_k3(mu, pi).mean()), "is_mean": float(weights.mean()), "is_std": float(weights.std()),
            "is_min": float(weights.min()), "is_max": float(weights.max()), "tokens": int(on.sum())}


def _learner(cfg: Config, model: Any, tokenizer: Any, autocast: str) -> Learner:
    return Learner(copy.deepcopy(model), tokenizer, algorithm=cfg.algorithm, optim=cfg.optim, total_steps=100,
                   temperature=cfg.sampling.temperature, seed=cfg.seed, share_prompts=cfg.learner.share_prompts,
                   autocast=autocast)


def _batch(trajectories: list[Any], pad_id: int) -> TrainBatch:
    return pack_batch(trajectories, [0.5 - (j % 2) for j in range(len(trajectories))], pad_id)


def bench_config(path: str, s: PrecisionBenchSettings) -> dict[str, Any]:
    cfg = _config(path, s, "float32")
    model, tokenizer = load_policy(cfg.model)
    tasks = build_tasks(cfg).train[:cfg.batch_size]
    pad_id = tokenizer.pad_token_id or 0
    name = os.path.basename(cfg.model.path.rstrip("/"))
    engine: dict[str, Any] = {d: {"seconds": [], "tokens": 0} for d in ENGINE_DTYPES}
    samples: dict[str, Any] = {}
    with phase("precision", f"{name}: engine fp32 / bf16", total=s.repeats * 2, unit="step") as progress:
        for _ in range(s.repeats):
            for dtype in ENGINE_DTYPES:
                seconds, trajectories, probed = _generate(_config(path, s, dtype), model, tokenizer, tasks, s.seed)
                engine[dtype]["seconds"].append(seconds)
                engine[dtype]["tokens"] = sum(int(sum(t.loss_mask)) for t in trajectories)
                samples[dtype] = (trajectories, probed)
                progress.advance()
        for dtype in ENGINE_DTYPES:
            e = engine[dtype]
            e["tok_s"] = e["tokens"] / statistics.median(e["seconds"])
        progress.figure = f"bf16/fp32 tok/s {engine['bfloat16']['tok_s'] / engine['float32']['tok_s']:.2f}x"
    torch.set_num_threads(s.threads)
    learners = {a: _learner(cfg, model, tokenizer, a) for a in AUTOCASTS}
    combos: dict[str, Any] = {}
    with phase("precision", f"{name}: engine-learner mismatch") as progress:
        for dtype, (trajectories, probed) in samples.items():
            batch = _batch(trajectories, pad_id)
            for autocast, learner in learners.items():
                pi = learner.logprobs(learner.model, batch)
                combos[f"engine {dtype} / learner {'bf16-autocast' if autocast == 'bfloat16' else 'fp32'}"] = (
                    mismatch(batch.behavior_logprobs, pi, batch.loss_mask))
            # the delivery probe: the learner's plain forward (no autocast) in its float32 weights
            prompts = probe_prompts(tokenizer)
            learned = forward_logprobs(learners["off"], list(zip(prompts, [t for t, _ in probed])))
            combos[f"engine {dtype} / learner fp32"]["probe_max_abs_diff"] = max_abs_diff([lp for _, lp in probed],
                                                                                         learned)
        batch = _batch(samples["float32"][0], pad_id)
        fp32 = learners["off"].logprobs(learners["off"].model, batch)
        bf16 = learners["bfloat16"].logprobs(learners["bfloat16"].model, batch)
        combos["learner bf16-autocast / learner fp32"] = mismatch(fp32, bf16, batch.loss_mask)
        progress.figure = ", ".join(f"{k}: max|Δ| {v['max_abs_diff']:.3g}" for k, v in combos.items())
    step: dict[str, list[float]] = {a: [] for a in AUTOCASTS}
    batch = _batch(samples["float32"][0], pad_id)
    with phase("precision", f"{name}: learner step fp32 / bf16-autocast", total=(s.repeats + 1) * 2,
               unit="step") as progress:
        for i in range(s.repeats + 1):  # the first of each is a warm-up
            for autocast, learner in learners.items():
                start = time.perf_counter()
                learner.train_step(batch)
                if i:
                    step[autocast].append(time.perf_counter() - start)
                progress.advance()
        progress.figure = (f"fp32 {statistics.median(step['off']):.2f} s, bf16-autocast "
                           f"{statistics.median(step['bfloat16']):.2f} s")
    learner_s = {("fp32" if a == "off" else "bf16-autocast"): {"step_s": statistics.median(v), "all_s": v}
                 for a, v in step.items()}
    return {"config": path, "model": cfg.model.path, "rows": batch.size,
            "response_tokens": int(batch.loss_mask.sum()), "padded_positions": int(batch.attention_mask.numel()),
            "engine": engine, "mismatch": combos, "learner": learner_s,
            "engine_speedup": engine["bfloat16"]["tok_s"] / engine["float32"]["tok_s"],
            "learner_speedup": learner_s["fp32"]["step_s"] / learner_s["bf16-autocast"]["step_s"]}


def run_precision_bench(overrides: list[str]) -> dict[str, Any]:
    s = validate(PrecisionBenchSettings, apply_overrides({}, overrides))
    load_start = os.getloadavg()
    results = [bench_config(path, s) for path in s.configs]
    result = {"suite": "precision", "settings": s.model_dump(), "load_average_start": load_start,
              "load_average_end": os.getloadavg(), "results": results}
    print(table(result))
    return result


def table(result: dict[str, Any]) -> str:
    lines = [f"load average at start {result['load_average_start'][0]:.2f}, at end {result['load_average_end'][0]:.2f}"]
    for r in result["results"]:
        e, lrn = r["engine"], r["learner"]
        lines += [f"\n{r['model']} ({r['rows']} rows, {r['response_tokens']} response tokens)",
                  f"  engine tok/s   fp32 {e['float32']['tok_s']:8.1f}   bf16 {e['bfloat16']['tok_s']:8.1f}   "
                  f"bf16/fp32 {r['engine_speedup']:.2f}x",
                  f"  learner step   fp32 {lrn['fp32']['step_s']:7.2f} s  bf16-autocast "
                  f"{lrn['bf16-autocast']['step_s']:7.2f} s  speed-up {r['learner_speedup']:.2f}x",
                  f"  {'combination':44s} {'max|Δ|':>8s} {'mean|Δ|':>8s} {'k3 KL':>9s} {'IS std':>8s} "
                  f"{'IS min':>7s} {'IS max':>7s} {'probe':>8s}"]
        for k, m in r["mismatch"].items():
            probe = f"{m['probe_max_abs_diff']:8.3g}" if "probe_max_abs_diff" in m else f"{'':8s}"
            lines.append(f"  {k:44s} {m['max_abs_diff']:8.3g} {m['mean_abs_diff']:8.3g} {m['kl_k3']:9.3g} "
                         f"{m['is_std']:8.3g} {m['is_min']:7.3f} {m['is_max']:7.3f} {probe}")
    return "\n".join(lines)
