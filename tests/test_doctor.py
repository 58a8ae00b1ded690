"""``asyncrl doctor``: each invariant broken on purpose, and named with its status and step.

A real tiny run (the addition example, a few steps) is the healthy case; broken runs are
real runs where that is cheap (a constant reward, episodes with no model token, a weight
sync that loads nothing) or that healthy run's files edited to show what a broken part
would log (a failed delivery check, tool calls nobody parses, a run cut short)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.orchestrator.invariants import FAIL, OK, SKIP, WARN, InvariantWatch, Limits, check_run
from asyncrl.report import load_run
from asyncrl.report.doctor import diagnose, findings

ADDITION = "examples/addition/async.yaml"
FAST = ["total_steps=4", "eval_every=0", "eval.num_tasks=8", "eval.samples_per_task=2", "weight_sync.check_every=1"]


def _train(out: Path, *overrides: str, config: str = ADDITION) -> Path:
    assert main(["train", config, f"output_dir={out}", *FAST, *overrides]) == 0
    return out


def _by_name(run_dir: Path) -> dict[str, object]:
    return {f.name: f for f in findings(load_run(run_dir))}


def _edit(src: Path, dst: Path, name: str, edit) -> Path:
    """A copy of run ``src`` whose ``name`` rows went through ``edit(rows) -> rows``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"))
    path = dst / name
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))
    return dst


def _at_step(step: int, **values):
    def edit(rows):
        return [{**r, **values} if r["step"] == step else r for r in rows]
    return edit


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("doctor") / "healthy")


@pytest.mark.slow
def test_a_healthy_example_is_all_ok(healthy, capsys):
    assert main(["doctor", str(healthy)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.split(" ", 1)[0] in (OK, WARN, FAIL, SKIP)]
    assert lines and all(line.startswith(OK) for line in lines), out
    assert "verdict: OK (exit 0)" in out
    # the new per-step metrics are there: the mismatch at lag 0 is float32 noise
    rows = [json.loads(line) for line in (healthy / "metrics.jsonl").read_text().splitlines()]
    lag0 = [r["mismatch/k3_lag0"] for r in rows if "mismatch/k3_lag0" in r]
    assert lag0 and max(lag0) < 1e-6
    assert all(r["rollout/untrainable_episodes"] == 0 for r in rows if r["step"] >= 1)


@pytest.mark.slow
def test_the_doctor_is_in_the_report(healthy, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = shutil.copytree(healthy, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints"))
    assert main(["report", str(run)]) == 0
    assert "OK    engine-learner mismatch at lag 0" in capsys.readouterr().err
    assert "<h2>Doctor</h2>" in (run / "report.html").read_text()


@pytest.mark.slow
def test_a_sync_that_loads_nothing_shows_as_mismatch_at_lag_0(tmp_path, monkeypatch, capsys):
    """A real skipped sync: the engine stamps the new version and keeps the old weights.
    In sync mode every token is lag 0, so the learner sees the whole difference."""
    async def version_only(self, weights, version):
        def stamp() -> None:
            self._version = version
        await self._call(stamp)

    monkeypatch.setattr(TorchEngine, "update_weights", version_only)
    run = _train(tmp_path / "skipped", "weight_sync.check_every=0", "optim.lr=0.003",
                 config="examples/addition/sync.yaml")
    found = _by_name(run)["engine-learner mismatch at lag 0"]
    assert found.status in (WARN, FAIL) and found.step == 2, found  # step 1 samples the initial weights: no gap yet
    said = [line for line in capsys.readouterr().err.splitlines() if "mismatch at lag 0 at step" in line]
    assert len(said) == 1 and f"asyncrl: {found.status} engine-learner mismatch at lag 0 at step 2: k3" in said[0]
    assert main(["doctor", str(run)]) >= 1


@pytest.mark.slow
def test_a_constant_reward_fails_same_score_groups(tmp_path, capsys):
    run = _train(tmp_path / "constant", "task.reward_fn=tests/doctor_breakers.py:constant",
                 "algorithm.filter_zero_variance=false")
    assert "asyncrl: FAIL trained groups that all score the same at step 1: 100%" in capsys.readouterr().err
    found = _by_name(run)["trained groups that all score the same"]
    assert (found.status, found.step) == (FAIL, 1), found
    assert "100% of the step's trained groups" in found.evidence and "4 of 4 steps" in found.evidence
    assert main(["doctor", str(run)]) == 2
    # a run logged before the metric existed: the same verdict from samples.jsonl
    old = _edit(run, tmp_path / "old", "metrics.jsonl",
                lambda rows: [{k: v for k, v in r.items() if k != "rollout/same_score_fraction"} for r in rows])
    found = _by_name(old)["trained groups that all score the same"]
    assert (found.status, found.step) == (FAIL, 1) and "32 of 32 trained groups" in found.evidence, found


@pytest.mark.slow
def test_episodes_with_only_tool_tokens_are_named_and_the_run_goes_on(tmp_path):
    run = _train(tmp_path / "untrainable", "workflow.name=tests/doctor_breakers.py:EveryFourthWithoutModelTokens")
    found = _by_name(run)["episodes with no trainable token"]
    assert (found.status, found.step) == (WARN, 1), found
    assert _by_name(run)["staleness ≤ η"].status == OK  # their samples (no version) are not counted as stale


@pytest.mark.slow
@pytest.mark.parametrize(("name", "edit", "invariant", "status", "step"), [
    ("undelivered", _at_step(3, **{"weight_sync/probe_max_abs_diff": 0.25}), "weights delivered", FAIL, 3),
    ("perturbed", _at_step(2, **{"mismatch/k3_lag0": 0.03, "mismatch/beyond_fraction_lag0": 0.2}),
     "engine-learner mismatch at lag 0", FAIL, 2),
    ("bf16", _at_step(2, **{"mismatch/k3_lag0": 0.002}), "engine-learner mismatch at lag 0", WARN, 2),
    ("unparsed", lambda rows: [{**r, "rollout/tool_parse_errors_total": 0 if r["step"] < 2 else 5} for r in rows],
     "tool-call parse failures", WARN, 2),
    ("rewritten", _at_step(4, **{"rollout/template_rewrites": 3}), "template rewrites", WARN, 4),
    ("starved", _at_step(3, **{"rollout/filtered_fraction_window": 0.95}),
     "filtered groups (all samples scored the same)", WARN, 3),
    ("stale", _at_step(2, **{"buffer/stale_dropped_total": 40}), "stale drops", WARN, 2),
    ("cut short", lambda rows: rows[:-2], "run finished", WARN, 2),
])
def test_each_broken_metric_is_named_with_its_step(healthy, tmp_path, name, edit, invariant, status, step):
    run = _edit(healthy, tmp_path / name, "metrics.jsonl", edit)
    found = _by_name(run)
    assert (found[invariant].status, found[invariant].step) == (status, step), found[invariant]
    assert found[invariant].fix  # a broken invariant says what to do
    others = [f for n, f in found.items() if n != invariant and f.status not in (OK, SKIP)]
    assert not others, others
    lines, code = diagnose(load_run(run))
    assert code == (2 if status == FAIL else 1)
    assert any(line.startswith(status) and invariant in line and f"first at step {step}" in line for line in lines)


@pytest.mark.slow
def test_samples_older_than_eta_fail(healthy, tmp_path):
    def age(rows):
        return [{**r, "behavior_version_min": r["trained_version"] - 5} if r["step"] == 3 else r for r in rows]

    found = _by_name(_edit(healthy, tmp_path / "stale", "samples.jsonl", age))["staleness ≤ η"]
    assert (found.status, found.step) == (FAIL, 3), found


@pytest.mark.slow
def test_errors_and_a_torn_line_of_a_crashed_run(healthy, tmp_path):
    run = shutil.copytree(healthy, tmp_path / "crashed", ignore=shutil.ignore_patterns("checkpoints"))
    (run / "errors.jsonl").write_text(json.dumps({"step": 2, "phase": "train", "task_id": "t", "attempt": 1,
                                                  "exception": "ValueError: the reward service is down",
                                                  "traceback": ""}) + "\n")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward/me')  # what a killed writer leaves
    with pytest.warns(UserWarning):
        found = _by_name(run)
    assert (found["failed episodes (errors.jsonl)"].status, found["failed episodes (errors.jsonl)"].step) == (WARN, 2)
    assert "the reward service is down" in found["failed episodes (errors.jsonl)"].evidence


def test_not_a_run_directory_is_a_usage_error(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert "has no config.yaml" in capsys.readouterr().err


def test_live_warnings_are_said_once_with_step_number_and_fix():
    said: list[str] = []
    watch = InvariantWatch(Limits(), said.append)
    for step, k3 in ((1, 1e-7), (2, 0.05), (3, 0.07)):
        watch.observe({"step": step, "mismatch/k3_lag0": k3, "mismatch/tokens_lag0": 10})
    assert len(said) == 1
    assert "FAIL engine-learner mismatch at lag 0 at step 2: k3 0.05" in said[0] and "fix:" in said[0]


def test_same_score_groups_are_not_judged_with_a_critic():
    """With ``gae`` a group whose samples all scored the same still has per-token advantages
    (the critic's values differ), and filter_zero_variance does not apply: no warning, live or
    in the doctor, where the same rows without a critic warn."""
    rows = [{"step": 0}, *({"step": s, "rollout/same_score_fraction": 0.75} for s in (1, 2))]
    critic = {"algorithm": {"advantage": "gae"}, "critic": {"value_clip": 0.2}}
    said: list[str] = []
    watch = InvariantWatch(Limits.from_config(critic, 2), said.append)
    for row in rows:
        watch.observe(row)
    assert said == []
    found = {f.name: f for f in check_run(critic, 2, rows, [], [])}["trained groups that all score the same"]
    assert found.status == OK and "not judged with a critic" in found.evidence
    plain = {f.name: f for f in check_run({}, 2, rows, [], [])}["trained groups that all score the same"]
    assert (plain.status, plain.step) == (WARN, 1) and "75% of the step's trained groups" in plain.evidence


def test_the_mismatch_by_lag_by_hand():
    """μ and π on four model tokens and a prompt position: lag 0 agrees exactly, lag 1
    differs by 0.5 on one token (k3 = e^0.5 − 1 − 0.5), lag 5 lands in the last bucket."""
    import math

    import torch

    from asyncrl.algorithms.mismatch import MAX_LAG, add_sums, mismatch_metrics, mismatch_sums

    behavior = torch.tensor([[0.0, -1.0, -1.0, -2.0, -3.0]])
    learner = torch.tensor([[9.0, -1.0, -0.5, -2.0, -3.05]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])  # the first position is a prompt token: never counted
    lag = torch.tensor([[0, 0, 1, 1, 5]])
    total = torch.zeros(MAX_LAG + 1, 4)
    add_sums(total, mismatch_sums(behavior, learner, mask, lag))
    add_sums(total, mismatch_sums(behavior, learner, mask, lag))  # a second micro-batch: counts add, max stays
    m = mismatch_metrics(total)
    assert m["mismatch/k3_lag0"] == 0 and m["mismatch/max_abs_lag0"] == 0 and m["mismatch/tokens_lag0"] == 2
    assert m["mismatch/k3_lag1"] == pytest.approx((math.exp(0.5) - 1 - 0.5) / 2, rel=1e-5)
    assert m["mismatch/max_abs_lag1"] == pytest.approx(0.5) and m["mismatch/beyond_fraction_lag1"] == 0.5
    assert m["mismatch/tokens_lag1"] == 4
    assert m[f"mismatch/max_abs_lag{MAX_LAG}"] == pytest.approx(0.05, rel=1e-4)
    assert m[f"mismatch/beyond_fraction_lag{MAX_LAG}"] == 0  # 0.05 is within the 0.1 bound
    assert "mismatch/k3_lag2" not in m  # a lag no token had is left out


def _parse_errors(monkeypatch, counted: int) -> None:
    """This process's rollout workers report ``counted`` tool calls their gateway could not
    parse (a process counts from 0: what a resumed run's new process reports)."""
    from asyncrl.rollout.worker import RolloutWorker

    real = RolloutWorker.gateway_counts

    async def gateway_counts(self):
        return {**await real(self), "tool_parse_errors": counted}

    monkeypatch.setattr(RolloutWorker, "gateway_counts", gateway_counts)


@pytest.mark.slow
def test_a_resumed_run_continues_its_counters_and_the_doctor_reads_its_current_total_steps(tmp_path, monkeypatch):
    """Two parse errors before a resume that raises total_steps from 2 to 4: every row
    after the resume still counts them (the new process's gateway starts from 0), and the
    doctor reads 4 steps of 4, the parse errors in one step of four."""
    out = tmp_path / "resumed"
    _parse_errors(monkeypatch, 2)
    _train(out, "total_steps=2")
    _parse_errors(monkeypatch, 0)
    _train(out, "total_steps=4", "resume=true")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rollout/tool_parse_errors_total"]) for r in rows if r["step"] >= 1] == [
        (1, 2), (2, 2), (3, 2), (4, 2)]
    lines, _ = diagnose(load_run(out))
    assert any(line.strip().startswith("steps trained: 4 of 4;") for line in lines), lines
    parse = next(line for line in lines if "tool-call parse failures" in line)
    assert parse.startswith(WARN) and "2 tool calls in the step" in parse and "1 of 4 steps" in parse, parse
    assert "first at step 1" in parse
    assert next(line for line in lines if "run finished" in line).startswith(OK)


def test_a_counter_that_restarted_in_a_resumed_process_and_a_raised_total_steps(tmp_path):
    """A run resumed before counters were kept across a resume: its parse-error counter
    fell from 2 to 0 in the new process, which counted nothing. The drop is a restart, not
    failures; and total_steps is the one the resume set (config_changes.jsonl)."""
    (tmp_path / "config.yaml").write_text("mode: async\nmax_staleness: 1\ntotal_steps: 2\n")
    (tmp_path / "config_changes.jsonl").write_text(json.dumps(
        {"resumed_from_step": 2, "time": "2026-11-26T12:00:00+00:00",
         "changed": {"total_steps": {"old": 2, "new": 4}}}) + "\n")
    counted = [1, 2, 0, 0]  # one parse error in each of steps 1 and 2; the resumed process restarts at 0
    rows = [{"step": 0}, *({"step": s, "rollout/tool_parse_errors_total": n} for s, n in enumerate(counted, 1))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning):  # no samples.jsonl / timeline.jsonl: a run killed early, said
        run = load_run(tmp_path)
    assert run.config["total_steps"] == 4
    lines, _ = diagnose(run)
    assert any(line.strip().startswith("steps trained: 4 of 4;") for line in lines), lines
    found = {f.name: f for f in findings(run)}
    parse = found["tool-call parse failures"]
    assert (parse.status, parse.step) == (WARN, 1) and parse.evidence.endswith("; 2 of 4 steps"), parse
    assert found["run finished"].status == OK


def test_engine_servers_lost_is_a_warning_naming_them_and_what_was_reissued():
    """``remote/*`` rows (``engine: remote``) by hand: a loss at step 2, one more at step 4 in a
    process resumed at step 4 (its counts from 0 again); a run without them has no such line."""
    def row(step, up, lost, requests, tokens, names):
        return {"step": step, "remote/servers_up": up, "remote/servers_lost_total": lost,
                "remote/reissued_requests_total": requests, "remote/reissued_tokens_total": tokens,
                "remote/lost_servers": names}

    a, b = "http://h1:8100", "http://h2:8100"
    rows = [row(1, 3, 0, 0, 0, ""), row(2, 2, 1, 2, 17, a), row(3, 2, 1, 2, 17, a),
            row(4, 2, 1, 1, 5, b)]
    by_name = {f.name: f for f in check_run({}, 1, rows, [], [])}
    found = by_name["engine servers lost"]
    assert (found.status, found.step) == (WARN, 2), found
    assert found.evidence == (f"2 server losses ({a}; {b}), 3 requests re-issued on the others carrying 22 tokens "
                              "already received; 2 up at step 4")
    assert found.fix and "FAIL" not in found.line()
    healthy = [row(s, 2, 0, 0, 0, "") for s in (1, 2)]
    assert {f.name: f for f in check_run({}, 1, healthy, [], [])}["engine servers lost"].status == OK
    assert "engine servers lost" not in {f.name for f in check_run({}, 1, [{"step": 1}], [], [])}


# ---------------------------------------------- teachers and judges, on synthetic run directories
def _run_dir(path: Path, config: dict, rows: list[dict], errors: list[dict] = ()) -> Path:
    """A run directory holding only what the doctor's teacher and judge checks read."""
    import yaml

    path.mkdir(parents=True)
    base = {"total_steps": max([r["step"] for r in rows] + [1]), "mode": "async", "max_staleness": 1}
    (path / "config.yaml").write_text(yaml.safe_dump({**base, **config}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if errors:
        (path / "errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in errors))
    for empty in ("samples.jsonl", "timeline.jsonl"):
        (path / empty).write_text("")
    return path


TEACHER = {"teacher": {"url": "http://127.0.0.1:8011", "check_tolerance": 0.5}}


def test_a_teacher_whose_scores_are_not_its_sampling_fails_naming_it_and_the_figure(tmp_path, capsys):
    def teacher_finding(name, config, rows):
        return _by_name(_run_dir(tmp_path / name, config, rows))["teacher's scores match its sampling"]

    healthy = teacher_finding("ok", TEACHER, [{"step": 0}, {"step": 1, "teacher/logprob_check_max_abs_diff": 9.5e-7,
                                                             "teacher/logprob_check_tokens": 32}, {"step": 2}])
    assert healthy.status == OK and "http://127.0.0.1:8011" in healthy.evidence and "9.5e-07" in healthy.evidence
    # a resumed run checks again: the second process's teacher scores one position off
    rows = [{"step": 1, "teacher/logprob_check_max_abs_diff": 1e-6, "teacher/logprob_check_tokens": 32}, {"step": 2},
            {"step": 3, "teacher/logprob_check_max_abs_diff": 19.1, "teacher/logprob_check_tokens": 32}]
    broken = teacher_finding("off", TEACHER, rows)
    assert (broken.status, broken.step) == (FAIL, 3)
    assert broken.evidence.startswith("the teacher at http://127.0.0.1:8011: its logprobs of 32 tokens it sampled ")
    assert "differ by up to 19.1 (teacher.check_tolerance 0.5); 1 of 2 checks" in broken.evidence
    assert "--generation-config vllm" in broken.fix and "--logprobs-mode processed_logprobs" in broken.fix
    tight = teacher_finding("tight", {"teacher": {**TEACHER["teacher"], "check_tolerance": 1e-7}}, rows[:1])
    assert tight.status == FAIL  # the run's own tolerance, from its config.yaml
    nan = teacher_finding("nan", TEACHER, [{"step": 1, "teacher/logprob_check_max_abs_diff": None}])
    assert nan.status == FAIL
    assert teacher_finding("none", {}, [{"step": 1}]).status == OK  # no teacher: nothing to check, said OK
    assert teacher_finding("old", TEACHER, [{"step": 1}]).status == SKIP  # a teacher, the figure not logged
    assert main(["doctor", str(tmp_path / "off")]) == 2
    out = capsys.readouterr().out
    assert "FAIL  teacher's scores match its sampling: the teacher at http://127.0.0.1:8011" in out
    assert "(first at step 3); fix: serve the teacher" in out


JUDGE = {"task": {"reward_fn": ["judge", "asyncrl.tasks.arithmetic:arithmetic_reward"]},
         "judge": {"url": "http://127.0.0.1:8012"}}
JUDGE_DOWN = ("FrozenModelError: the judge at http://127.0.0.1:8012: POST http://127.0.0.1:8012/v1/chat/completions "
              "failed after 3 tries and 1.5 s (ClientConnectorError: Cannot connect)")


def test_a_judge_that_fails_most_calls_fails_naming_it_the_counts_and_its_last_error(tmp_path, capsys):
    def judge_finding(name, config, rows, errors=()):
        return _by_name(_run_dir(tmp_path / name, config, rows, errors))["judge calls that failed"]

    def counted(step, calls, failures):
        return {"step": step, "rollout/judge_calls_total": calls, "rollout/judge_failures_total": failures}

    healthy = judge_finding("ok", JUDGE, [counted(1, 40, 2), counted(2, 80, 3)])
    assert healthy.status == OK and healthy.evidence == "the judge at http://127.0.0.1:8012 failed 3 of 80 calls (4%)"
    # over the run, from the last row's counters: 50 % is not most; 41 of 80 is
    assert judge_finding("half", JUDGE, [counted(1, 20, 18), counted(2, 80, 40)]).status == OK
    errors = [{"step": 1, "exception": JUDGE_DOWN}, {"step": 2, "exception": "ValueError: a reward's own"},
              {"step": 2, "exception": JUDGE_DOWN.replace("3 tries", "2 tries")}]
    broken = judge_finding("most", JUDGE, [counted(1, 20, 2), counted(2, 80, 41)], errors)
    assert (broken.status, broken.step) == (FAIL, 1)
    assert broken.evidence.startswith("the judge at http://127.0.0.1:8012 failed 41 of 80 calls (51%); the last "
                                      "error: FrozenModelError: the judge at http://127.0.0.1:8012: POST")
    assert "failed after 2 tries" in broken.evidence and "judge.timeout_s" in broken.fix
    # the judge down from the start: no step ever trained, its failures are in errors.jsonl alone
    down = judge_finding("down", JUDGE, [{"step": 0}], errors)
    assert down.status == FAIL and "failed 2 of 2 calls (100%)" in down.evidence
    # failures logged after the last row count on top of its counters
    late = judge_finding("late", JUDGE, [counted(1, 3, 1)], errors)
    assert "failed 2 of 4 calls (50%)" in late.evidence and late.status == OK
    assert judge_finding("none", {}, [{"step": 1}]).status == OK  # no judge in task.reward_fn
    alone = judge_finding("alone", {**JUDGE, "task": {"reward_fn": "judge"}}, [{"step": 1}])
    assert alone.status == SKIP  # a judge, but nothing counted (a run logged before the counters)
    assert main(["doctor", str(tmp_path / "down")]) == 2
    assert "FAIL  judge calls that failed: the judge at http://127.0.0.1:8012 failed 2 of 2" in capsys.readouterr().out


@pytest.mark.slow
def test_a_distilling_run_records_its_teachers_check_and_one_scored_off_by_one_fails(tmp_path, capsys):
    """Real runs with a teacher served by serve-engine's server: an honest one (OK) and one whose
    scores are placed one position off (said live before the first step; the doctor FAILs)."""
    from test_frozen_models import OffByOne, TeacherOnThread

    small = ["total_steps=2", "batch_size=2", "group_size=4", "save_every_minutes=0"]
    with TeacherOnThread() as honest:
        run = _train(tmp_path / "honest", f"teacher.url={honest.url}", *small)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["step"] == 1)
    assert first["teacher/logprob_check_max_abs_diff"] <= 1e-4 and first["teacher/logprob_check_tokens"] > 0
    assert not any("teacher/logprob_check_max_abs_diff" in r for r in rows if r["step"] > 1)  # once per process
    assert _by_name(run)["teacher's scores match its sampling"].status == OK
    capsys.readouterr()
    with TeacherOnThread(OffByOne.wrap) as shifted:
        run = _train(tmp_path / "shifted", f"teacher.url={shifted.url}", *small)
    assert f"asyncrl: FAIL teacher's scores match its sampling: the teacher at {shifted.url}" in capsys.readouterr().err
    assert main(["doctor", str(run)]) == 2
    assert f"FAIL  teacher's scores match its sampling: the teacher at {shifted.url}" in capsys.readouterr().out
