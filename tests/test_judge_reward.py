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
