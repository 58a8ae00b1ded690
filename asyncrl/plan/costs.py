"""What the simulated parts cost: engines, learner, weight sync, and the workload's
lengths — fitted to a real run's measurements (:func:`fit_run`) or read from a table
describing a cluster (:func:`read_cluster`).

The engine model is continuous batching's: one decode step advances every running
sequence by one token and takes ``step_s + per_sequence_s · b + per_context_token_s · c``
for ``b`` sequences holding ``c`` tokens of context (rows × the longest, where the engine
pads them as the torch engine does); a prefill of newcomers takes
``prefill_s`` plus ``prefill_per_row_s`` per prompt run through the model (a group's
samples share one, as with the torch engine's group prefill; a resumed sequence is its
own) plus ``prefill_per_token_s`` per token of those. The learner's step takes
``step_s + per_token_s`` per token trained (prompt and response), times
``1 + recompute`` when the batch was not sampled by the version it trains (the proximal
policy's forward pass). A weight sync takes ``fixed_s + bytes / bytes_per_s +
per_engine_s`` per engine, with every engine paused meanwhile.

Where the learner and an engine share the cores (one machine, ``async``), each computes
slower while the other does: the learner by ``1 + LearnerCosts.contention``, the engine's
decode steps by ``1 + EngineCosts.contention``. A run measures the engine's busy seconds
during the learner's calls (``time/learner_overlap``), and the fits find both factors
from how the learner's and the engine's seconds grow with that overlap.
With ``rollout.thread_sharing: colocated`` (and in ``sync``) a side computing while the
other is idle has every core and runs ``alone_speedup`` times faster than on its share; a
colocated run logs each step's seconds at every core (``time/learner_all_cores_s``,
``time/engine_all_cores_s``), and the fits find the speedups from how the seconds shrink
with them: of a call's ``T`` seconds, ``o`` beside the busy other side and ``a`` at every
core, the work done in share-seconds is ``W = T − o·c/(1+c) + a·(s−1)``, so
``T = W + k·o − (s−1)·a`` with ``k = c/(1+c)``, linear in the unknowns.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from asyncrl.config.engine_kinds import engine_kind
from asyncrl.jsonl import read_jsonl
from asyncrl.modes import trajectory_staleness
from asyncrl.plan.engine import EngineCosts, generation_time


@dataclass(frozen=True)
class LearnerCosts:
    per_token_s: float
    step_s: float = 0.0
    recompute: float = 0.0
    """Extra cost, as a fraction of a step, when the proximal logprobs must be recomputed."""
    overhead_s: float = 0.0
    """Per step, outside the learner's computation (logging, bookkeeping): the train loop's own time."""
    warmup_s: float = 0.0
    """Added to the first step (a fresh process's first forward and backward are slower)."""
    contention: float = 0.0
    """How much slower the learner computes while the engine it shares the cores with is busy
    (0.5: 1.5× the time)."""
    alone_speedup: float = 1.0
    """How much faster the learner computes with every core than with its share, where it has
    them while the engine is idle (``rollout.thread_sharing: colocated``, and ``sync``):
    fitted to a colocated run's ``time/learner_all_cores_s``; 1 where no run measured it."""

    def step(self, tokens: int, on_policy: bool) -> float:
        compute = self.step_s + self.per_token_s * tokens
        return compute * (1 if on_policy else 1 + self.recompute)


@dataclass(frozen=True)
class SyncCosts:
    fixed_s: float = 0.0
    bytes: float = 0.0
    bytes_per_s: float = math.inf
    per_engine_s: float = 0.0

    def sync(self, engines: int) -> float:
        return self.fixed_s + self.bytes / self.bytes_per_s + self.per_engine_s * engines


@dataclass(frozen=True)
class Workload:
    """Lengths drawn per sample, i.i.d.: from a run's trained samples or a log-normal."""

    response_tokens: tuple[int, ...] = ()
    prompt_tokens: tuple[int, ...] = (64,)
    groups: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """A run's groups as (prompt tokens, response lengths): a group is dealt whole, because
    the samples of one task are alike (a hard task's are all long)."""
    lognormal: tuple[float, float, int] | None = None  # (mean, sigma, max) when no list is given
    filtered_fraction: float = 0.0
    """Of the groups generated, the share whose samples all score the same (filtered out)."""

    def deal(self, seed: int) -> Iterator[tuple[int, tuple[int, ...]]]:
        """The run's groups in a shuffled order, shuffled again each time round: dealt, not
        drawn with replacement, so that a plan as long as its run generates the same tokens
        (on a long tail, drawing them missed the run's mean length by up to a tenth)."""
        rng, deck = random.Random(seed), list(self.groups)
        while deck:
            rng.shuffle(deck)
            yield from deck

    def group(self, dealt: tuple[int, tuple[int, ...]] | None, rng: random.Random,
              n: int) -> list[tuple[int, int]]:
        """(prompt tokens, response tokens) of a group's ``n`` samples: the ``dealt`` group
        of a run (resampled to ``n``), or ``n`` independent draws."""
        if dealt is None:
            return [self.draw(rng) for _ in range(n)]
        prompt, lengths = dealt
        return [(prompt, lengths[i] if len(lengths) == n else rng.choice(lengths)) for i in range(n)]

    def draw(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, response tokens) of one sample."""
        prompt = rng.choice(self.prompt_tokens)
        if self.response_tokens:
            return prompt, rng.choice(self.response_tokens)
        mean, sigma, cap = self.lognormal or (256.0, 0.5, 1024)
        mu = math.log(mean) - sigma * sigma / 2  # so that the uncapped mean is ``mean``
        return prompt, max(1, min(cap, round(rng.lognormvariate(mu, sigma))))

    @property
    def max_response(self) -> int:
        return max(self.response_tokens) if self.response_tokens else (self.lognormal or (0, 0, 1024))[2]


@dataclass(frozen=True)
class Costs:
    """Everything a plan simulates with, and where it came from."""

    engine: EngineCosts
    learner: LearnerCosts
    sync: SyncCosts
    workload: Workload
    engines: int = 1
    """Rollout engines (each on its own devices) for the learner."""
    source: str = ""
    notes: list[str] = field(default_factory=list)
    sync_engines: int | None = None
    """Engines for the ``sync`` baseline where it differs (a colocated baseline uses every device)."""
    episode_lead_s: float = 0.0
    """An episode's own seconds before it reaches the engine (its workflow, tokenizing)."""
    episode_tail_s: float = 0.0
    """An episode's own seconds after its first engine call, outside the engine (reward, tools)."""
    sync_learner: LearnerCosts | None = None
    """The learner of the ``sync`` baseline where it differs (colocated: every device trains)."""
    table: dict[str, Any] | None = None
    """The cluster table these came from (a sweep divides its devices anew)."""

    def describe(self) -> list[str]:
        e, lr, s, w = self.engine, self.learner, self.sync, self.workload
        lengths = (f"{len(w.response_tokens)} measured, mean {statistics.mean(w.response_tokens):.1f}, "
                   f"max {max(w.response_tokens)}" if w.response_tokens else
                   "log-normal mean {:g}, σ {:g}, max {}".format(*(w.lognormal or (256, 0.5, 1024))))
        return [
            f"engines: {self.engines}" + (f" (sync baseline: {self.sync_engines})" if self.sync_engines else ""),
            f"decode step: {e.step_s * 1e3:.3g} ms + {e.per_sequence_s * 1e3:.3g} ms per sequence + "
            f"{e.per_context_token_s * 1e6:.3g} µs per context token; prefill {e.prefill_s * 1e3:.3g} ms + "
            f"{e.prefill_per_row_s * 1e3:.3g} ms per prompt + {e.prefill_per_token_s * 1e6:.3g} µs per token; "
            f"at most {e.max_batch} sequences",
            f"learner: {lr.step_s * 1e3:.3g} ms + {lr.per_token_s * 1e6:.3g} µs per token, "
            f"recompute +{lr.recompute:.0%}"
            f", loop overhead {lr.overhead_s * 1e3:.3g} ms per step, first step +{lr.warmup_s:.3g} s"
            + (f"; sharing the cores, the learner is {1 + lr.contention:.2f}× and a decode step "
               f"{1 + e.contention:.2f}× slower while the other computes" if lr.contention or e.contention else "")
            + (f"; with every core while the other is idle (colocated, sync), the learner is {lr.alone_speedup:.2f}× "
               f"and a decode step {e.alone_speedup:.2f}× faster" if lr.alone_speedup != 1 or e.alone_speedup != 1
               else ""),
            f"weight sync: {s.sync(self.engines):.3g} s; an episode's own time around the engine: "
            f"{self.episode_lead_s * 1e3:.3g} ms before, {self.episode_tail_s * 1e3:.3g} ms after",
            f"responses: {lengths}; prompts mean {statistics.mean(w.prompt_tokens):.0f} tokens; "
            f"groups filtered {w.filtered_fraction:.0%}",
        ]

    def scaled(self, factor: float) -> Costs:
        """Every duration times ``factor`` (a slowed or hastened copy of the same run)."""
        def times(costs: Any) -> Any:
            return replace(costs, **{f: getattr(costs, f) * factor for f in costs.__dataclass_fields__
                                     if f.endswith("_s") and f != "bytes_per_s"})
        return replace(self, engine=times(self.engine), learner=times(self.learner),
                       sync=replace(times(self.sync), bytes_per_s=self.sync.bytes_per_s / factor),
                       sync_learner=self.sync_learner and times(self.sync_learner),
                       episode_lead_s=self.episode_lead_s * factor, episode_tail_s=self.episode_tail_s * factor)

    def for_mode(self, mode: str) -> Costs:
        if mode != "sync" or (self.sync_engines is None and self.sync_learner is None):
            return self
        return replace(self, engines=self.sync_engines or self.engines, learner=self.sync_learner or self.learner)


# ------------------------------------------------------------------ fitting a run
def _nonnegative_fit(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0: the best fit over the subsets of features
    (few columns, so every subset is tried)."""
    best, best_err = np.zeros(features.shape[1]), float(np.sum(target ** 2))
    for k in range(1, features.shape[1] + 1):
        for cols in itertools.combinations(range(features.shape[1]), k):
            sub = features[:, cols]
            coef, *_ = np.linalg.lstsq(sub, target, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((sub @ coef - target) ** 2))
            if err < best_err - 1e-12:
                best, best_err = np.zeros(features.shape[1]), err
                best[list(cols)] = coef
    return best


def fit_run(run_dir: Path) -> Costs:
    """The costs a finished ``asyncrl train`` run measured (``metrics.jsonl``,
    ``samples.jsonl``, ``config.yaml``): the engine's busy seconds regressed on its decode
    steps, sampled tokens and prefills per step; the learner's seconds on the tokens it
    trained, on- and off-policy steps apart; the weight sync's mean; the rest of each
    step (logging, bookkeeping) as the loop's overhead; the lengths as sampled."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time/step" in r]
    samples = read_jsonl(run_dir / "samples.jsonl")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    missing = [k for k in ("rollout/prefill_rows", "time/weight_sync") if k not in rows[0]]
    kind = engine_kind(cfg.get("engine", "torch"))
    if missing and not kind.in_process:  # an engine elsewhere: its steps are not the client's to count
        raise ValueError(f"{run_dir} ran with engine={cfg['engine']}, whose engine steps and prefills the run does "
                         "not see: plan from a run with engine=torch on the servers' model (each server is then "
                         "simulated as that engine), or give --cluster TABLE")
    if missing:
        raise ValueError(f"{run_dir}/metrics.jsonl has no {', '.join(missing)}: it was written by an older "
                         "asyncrl; train again to plan from it")
    notes: list[str] = []
    workers = cfg.get("ray", {}).get("num_rollout_workers", 1) if cfg.get("runtime") == "ray" else 1

    engine = _fit_engine(rows, workers, cfg.get("rollout", {}).get("max_batch_size", 256), notes)

    by_step: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        by_step.setdefault(s["step"], []).append(s)
    tokens = {k: sum(s["response_tokens"] + s.get("prompt_tokens", 0) for s in v) for k, v in by_step.items()}
    on_policy = {k: all(trajectory_staleness(s["trained_version"], s["behavior_version_min"]) == 0
                        and s["behavior_version_max"] == s["trained_version"] for s in v) for k, v in by_step.items()}
    fits: dict[bool, tuple[float, float]] = {}
    overlap = {r["step"]: r.get("time/learner_overlap", 0.0) for r in rows}
    shared: dict[bool, tuple[float, int]] = {}  # per regime: the overlap's coefficient, and steps fitted
    whole = {r["step"]: r.get("time/learner_all_cores_s", 0.0) for r in rows}
    speedups: dict[bool, tuple[float, int]] = {}  # per regime: s − 1, and steps fitted
    steady = rows[1:] if len(rows) > 4 else rows  # the first step warms up (its extra time: warmup_s)
    for regime in (True, False):
        chosen = [r for r in steady if r["step"] in tokens and on_policy[r["step"]] == regime]
        if len(chosen) >= 3:
            # the learner's seconds = its work alone + k × the engine's busy seconds meanwhile
            # (working 1 / (1 + c) as fast then: k = c / (1 + c))
            # and − (s − 1) × its seconds at every core (rollout.thread_sharing: colocated): the column negated
            x = np.array([[1.0, tokens[r["step"]], overlap[r["step"]], -whole[r["step"]]] for r in chosen])
            y = np.array([r["time/learner"] for r in chosen])
            if not _shared_sometimes(x[:, 2] / y):
                x[:, 2] = 0.0
            if not _shared_sometimes(-x[:, 3] / y):  # every step as much at every core: s cannot be told
                x[:, 3] = 0.0
            coef = _nonnegative_fit(x, y)
            fits[regime] = (float(coef[0]), float(coef[1]))
            shared[regime] = (float(coef[2]), len(chosen))
            speedups[regime] = (float(coef[3]), len(chosen))
    if not fits:
        raise ValueError(f"{run_dir}: fewer than 3 trained steps to fit the learner to")
    base_on = fits.get(True) or fits[False]
    recompute = 0.0
    if True in fits and False in fits:
        mean_tokens = statistics.mean(tokens.values())
        on, off = (fits[k][0] + fits[k][1] * mean_tokens for k in (True, False))
        recompute = max(0.0, off / on - 1)
    elif False not in fits:
        notes.append("learner: every step was on-policy, so the recompute's cost was not measured (taken as 0)")
    learner_step_s, learner_per_token_s = base_on
    first = rows[0]
    shared_k = min(0.9, sum(c * n for c, n in shared.values()) / sum(n for _, n in shared.values()))
    a, b = fits.get(on_policy.get(first["step"], True)) or base_on
    faster = sum(c * n for c, n in speedups.values()) / sum(n for _, n in speedups.values())  # s − 1
    alone = first["time/learner"] - shared_k * overlap[first["step"]] + faster * whole[first["step"]]
    warmup = max(0.0, alone - (a + b * tokens.get(first["step"], 0))) if steady is not rows else 0.0
    overhead = statistics.mean(max(0.0, r["time/step"] * (1 - r["trainer/idle_ratio"]) - r["time/learner"]
                                   - r["time/weight_sync"]) for r in rows)
    # and between steps, outside any step's time/step: writing the step's row and samples
    overhead += statistics.mean(max(0.0, b["time/elapsed"] - a["time/elapsed"] - b["time/step"])
                                for a, b in zip(rows, rows[1:])) if len(rows) > 1 else 0.0
    learner = LearnerCosts(per_token_s=learner_per_token_s, step_s=learner_step_s, recompute=recompute,
                           overhead_s=overhead, warmup_s=warmup,
                           contention=shared_k / (1 - shared_k), alone_speedup=1 + faster)
    # a sync that lets running sequences finish (partial_rollout=off) waited for them: the
    # simulated engines wait for their own, so only the load is a cost
    sync = SyncCosts(fixed_s=statistics.mean(max(0.0, r["time/weight_sync"] - r.get("rollout/drain_s", 0.0))
                                             for r in rows))
    groups = rows[-1].get("rollout/groups_accepted_total", 0) + rows[-1].get("rollout/groups_filtered_total", 0)
    prompts = tuple(s["prompt_tokens"] for s in samples if "prompt_tokens" in s) or (64,)
    if "prompt_tokens" not in samples[0]:
        notes.append("workload: samples.jsonl has no prompt_tokens (an older run): prompts taken as 64 tokens")
    grouped: dict[tuple[int, Any], list[dict[str, Any]]] = {}
    for s in samples:
        grouped.setdefault((s["step"], s.get("group", s["task_id"])), []).append(s)
    workload = Workload(response_tokens=tuple(max(1, s["response_tokens"]) for s in samples), prompt_tokens=prompts,
                        groups=tuple((g[0].get("prompt_tokens", 64), tuple(max(1, s["response_tokens"]) for s in g))
                                     for g in grouped.values()),
                        filtered_fraction=rows[-1].get("rollout/groups_filtered_total", 0) / groups if groups else 0.0)
    timed = sum(r.get("rollout/timed_episodes", 0) for r in rows)
    lead, tail = (sum(r.get(f"rollout/episode_{part}_s", 0.0) for r in rows) / timed if timed else 0.0
                  for part in ("lead", "tail"))
    return Costs(engine=engine, learner=learner, sync=sync, workload=workload, engines=workers,
                 source=f"measured in {run_dir}", notes=notes, episode_lead_s=lead, episode_tail_s=tail)


def _fit_engine(rows: list[dict[str, Any]], workers: int, max_batch: int, notes: list[str]) -> EngineCosts:
    """The engine's costs from its per-step work. Where the engine timed its prefills apart
    (``rollout/prefill_s``, the torch engine), decode and prefill seconds are fitted apart:
    on short answers forward passes, tokens and prompt rows rise and fall together, and one
    fit over their sum hands the seconds to any of them — a plan whose engine batches
    prompts otherwise than the run did would then miss by a third. The decode seconds grow
    by ``k`` per second the learner computed beside them (``time/learner_overlap``): the
    engine decodes ``1 + c`` times slower then, ``k = c / (1 + c)``."""
    busy = np.array([r["rollout/busy_s"] * workers for r in rows])
    if all("rollout/prefill_s" in r and "rollout/prefill_reused" in r for r in rows):
        prefill = np.array([r["rollout/prefill_s"] for r in rows])
        # a decode step costs step_s plus per_sequence_s per sequence it advances (a newcomer's
        # first token is sampled by its prefill) plus per_context_token_s per cache position
        # it attends over, where counted
        # and − (s − 1) × its decode seconds at every core (colocated; the module docstring's law),
        # the engine's seconds at every core taken as decode and prefill in their proportion
        decode_x = np.array([[r["rollout/decode_steps"], r["rollout/tokens"] - r["rollout/prefill_rows"]
                              - r["rollout/prefill_reused"], r.get("rollout/decode_positions", 0),
                              r.get("time/learner_overlap", 0.0),
                              -r.get("time/engine_all_cores_s", 0.0) * (1 - r["rollout/prefill_s"]
                                                                         / max(r["rollout/busy_s"], 1e-9))]
                             for r in rows], float)
        # the positions prefilled, where counted (a resumed sequence's row holds its partial response)
        prefill_x = np.array([[r["rollout/prefills"], r["rollout/prefill_rows"], r.get("rollout/prefill_tokens", 0)]
                              for r in rows], float)
        if not _shared_sometimes(decode_x[:, 3] / np.maximum(busy, 1e-9)):
            decode_x[:, 3] = 0.0
        if not _shared_sometimes(-decode_x[:, 4] / np.maximum(busy, 1e-9)):
            decode_x[:, 4] = 0.0
        decode_coef, prefill_coef = _nonnegative_fit(decode_x, busy - prefill), _nonnegative_fit(prefill_x, prefill)
        notes.append(f"engine: decode seconds fitted to decode steps, tokens and cache positions (R² "
                     f"{_r2(decode_x @ decode_coef, busy - prefill):.2f}), prefill seconds to prefills, prompt "
                     f"rows and their positions (R² {_r2(prefill_x @ prefill_coef, prefill):.2f}), "
                     f"over {len(rows)} steps")
        shared_k = min(0.9, float(decode_coef[3]))
        return EngineCosts(step_s=float(decode_coef[0]), per_sequence_s=float(decode_coef[1]),
                           prefill_s=float(prefill_coef[0]), prefill_per_row_s=float(prefill_coef[1]),
                           prefill_per_token_s=float(prefill_coef[2]), per_context_token_s=float(decode_coef[2]),
                           padded=True,
                           max_batch=max_batch, contention=shared_k / (1 - shared_k),
                           alone_speedup=1 + float(decode_coef[4]))
    # an engine that does not time its prefills (vLLM): a forward pass (decode step or prefill)
    # costs step_s, plus per_sequence_s per sequence it advances, plus per_row_s per prompt row
    counts = np.array([[r["rollout/decode_steps"] + r["rollout/prefills"], r["rollout/tokens"],
                        r["rollout/prefill_rows"]] for r in rows], float)
    coef = _nonnegative_fit(counts, busy)
    step_s, per_token_s, per_row_s = (float(c) for c in coef)
    notes.append(f"engine: busy seconds per step fitted to forward passes, tokens sampled, prompts prefilled "
                 f"(R² {_r2(counts @ coef, busy):.2f} over {len(rows)} steps)")
    return EngineCosts(step_s=step_s, per_sequence_s=per_token_s, prefill_s=step_s, prefill_per_row_s=per_row_s,
                       max_batch=max_batch)


def _shared_sometimes(fraction: np.ndarray) -> bool:
    """Whether a contention factor can be told from a cost: only when some steps computed
    mostly alone and some mostly beside the other (at least 3 of each). Otherwise the two
    are collinear — a learner always beside a busy engine fits its seconds to the overlap
    alone — and the fitted cost keeps the run's usual contention in it (factor 0)."""
    return int((fraction < 0.5).sum()) >= 3 and int((fraction >= 0.5).sum()) >= 3


def _r2(predicted: np.ndarray, actual: np.ndarray) -> float:
    residual = float(np.sum((actual - predicted) ** 2))
    total = float(np.sum((actual - actual.mean()) ** 2))
    return 1 - residual / total if total > 0 else float("nan")


# ------------------------------------------------------------ a cluster, on paper
def read_cluster(path: Path) -> tuple[Costs, dict[str, Any]]:
    """A cluster table (YAML; ``docs/planner.md`` lists its keys): the costs, and the
    settings it fixes for the run (``batch_size``, ``group_size``, ``max_staleness``, …)."""
    table = yaml.safe_load(Path(path).read_text())
    try:
        return cluster_costs(with_servers(table)), {**servers_run(table), **table.get("run", {})}
    except KeyError as exc:
        raise ValueError(f"{path}: the cluster table has no {exc.args[0]!r}") from None


def with_servers(table: dict[str, Any]) -> dict[str, Any]:
    """A table whose ``servers:`` lists a fleet (``engine: remote``) and gives no
    ``rollout_devices``: one engine of ``devices_per_engine`` devices per server."""
    urls = (table.get("servers") or {}).get("urls")
    if urls and "rollout_devices" not in table:
        return {**table, "rollout_devices": len(urls) * table.get("devices_per_engine", 1)}
    return table


def servers_run(table: dict[str, Any]) -> dict[str, Any]:
    """The run settings a table's ``servers:`` fixes: ``engine: remote`` at its ``urls``,
    ``remote.weights_dir`` from its ``weights_dir``."""
    servers = table.get("servers") or {}
    if not servers.get("urls"):
        return {}
    return {"engine": "remote", "remote.urls": list(servers["urls"]),
            **({"remote.weights_dir": servers["weights_dir"]} if servers.get("weights_dir") else {})}


def cluster_costs(table: dict[str, Any]) -> Costs:
    """A cluster table's costs. The engine's decode step is given (``decode_step_s``,
    ``per_sequence_s``) or calibrated so that the sync baseline generates a step's batch
    in the published ``sync_baseline.generation_s``; the learner is given as tokens/s per
    device or as ``seconds_per_step`` at the workload's mean step; the sync baseline runs
    colocated on every device (``sync_baseline.layout``) unless the table says ``split``."""
    rollout_devices, learner_devices = table["rollout_devices"], table["learner_devices"]
    per_engine = table.get("devices_per_engine", 1)
    e, lr, w, base = table["engine"], table["learner"], table["workload"], table.get("sync_baseline", {})
    run = table.get("run", {})
    lengths = w["response_tokens"]
    max_tokens = run.get("sampling.max_tokens", 1 << 30)
    workload = Workload(
        response_tokens=tuple(lengths) if isinstance(lengths, list) else (),
        prompt_tokens=tuple(w["prompt_tokens"]) if isinstance(w.get("prompt_tokens"), list)
        else (w.get("prompt_tokens", 256),),
        lognormal=None if isinstance(lengths, list) else (lengths["mean"], lengths.get("sigma", 0.5),
                                                           min(lengths["max"], max_tokens)),
        filtered_fraction=w.get("filtered_fraction", 0.0))
    colocated = base.get("layout", "colocated") == "colocated"
    everything = rollout_devices + learner_devices
    sync_engines = (everything if colocated else rollout_devices) // per_engine
    per_step = run.get("batch_size", 1) * run.get("group_size", 1)
    draws = _draws(workload, per_step)
    notes = list(table.get("notes", []))

    if "decode_step_s" in e:
        step_s, per_sequence_s = e["decode_step_s"], e.get("per_sequence_s", 0.0)
    else:  # calibrated: a step with b sequences costs step_s · (1 + b / batch_doubling)
        doubling = e.get("batch_doubling", 64)
        shape = EngineCosts(step_s=1.0, per_sequence_s=1 / doubling, max_batch=e.get("max_batch", 256))
        step_s = e["sync_generation_s"] / generation_time(shape, draws, sync_engines)
        per_sequence_s = step_s / doubling
        notes.append(f"engine: decode step calibrated to the sync baseline's {e['sync_generation_s']:g} s of "
                     f"generation per step: {step_s * 1e3:.3g} ms + {per_sequence_s * 1e3:.3g} ms per sequence "
                     f"(assumed: {doubling} sequences double a step's time)")
    engine = EngineCosts(step_s=step_s, per_sequence_s=per_sequence_s,
                         per_context_token_s=e.get("per_context_token_s", 0.0), prefill_s=e.get("prefill_s", 0.0),
                         prefill_per_row_s=e.get("prefill_per_prompt_s", 0.0),
                         prefill_per_token_s=1 / e["prefill_tokens_per_s"] if e.get("prefill_tokens_per_s") else 0.0,
                         max_batch=e.get("max_batch", 256))
    mean_tokens = statistics.mean(sum(batch) for batch in draws) + per_step * statistics.mean(workload.prompt_tokens)

    def learner(devices: int, seconds_per_step: float | None, overhead_s: float = 0.0) -> LearnerCosts:
        per_token = (seconds_per_step / mean_tokens if seconds_per_step is not None
                     else 1 / (lr["tokens_per_s_per_device"] * devices))
        return LearnerCosts(per_token_s=per_token, step_s=lr.get("step_s", 0.0), recompute=lr.get("recompute", 0.0),
                            overhead_s=lr.get("overhead_s", 0.0) + overhead_s)

    split_learner = learner(learner_devices, lr.get("seconds_per_step"))
    sync_learner = learner(everything if colocated else learner_devices, base.get("learner_seconds_per_step"),
                           base.get("other_s", 0.0))
    s = table.get("weight_sync", {})
    sync = SyncCosts(fixed_s=s.get("fixed_s", 0.0),
                     bytes=table.get("model_params_b", 0) * 1e9 * s.get("bytes_per_param", 2),
                     bytes_per_s=s.get("gb_per_s", math.inf) * 1e9, per_engine_s=s.get("per_engine_s", 0.0))
    return Costs(engine=engine, learner=split_learner, sync=sync, workload=workload,
                 engines=rollout_devices // per_engine, source=table.get("name", "cluster table"), table=table,
                 notes=notes, sync_engines=sync_engines, sync_learner=sync_learner)


def _draws(workload: Workload, per_step: int, steps: int = 8) -> list[list[int]]:
    """``steps`` batches of response lengths as the workload draws them (fixed seed)."""
    rng = random.Random(0)
    return [[workload.draw(rng)[1] for _ in range(per_step)] for _ in range(steps)]  # a table's draws are i.i.d.
