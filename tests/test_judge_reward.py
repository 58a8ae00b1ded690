"""`task.reward_fn: judge`: the `judge:` section's model grades each response, wherever a reward
function goes; a judge that is not configured, or a rubric naming a field the tasks lack, is
refused before any work; a run graded by a judge trains, and its rows say what grading cost."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config
from asyncrl.frozen.judge import JudgeReward
from asyncrl.report import load_run
from asyncrl.report.doctor import findings
from asyncrl.tasks.from_config import build_reward_fn, build_tasks
from asyncrl.tasks.reward_sum import RewardSum

REPO = Path(__file__).resolve().parents[1]
ADDITION = str(REPO / "examples/addition/async.yaml")


class StubJudge:
    """An OpenAI-compatible judge on a free port, in a thread of its own (the run under test
    owns the main thread's loop): it grades 10 when the answer in the rubric equals the
    response's first number, else 0, and answers 503 to every third call (retried)."""

    def __init__(self) -> None:
        self.calls = 0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    async def _grade(self, request: web.Request) -> web.Response:
        self.calls += 1
        if self.calls % 3 == 0:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        text = (await request.json())["messages"][0]["content"]
        expected, response = text.split("EXPECTED:")[1].split("RESPONSE:")
        digits = "".join(c for c in response.strip().split(" ")[0] if c.isdigit())
        grade = 10 if digits == expected.strip() else 0
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant",
                                                                       "content": f"GRADE: {grade}"}}]})

    def _serve(self) -> None:
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._grade)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self) -> StubJudge:
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


RUBRIC = "judge.prompt=EXPECTED:{answer} RESPONSE:{response}"


def test_the_judge_by_name_alone_and_in_a_list():
    cfg = load_config(ADDITION, ["task.reward_fn=judge", "judge.url=http://127.0.0.1:9", "judge.model=m"])
    assert isinstance(build_reward_fn(cfg), JudgeReward)
    cfg = load_config(ADDITION, ["task.reward_fn=[judge, asyncrl.tasks.arithmetic:arithmetic_reward]",
                                 "task.reward_weights=[0.5, 0.5]", "judge.url=http://127.0.0.1:9"])
    both = build_reward_fn(cfg)
    assert isinstance(both, RewardSum) and isinstance(both.members[0], JudgeReward)


def test_a_judge_without_a_server_or_with_a_rubric_the_tasks_cannot_fill_is_refused():
    with pytest.raises(ConfigError, match=r"task.reward_fn names the judge, but neither judge.url"):
        build_reward_fn(load_config(ADDITION, ["task.reward_fn=judge"]))
    cfg = load_config(ADDITION, ["task.reward_fn=judge", "judge.url=http://127.0.0.1:9",
                                 "judge.prompt=grade {response} against {rubric}"])
    with pytest.raises(ConfigError, match=r"task.reward_fn 'judge':.*\['rubric'\].*lacks"):
        build_tasks(cfg)
    with pytest.raises(ConfigError, match="judge.url and judge.reward_model are both set"):
        load_config(ADDITION, ["judge.url=http://x:1", "judge.reward_model=/tmp"])


@pytest.mark.slow
def test_a_judge_graded_run_trains_and_its_rows_say_what_grading_cost(tmp_path):
    out = tmp_path / "run"
    with StubJudge() as judge:
        assert main(["train", ADDITION, f"output_dir={out}", "total_steps=4", "batch_size=2", "group_size=4",
                     "eval_every=0", "eval.num_tasks=4", "eval.samples_per_task=2", "save_every_minutes=0",
                     "algorithm.filter_zero_variance=false", "task.reward_fn=judge", f"judge.url={judge.url}",
                     "judge.model=stub", "judge.retries=3", "judge.max_concurrency=2", RUBRIC]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["reward/seconds_mean"] > 0 for r in steps)
    assert sum(r.get("judge/failures", 0) for r in steps) == 0  # a 503 is retried inside the call, not a failure
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["reward"] for s in samples} <= {0.0, 1.0}
    assert judge.calls >= len(samples)
    # every call over the run (evaluations' too) counted, for asyncrl doctor
    assert steps[-1]["rollout/judge_failures_total"] == 0 and steps[-1]["rollout/judge_calls_total"] >= len(samples)
    said = {f.name: f for f in findings(load_run(out))}["judge calls that failed"]
    assert said.status == "OK" and said.evidence.startswith(f"the judge at {judge.url} failed 0 of ")


def test_a_judges_calls_and_failures_are_counted_from_each_episodes_attempts():
    from asyncrl.frozen.judge import uses_judge
    from asyncrl.orchestrator.metrics import judge_calls
    from asyncrl.types import AttemptError, Episode

    down = AttemptError(1, "FrozenModelError: the judge at http://j:1: POST http://j:1/v1/chat/completions failed", "")
    ungraded = AttemptError(2, "JudgeParseError: the judge at http://j:1 for task t: no grade matching", "")
    other = AttemptError(1, "ValueError: the workflow's own", "")
    assert judge_calls(Episode("t")) == (1, 0)  # graded once, by a call that answered
    assert judge_calls(Episode("t", errors=[down, ungraded])) == (3, 2)  # two failed calls, then the one that answered
    assert judge_calls(Episode("t", status="error", errors=[down, ungraded])) == (2, 2)
    assert judge_calls(Episode("t", status="error", errors=[other])) == (0, 0)  # the judge was never asked
    assert uses_judge("judge") and uses_judge(["x:y", "judge"])
    assert not uses_judge("asyncrl.tasks.arithmetic:arithmetic_reward") and not uses_judge(None)


def test_agreement_figures_by_hand():
    import math

    from asyncrl.frozen.agreement import Agreement

    # 20 both pass, 5 the judge alone, 10 the checker alone, 15 both fail (n = 50):
    # p_o = 35/50 = 0.7; p_judge = 25/50, p_checker = 30/50, p_e = 0.5·0.6 + 0.5·0.4 = 0.5; κ = 0.2/0.5
    pairs = [(True, True)] * 20 + [(True, False)] * 5 + [(False, True)] * 10 + [(False, False)] * 15
    table = Agreement.from_pairs(pairs)
    assert (table.both_pass, table.judge_only, table.checker_only, table.both_fail, table.n) == (20, 5, 10, 15, 50)
    assert (table.accuracy, table.chance, table.kappa) == pytest.approx((0.7, 0.5, 0.4))
    assert Agreement(7, 0, 0, 3).kappa == pytest.approx(1.0)  # perfect
    assert Agreement(25, 25, 25, 25).kappa == pytest.approx(0.0)  # chance's
    assert Agreement(0, 10, 10, 0).kappa == pytest.approx(-1.0)  # always the other verdict
    # a judge that passes everything: agrees on the checker's 3 of 4 passes, and not beyond chance
    # p_o = 3/4; p_e = 1·3/4 + 0·1/4 = 3/4; κ = 0
    assert (Agreement(3, 1, 0, 0).accuracy, Agreement(3, 1, 0, 0).kappa) == pytest.approx((0.75, 0.0))
    assert math.isnan(Agreement(4, 0, 0, 0).kappa)  # both say pass to all: p_e = 1, nothing to measure
    assert math.isnan(Agreement(0, 0, 0, 0).accuracy)
    assert "Cohen's kappa: 0.400" in table.lines()[-1]


def test_the_agreement_script_on_the_tiny_policy_with_a_judge_that_checks_exactly(tmp_path, capsys):
    """examples/judge/agreement.py end to end: the shipped addition policy answers, a stub judge
    that compares the answer to the expected sum grades (with a 503 every third call, retried),
    and the task's checker scores; the figures are what the verdicts make."""
    import importlib.util

    from asyncrl.tasks.arithmetic import arithmetic_reward

    spec = importlib.util.spec_from_file_location("agreement", REPO / "examples/judge/agreement.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = str(REPO / "examples/judge/addition.yaml")
    small = [f"output_dir={tmp_path}", "eval.num_tasks=8", "eval.samples_per_task=4", "judge.retries=3",
             "model.path=" + str(REPO / "models/addition-tiny")]
    assert script.main([config, *small, "judge.url="]) == 2  # no judge: a usage error
    with StubJudge() as judge:
        assert script.main([config, *small, f"judge.url={judge.url}", "judge.model=stub", RUBRIC]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "agreement" / "agreement.json").read_text())
    verdicts = result["verdicts"]
    assert result["responses"] == 32 and result["judge_failures"] == 0 and len(verdicts) == result["graded"] == 32
    rows = (tmp_path / "agreement" / "eval_samples.jsonl").read_text().splitlines()
    checked = {(s["task_id"], s["sample"]): s["reward"] for s in map(json.loads, rows)}
    tasks = {t.id: t for t in build_tasks(load_config(config, small)).validation}
    agree = 0
    for v in verdicts:
        assert v["checker"] == checked[(v["task_id"], v["sample"])]  # the task's own checker's score
        assert v["checker"] == arithmetic_reward(tasks[v["task_id"]], v["response"])
        digits = "".join(c for c in v["response"].strip().split(" ")[0] if c.isdigit())
        assert v["judge"] == (1.0 if digits == str(tasks[v["task_id"]].data["answer"]) else 0.0)  # the stub's rule
        agree += (v["judge"] >= 0.5) == (v["checker"] >= 0.5)
    assert result["accuracy"] == pytest.approx(agree / 32)
    assert result["both_pass"] + result["judge_only"] + result["checker_only"] + result["both_fail"] == 32
    assert 0 < result["both_pass"] + result["checker_only"] < 32  # the policy is right on some answers, not all
    assert f"agreement (accuracy): {result['accuracy']:.3f}" in out and "Cohen's kappa" in out
    # the judge gone: every call fails, counted and named, and nothing is graded (exit 1)
    assert script.main([config, *small, f"judge.url={judge.url}", "judge.model=stub", "judge.retries=0", RUBRIC]) == 1
    assert f"the judge at {judge.url}: 0 graded, 32 calls failed (0 of them replies with no grade) (the last: the " \
        f"judge at {judge.url}: POST" in capsys.readouterr().out


def test_the_judge_example_grades_with_its_rubric_filled_from_every_task():
    from asyncrl.frozen.judge import render_prompt

    cfg = load_config(str(REPO / "examples/judge/addition.yaml"))
    reward = build_reward_fn(cfg)
    assert isinstance(reward, JudgeReward) and reward.model.url == "http://127.0.0.1:8001"
    splits = build_tasks(cfg)  # refuses a rubric naming a field some task lacks
    task = splits.validation[0]
    assert render_prompt(cfg.judge.prompt, task, "12").splitlines() == [
        f"Question: {task.prompt}?", f"Correct answer: {task.data['answer']}", "Student's answer: 12",
        "Is the student's answer exactly the correct answer? Reply with GRADE: 10 if it is, GRADE: 0 if it is not."]
    served = load_config(str(REPO / "examples/judge/judge_server.yaml"))
    assert served.gateway.port == 8001 and served.model.path == "smollm2-135m-instruct"
