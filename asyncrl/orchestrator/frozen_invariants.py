"""The frozen models' invariants, over a run's rows: the teacher's scores match what it
samples (its pre-flight check, in the first row of each process), and the judge asked by URL
answers (its failed calls, over the whole run). Pure, as every invariant; said by
``asyncrl doctor`` and, for the teacher, live by the pre-flight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from asyncrl.frozen.judge import uses_judge
from asyncrl.orchestrator.findings import FAIL, OK, SKIP, Finding, Row, num, step_of

TEACHER_LOGPROBS = "teacher's scores match its sampling"
TEACHER_CHECK = "teacher/logprob_check_max_abs_diff"
TEACHER_FIX = ("serve the teacher so that its scores (prompt_logprobs) are the distribution it samples from: the same "
               "model and weights behind both routes, vLLM with --generation-config vllm (no penalties or top-k/top-p "
               "from the model's generation_config.json) and --logprobs-mode processed_logprobs (the logprobs of what "
               "it samples); a bf16/fp16 teacher whose gap is rounding alone: raise teacher.check_tolerance")
JUDGE_FAILURES = "judge calls that failed"
JUDGE_FAIL_SHARE = 0.5
"""Share of the judge's calls that failed (over the whole run) above which the doctor FAILs:
most episodes then learn from retries, or are dropped, not from the judge's grades."""


def teacher_logprob_evidence(url: str | None, diff: float, tokens: int, tolerance: float) -> str:
    """One sentence on the teacher's check, the live line's and the doctor's."""
    return (f"the teacher at {url}: its logprobs of {tokens} tokens it sampled and its scores of the same tokens "
            f"differ by up to {diff:.3g} (teacher.check_tolerance {tolerance:g})")


def _section(config: Row, name: str) -> Row:
    part = config.get(name)
    return part if isinstance(part, dict) else {}


def teacher_logprobs(config: Row, rows: Sequence[Row]) -> Finding:
    """The teacher's check (pre-flight, ``asyncrl/frozen/teacher.py``: its sampled logprobs
    against its scores of the same tokens) in the first row of each process of the run: FAIL
    when one is beyond ``teacher.check_tolerance`` (or NaN)."""
    teacher = _section(config, "teacher")
    url = teacher.get("url")
    if not url:
        return Finding(TEACHER_LOGPROBS, OK, None, "no teacher in this run (teacher.url unset)")
    checks = [(step_of(r), v if (v := num(r, TEACHER_CHECK)) is not None else math.nan,
               int(num(r, "teacher/logprob_check_tokens") or 0)) for r in rows if TEACHER_CHECK in r]
    if not checks:
        return Finding(TEACHER_LOGPROBS, SKIP, None, f"not logged ({TEACHER_CHECK})")
    tolerance = float(teacher.get("check_tolerance") or 0.5)
    bad = [c for c in checks if not c[1] <= tolerance]
    step, diff, tokens = bad[0] if bad else max(checks, key=lambda c: c[1])
    evidence = teacher_logprob_evidence(url, diff, tokens, tolerance)
    if bad:
        return Finding(TEACHER_LOGPROBS, FAIL, step, f"{evidence}; {len(bad)} of {len(checks)} checks", TEACHER_FIX)
    return Finding(TEACHER_LOGPROBS, OK, None, f"{evidence}; {len(checks)} checks")


def judge_failures(config: Row, rows: Sequence[Row], errors: Sequence[Row]) -> Finding:
    """The judge by URL's calls that failed, over the whole run: the rows' counters
    (``rollout/judge_calls_total``, ``rollout/judge_failures_total``, cumulative, from the last
    row) raised by the judge's failed attempts in ``errors.jsonl`` beyond them (those after the
    last row; a run stopped before its first step has only these). FAIL above
    :data:`JUDGE_FAIL_SHARE`, naming the judge, the counts and its last error."""
    judge, reward_fn = _section(config, "judge"), _section(config, "task").get("reward_fn")
    if not uses_judge(reward_fn):
        return Finding(JUDGE_FAILURES, OK, None, "no judge in this run (task.reward_fn does not name it)")
    url = judge.get("url")
    if not url:
        return Finding(JUDGE_FAILURES, OK, None, f"a local reward model ({judge.get('reward_model')}): its failures "
                       "are the failed episodes'")
    last = next((r for r in reversed(rows) if "rollout/judge_calls_total" in r), {})
    calls, failures = int(num(last, "rollout/judge_calls_total") or 0), int(num(last, "rollout/judge_failures_total")
                                                                              or 0)
    logged = [e for e in errors if f"the judge at {url}" in str(e.get("exception", ""))]
    beyond = max(0, len(logged) - failures)
    calls, failures = calls + beyond, failures + beyond
    if not calls:
        return Finding(JUDGE_FAILURES, SKIP, None, "no judge call logged (rollout/judge_calls_total, errors.jsonl)")
    said = f"the judge at {url} failed {failures} of {calls} calls ({failures / calls:.0%})"
    if logged:
        said += f"; the last error: {str(logged[-1]['exception']).splitlines()[0][:200]}"
    if failures / calls > JUDGE_FAIL_SHARE:
        steps = [int(s) for e in logged if (s := num(e, "step")) is not None]
        return Finding(JUDGE_FAILURES, FAIL, min(steps) if steps else None, said,
                       "check that the judge's server is up and answers /v1/chat/completions within judge.timeout_s "
                       "(raise it, or judge.max_concurrency lower, for a loaded server); a reply with no grade: make "
                       "judge.prompt ask for the format judge.grade_pattern reads")
    return Finding(JUDGE_FAILURES, OK, None, said)
