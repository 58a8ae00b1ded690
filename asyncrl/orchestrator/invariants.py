"""The invariants a healthy run keeps, each a small pure function over the rows a run
writes (``metrics.jsonl``, ``samples.jsonl``, ``errors.jsonl``): checked live, a step at a
time (:class:`InvariantWatch`, one warning per invariant), and over a whole run directory
by ``asyncrl doctor`` (``asyncrl/report/doctor.py``).

A step check looks at one metrics row (and the one before it, for cumulative counters)
and says ``(status, evidence)`` when the row breaks its invariant, None when it keeps it
or does not carry its metric. A run check looks at every row at once. Each invariant has
a name, the fix to try, and statuses: ``FAIL`` (training is meaningless: weights not
delivered, samples older than η, nothing left to learn from), ``WARN`` (a part is broken
or wasteful, training goes on), ``OK``, ``SKIP`` (the run has no evidence either way:
the metric was never logged).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.algorithms.mismatch import MAX_LAG
from asyncrl.modes import off_policy_groups, staleness_fraction, staleness_lag, trajectory_staleness
from asyncrl.orchestrator.findings import (  # noqa: F401 (the vocabulary, importable here as it always was)
    FAIL,
    OK,
    SEVERITY,
    SKIP,
    WARN,
    Finding,
    Limits,
    Row,
    num,
    step_of,
    worst,
)
from asyncrl.orchestrator.frozen_invariants import (  # noqa: F401 (importable here as they always were)
    JUDGE_FAIL_SHARE,
    JUDGE_FAILURES,
    TEACHER_CHECK,
    TEACHER_FIX,
    TEACHER_LOGPROBS,
    judge_failures,
    teacher_logprob_evidence,
    teacher_logprobs,
)

MISMATCH_K3_WARN = 1e-3
"""k3 KL(μ ‖ π) at lag 0 above which the engine and learner disagree more than numerics
explain: float32 on one machine gives ~1e-6, a bfloat16 engine ~1e-4 to 1e-3."""
MISMATCH_K3_FAIL = 1e-2
"""k3 at lag 0 above which the engine is not computing the trained version at all (a
skipped sync, wrong weights): a whole step of learning's distance."""
MISMATCH_BEYOND_WARN = 0.01
"""Share of lag-0 tokens beyond ``MISMATCH_BOUND`` above which the mismatch warns."""
SAME_SCORE_WARN = 0.5
"""Share of trained groups whose samples all scored the same (advantage 0: nothing learned
from them) above which it warns; all of them fails."""
SAME_SCORE = "trained groups that all score the same"
SAME_SCORE_FIX = ("the reward gives every sample of a group one score (a constant reward, a broken parser of "
                  "answers): check the reward function; algorithm.filter_zero_variance=true drops such groups")
STALE_DROP_WARN = 0.1
"""Share of generated groups dropped as stale above which it warns (generation wasted)."""


Judgement = tuple[str, str] | None
StepCheck = Callable[[Row, Row | None, Limits], Judgement]


def _delta(row: Row, prev: Row | None, key: str) -> float | None:
    """A cumulative counter's increase over the step (its value at the first row). A
    counter below the row before it started again from 0 in a new process (a resume that
    did not carry it over, as runs before the checkpoint kept the gateway's counts): its
    value is what the new process counted, never a negative increase."""
    now = num(row, key)
    if now is None:
        return None
    before = num(prev, key) or 0.0
    return now if now < before else now - before


# ---------------------------------------------------------------- step checks
def weights_delivered(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    diff = num(row, "weight_sync/probe_max_abs_diff")
    if diff is None and "weight_sync/probe_max_abs_diff" in row:  # logged as null: NaN
        return FAIL, "the probe's max |Δ| is NaN (or an engine sampled the probe at another version)"
    if diff is not None and diff > limits.check_tolerance:
        return FAIL, (f"the engines' probe logprobs are {diff:.3g} from the learner's "
                      f"(tolerance {limits.check_tolerance:g})")
    return None


def mismatch_at_lag0(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    k3, beyond = num(row, "mismatch/k3_lag0"), num(row, "mismatch/beyond_fraction_lag0")
    if k3 is None:
        return None
    said = (f"k3 {k3:.3g}, max |Δ| {num(row, 'mismatch/max_abs_lag0') or 0:.3g}, "
            f"{beyond or 0:.1%} of {int(num(row, 'mismatch/tokens_lag0') or 0)} tokens beyond the bound")
    if k3 > MISMATCH_K3_FAIL:
        return FAIL, said
    if k3 > MISMATCH_K3_WARN or (beyond or 0) > MISMATCH_BEYOND_WARN:
        return WARN, said
    return None


def tool_parse_failures(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    failed = _delta(row, prev, "rollout/tool_parse_errors_total")
    if failed:
        return WARN, f"{int(failed)} tool calls in the step the parser could not read"
    return None


def template_rewrites(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    n = num(row, "rollout/template_rewrites")
    if n:
        return WARN, f"{int(n)} chat turns whose template rewrote earlier turns (a new trajectory each)"
    return None


def untrainable_episodes(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    n = num(row, "rollout/untrainable_episodes")
    if n:
        return WARN, f"{int(n)} episodes with no model token to train on"
    return None


def filtered_share(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    share = num(row, "rollout/filtered_fraction_window")
    if share is not None and share > limits.starvation_warn_fraction:
        return WARN, f"{share:.0%} of the latest groups filtered (every sample scored the same)"
    return None


def same_score_trained(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    """Not judged with a critic: there a group whose samples all scored the same still has
    per-token advantages (its values differ), so it teaches, and the fix named
    (``filter_zero_variance``) does not apply to ``gae``."""
    if limits.critic:
        return None
    share = num(row, "rollout/same_score_fraction")
    if share is not None and share > SAME_SCORE_WARN:
        return FAIL if share >= 1 else WARN, f"{share:.0%} of the step's trained groups have zero reward variance"
    return None


def stale_drops(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    dropped, generated = num(row, "buffer/stale_dropped_total"), _generated(row)
    if dropped and generated and dropped / generated > STALE_DROP_WARN:
        return WARN, (f"{int(dropped)} of {int(generated)} groups generated so far dropped as stale "
                      f"({dropped / generated:.0%})")
    return None


def repeated_searches(row: Row, prev: Row | None, limits: Limits) -> Judgement:
    share = num(row, "agent/duplicate_search_fraction")
    if share is not None and share > 0.5:
        return WARN, f"{share:.0%} of the step's episodes repeated a search (the duplicate guard's note)"
    return None


def _generated(row: Row) -> float | None:
    parts = [num(row, f"rollout/groups_{k}_total") for k in ("accepted", "filtered", "all_error")]
    return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]


@dataclass(frozen=True)
class StepInvariant:
    name: str
    check: StepCheck
    fix: str
    keys: tuple[str, ...]  # the metrics it reads: a run that logged none of them is SKIP


STEP_INVARIANTS = (
    StepInvariant("weights delivered", weights_delivered,
                  "the engines do not compute the learner's weights: check the weight sync (a skipped or failed "
                  "load, LoRA adapters not applied); for another engine's kernels raise weight_sync.check_tolerance",
                  ("weight_sync/probe_max_abs_diff",)),
    StepInvariant("engine-learner mismatch at lag 0", mismatch_at_lag0,
                  "tokens the trained version sampled score differently in the learner: a sync that did not load "
                  "(see 'weights delivered'), an engine in another precision (algorithm.is_mask or "
                  "policy_loss=icepop mask such tokens), or a different sampling temperature",
                  ("mismatch/k3_lag0",)),
    StepInvariant("tool-call parse failures", tool_parse_failures,
                  "the model writes tool calls the parser cannot read: set gateway.tool_parser to the format the "
                  "chat template teaches (auto picks it), or warm the policy up on that format (asyncrl sft)",
                  ("rollout/tool_parse_errors_total",)),
    StepInvariant("template rewrites", template_rewrites,
                  "the chat template renders earlier turns differently from what was sampled (e.g. it strips "
                  "reasoning): use a template that keeps history, or accept one trajectory per turn",
                  ("rollout/template_rewrites",)),
    StepInvariant("episodes with no trainable token", untrainable_episodes,
                  "a workflow returned trajectories holding only prompt or tool tokens: check that the model's "
                  "replies reach the trajectory (sampling.max_tokens > 0, the agent uses the gateway's base_url)",
                  ("rollout/untrainable_episodes",)),
    StepInvariant("filtered groups (all samples scored the same)", filtered_share,
                  "the reward cannot tell samples apart: check the reward function, make the tasks harder or "
                  "easier, raise group_size, or task.sampler to skip saturated tasks",
                  ("rollout/filtered_fraction_window",)),
    StepInvariant(SAME_SCORE, same_score_trained, SAME_SCORE_FIX, ("rollout/same_score_fraction",)),
    StepInvariant("repeated searches", repeated_searches,
                  "most episodes search again for what they already read: penalise it (the agent's "
                  "duplicate_penalty), warm the policy up on traces that search once per hop, or cap its turns",
                  ("rollout/duplicate_searches", "agent/duplicate_search_fraction")),
    StepInvariant("stale drops", stale_drops,
                  "groups outlive η: raise max_staleness, lower sampling.max_tokens, or stale_groups=wait",
                  ("buffer/stale_dropped_total",)),
)


def train_rows(metrics: Sequence[Row]) -> list[Row]:
    """The optimizer steps' rows (step ≥ 1), in order."""
    return [r for r in metrics if (num(r, "step") or 0) >= 1]


def step_finding(inv: StepInvariant, rows: Sequence[Row], limits: Limits) -> Finding:
    """``inv`` over every step: the worst status, the first step it broke, that step's
    evidence and how many steps broke it."""
    if not any(k in r for r in rows for k in inv.keys):
        return Finding(inv.name, SKIP, None, f"not logged ({', '.join(inv.keys)})")
    broken: list[tuple[int, str, str]] = []
    prev = None
    for row in rows:
        judged = inv.check(row, prev, limits)
        if judged is not None:
            broken.append((step_of(row), *judged))
        prev = row
    if not broken:
        return Finding(inv.name, OK, None, _ok_evidence(inv, rows, limits))
    gravest = max(SEVERITY[s] for _, s, _ in broken)
    step, status, evidence = next(b for b in broken if SEVERITY[b[1]] == gravest)
    return Finding(inv.name, status, step, f"{evidence}; {len(broken)} of {len(rows)} steps", inv.fix)


def _ok_evidence(inv: StepInvariant, rows: Sequence[Row], limits: Limits) -> str:
    values = [v for r in rows if (v := num(r, inv.keys[0])) is not None]
    if inv.check is mismatch_at_lag0:
        return f"k3 ≤ {max(values):.2g} over {len(values)} steps; " + _by_lag(rows)
    if inv.check is weights_delivered:
        return f"probe max |Δ| ≤ {max(values):.2g} in {len(values)} checks"
    if inv.check is same_score_trained and limits.critic:
        return "not judged with a critic: its advantages train a group whose samples all scored the same"
    if inv.check is same_score_trained:
        return f"at most {max(values):.0%} of a step's trained groups have zero reward variance"
    if inv.check is filtered_share:
        return f"filtered share of the latest groups ≤ {max(values):.0%}"
    return f"none in {len(rows)} steps"


def _by_lag(rows: Sequence[Row]) -> str:
    """The mean k3 and largest |Δ| at every lag a run logged: past lag 0 it holds learning
    too, what the staleness correction is for."""
    parts = []
    for lag in range(MAX_LAG + 1):  # the last is every lag from MAX_LAG on
        k3 = [v for r in rows if (v := num(r, f"mismatch/k3_lag{lag}")) is not None]
        if k3:
            top = max(num(r, f"mismatch/max_abs_lag{lag}") or 0.0 for r in rows)
            parts.append(f"lag {lag}: k3 {sum(k3) / len(k3):.2g}, max |Δ| {top:.2g}")
    return "; ".join(parts)


# ----------------------------------------------------------------- run checks
def staleness_bound(samples: Sequence[Row], limits: Limits) -> Finding:
    """Every trained sample at most ``ceil(η)`` versions old (never newer than the trained
    version); for a fractional η, also at most ``floor(η · B)`` groups of a step with a
    sample from an older version (``orchestrator/staleness.py`` proves both)."""
    name, fix = "staleness ≤ η", "a bug in the staleness gate or a resumed run's versions: report it with the run dir"
    ages = [(int(s["step"]), trajectory_staleness(int(t), int(b)), s.get("group")) for s in samples
            if (t := num(s, "trained_version")) is not None and (b := num(s, "behavior_version_min")) is not None
            and s.get("response_tokens", 1)]  # no model token: no version (-1), not a sample of any policy
    if not ages or limits.max_staleness is None:
        return Finding(name, SKIP, None, "no samples with versions, or no max_staleness in config.yaml")
    eta, lag = limits.max_staleness, staleness_lag(limits.max_staleness)
    bound = f"η={eta}" if lag == eta else f"ceil(η={eta})={lag}"
    bad = [(step, age) for step, age, _ in ages if not 0 <= age <= lag]
    if bad:
        return Finding(name, FAIL, bad[0][0], f"{len(bad)} samples outside [0, {bound}], the first {bad[0][1]} old",
                       fix)
    evidence = f"max {max(a for _, a, _ in ages)} ≤ {bound} over {len(ages)} samples"
    if staleness_fraction(eta).denominator == 1 or limits.batch_size is None:
        return Finding(name, OK, None, evidence)
    most, off = off_policy_groups(eta, limits.batch_size), defaultdict(set)
    for step, age, group in ages:
        if age > 0:
            off[step].add(group)
    over = sorted((step, len(groups)) for step, groups in off.items() if len(groups) > most)
    share = f"floor(η·B)={most} of B={limits.batch_size}"
    if over:
        return Finding(name, FAIL, over[0][0], f"{len(over)} steps train more off-policy groups than {share}, "
                       f"the first {over[0][1]}", fix)
    return Finding(name, OK, None, f"{evidence}; at most {max(map(len, off.values()), default=0)} off-policy groups "
                   f"a step ≤ {share}")


def same_score_groups(samples: Sequence[Row]) -> Finding:
    """Trained groups whose samples all scored the same (advantage 0, nothing learned), from
    ``samples.jsonl``: for a run logged before ``rollout/same_score_fraction``."""
    name, fix = SAME_SCORE, SAME_SCORE_FIX
    groups: dict[tuple[int, Any], list[float]] = defaultdict(list)
    for s in samples:
        if (r := num(s, "reward")) is not None:
            groups[(int(s["step"]), s.get("group"))].append(r)
    if not groups:
        return Finding(name, SKIP, None, "no samples")
    same = sorted(step for (step, _), rewards in groups.items() if len(rewards) > 1 and max(rewards) == min(rewards))
    share = len(same) / len(groups)
    evidence = f"{len(same)} of {len(groups)} trained groups ({share:.0%}) have zero reward variance"
    if share >= 1:
        return Finding(name, FAIL, same[0], evidence, fix)
    if share > SAME_SCORE_WARN:
        return Finding(name, WARN, same[0], evidence, fix)
    return Finding(name, OK, None, evidence)


def episode_errors(errors: Sequence[Row], rows: Sequence[Row]) -> Finding:
    """Failed episode attempts (``errors.jsonl``): the most frequent exception named."""
    name = "failed episodes (errors.jsonl)"
    total = max((num(r, "rollout/episodes_error_total") or 0 for r in rows), default=0)
    if not errors and not total:
        return Finding(name, OK, None, "none")
    counts = Counter(str(e.get("exception", "?")).splitlines()[0][:120] for e in errors)
    common, n = counts.most_common(1)[0] if counts else ("?", 0)
    steps = [int(s) for e in errors if (s := num(e, "step")) is not None]
    return Finding(name, WARN, min(steps) if steps else None,
                   f"{len(errors)} attempts logged ({int(total)} episodes failed in all); "
                   f"most frequent: {common} (×{n})",
                   "read its traceback in errors.jsonl; a reward or tool that raises fails only its episode, "
                   "the watchdog stops the run past watchdog.max_error_rate")


def servers_lost(rows: Sequence[Row]) -> Finding | None:
    """``engine: remote``'s servers lost during the run (``remote/*``, ``RolloutHandle.engine_fleet``):
    the run went on without them, re-issuing their requests from the tokens received, so a
    loss is a ``WARN`` naming each server and what was re-issued; None for other engines."""
    name = "engine servers lost"
    fleet = [r for r in rows if "remote/servers_lost_total" in r]
    if not fleet:
        return None
    keys = ("remote/servers_lost_total", "remote/reissued_requests_total", "remote/reissued_tokens_total")
    lost = reissued = tokens = 0.0
    first, names, prev = None, [], None
    for row in fleet:
        now = [num(row, k) or 0.0 for k in keys]
        before = [num(prev, k) or 0.0 for k in keys]
        if any(n < b for n, b in zip(now, before)):  # a resumed process: its counts start from 0 again
            before = [0.0] * len(keys)
        step_lost = now[0] - before[0]
        lost, reissued, tokens = lost + step_lost, reissued + now[1] - before[1], tokens + now[2] - before[2]
        if step_lost and first is None:
            first = step_of(row)
        said = row.get("remote/lost_servers")
        if isinstance(said, str) and said and said not in names:
            names.append(said)
        prev = row
    up = num(fleet[-1], "remote/servers_up")
    at_end = f"; {int(up)} up at step {step_of(fleet[-1])}" if up is not None else ""
    if not lost:
        return Finding(name, OK, None, f"none lost in {len(fleet)} steps{at_end}")
    losses = f"{int(lost)} server loss{'es' if lost != 1 else ''} ({'; '.join(names) or 'unnamed'})"
    return Finding(name, WARN, first, f"{losses}, {int(reissued)} requests re-issued on the others carrying "
                   f"{int(tokens)} tokens already received{at_end}",
                   "read the lost servers' logs (killed, out of memory, a slow answer past "
                   "remote.request_timeout_s); the run goes on without them and uses a server again once its "
                   "/health answers")


CRITIC_EV_STEPS = 10
"""A critic whose explained variance stayed ≤ 0 over the last this many steps after its
warm-up (or every step after it, if fewer) predicts the returns no better than a constant."""


def critic_explains(config: Row, rows: Sequence[Row]) -> Finding:
    """``critic/explained_variance`` after ``critic.warmup_steps``: a WARN when it stayed ≤ 0
    over the run's last :data:`CRITIC_EV_STEPS` steps (the advantages are then mostly the
    critic's noise)."""
    name = "critic explains the returns"
    critic = config.get("critic")
    warmup = (critic.get("warmup_steps") or 0) if isinstance(critic, dict) else 0
    logged = [(step_of(r), v) for r in rows if step_of(r) > warmup
              and (v := num(r, "critic/explained_variance")) is not None]
    if not logged:
        return Finding(name, SKIP, None, "no critic/explained_variance after the critic's warm-up")
    last = logged[-CRITIC_EV_STEPS:]
    if all(v <= 0 for _, v in last):
        return Finding(name, WARN, last[0][0], f"explained variance ≤ 0 at each of the last {len(last)} steps "
                       f"(the last {last[-1][1]:.3f})", "the critic predicts no better than a constant: raise "
                       "critic.warmup_steps or critic.optim.lr, or check that the rewards depend on the answer")
    return Finding(name, OK, None, f"explained variance {last[-1][1]:.3f} at step {last[-1][0]}")


def run_finished(rows: Sequence[Row], limits: Limits) -> Finding:
    """Whether the run trained every step it was asked for."""
    name = "run finished"
    if not rows:
        return Finding(name, FAIL, None,
                       "no optimizer step logged: the run stopped (or is still) before its first step",
                       "read the run's stderr; a run whose groups are all filtered never trains (see above)")
    last = step_of(rows[-1])
    if limits.total_steps is not None and last < limits.total_steps:
        return Finding(name, WARN, last, f"last step {last} of total_steps={limits.total_steps}: crashed, stopped "
                       "or still running", "resume it (resume=true), or read its stderr for why it stopped")
    return Finding(name, OK, None, f"{last} steps")


def check_run(config: Row, max_staleness: float | None, metrics: Sequence[Row], samples: Sequence[Row],
              errors: Sequence[Row]) -> list[Finding]:
    """Every invariant over a run's rows, in a fixed order."""
    limits = Limits.from_config(config, max_staleness)
    rows = train_rows(metrics)
    findings = [step_finding(inv, rows, limits) for inv in STEP_INVARIANTS]
    findings = [same_score_groups(samples) if f.name == SAME_SCORE and f.status == SKIP else f for f in findings]
    findings[2:2] = [staleness_bound(samples, limits)]
    fleet = servers_lost(rows)  # engine=remote only
    return [*findings, *([fleet] if fleet else []), teacher_logprobs(config, rows),
            judge_failures(config, rows, errors), episode_errors(errors, rows),
            *([critic_explains(config, rows)] if config.get("critic") else []), run_finished(rows, limits)]


class InvariantWatch:
    """The step checks, live: each row of a running training is judged as it is logged, and
    the first break of each invariant is said once (``say``), with its step, its number
    and the fix; the rest show in ``asyncrl doctor``."""

    def __init__(self, limits: Limits, say: Callable[[str], None], prev: Row | None = None) -> None:
        """``prev``: a resumed run's last row, from which its first step's counters increase."""
        self.limits, self.say = limits, say
        self.prev = prev
        self.said: set[str] = set()

    def observe(self, row: Row) -> None:
        for inv in STEP_INVARIANTS:
            if inv.name in self.said:
                continue
            judged = inv.check(row, self.prev, self.limits)
            if judged is not None:
                self.said.add(inv.name)
                status, evidence = judged
                self.say(f"asyncrl: {status} {inv.name} at step {row['step']}: {evidence}; fix: {inv.fix} "
                         "(said once; asyncrl doctor RUN_DIR checks the whole run)")
        self.prev = row
