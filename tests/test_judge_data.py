"""examples/judge/make_judge_data.py: the conversations that train a small judge are the judge
client's own calls, graded as the task's checker grades, on no prompt agreement.py grades."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

from asyncrl.config import load_config
from asyncrl.frozen.judge import JudgeReward
from asyncrl.sft.data import load_conversations
from asyncrl.tasks import is_validation_prompt
from asyncrl.tasks.arithmetic import arithmetic_reward
from asyncrl.tasks.from_config import build_tasks

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples/judge"
CONFIG = str(EXAMPLE / "addition.yaml")


def _script():
    spec = importlib.util.spec_from_file_location("make_judge_data", EXAMPLE / "make_judge_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordingJudge:
    """Stands in for the judge's FrozenModel: keeps the messages the client sends and answers
    with the reply the conversation under test trains the judge to give."""

    url = "http://judge.invalid"

    def __init__(self) -> None:
        self.stats = SimpleNamespace(failures=0)
        self.sent: list[list[dict]] = []
        self.reply = ""

    async def chat(self, messages, **params):
        self.sent.append(messages)
        return self.reply


def test_each_conversation_is_the_judge_clients_call_answered_with_the_checkers_grade():
    script = _script()
    cfg = load_config(CONFIG)
    sft, heldout = script.generate(cfg, seed=3, train=64, heldout=16)
    model = RecordingJudge()
    judge = JudgeReward(model, prompt=cfg.judge.prompt, pattern=cfg.judge.grade_pattern, scale=cfg.judge.scale)
    for task, response, conv in sft + heldout:
        *asked, reply = conv["messages"]
        model.reply = reply["content"]
        grade = asyncio.run(judge(task, response))
        assert model.sent[-1] == asked  # exactly what the client sends for this task and response
        assert reply["role"] == "assistant" and grade == arithmetic_reward(task, response)  # the checker's label
    assert model.stats.failures == 0 and len(model.sent) == 80


def test_the_data_mixes_right_and_wrong_answers_near_misses_and_junk():
    script = _script()
    sft, _ = script.generate(load_config(CONFIG), seed=0, train=160, heldout=8)
    passed = [arithmetic_reward(t, r) == 1.0 for t, r, _ in sft]
    assert sum(passed) == 80
    wrong = [(int(t.data["answer"]), r) for (t, r, _), ok in zip(sft, passed) if not ok]
    off_by_one = [r for a, r in wrong if r.strip().isdigit() and abs(int(r) - a) == 1]
    swapped = [r for a, r in wrong if len(str(a)) == 2 and r == str(a)[::-1]]
    trailing = [r for a, r in wrong if r.startswith(str(a)) and r.strip() != str(a)]
    junk = [r for _, r in wrong if not r.strip().isdigit()]
    assert off_by_one and swapped and trailing and junk, (off_by_one, swapped, trailing, junk)
    assert any(r != r.strip() for (_, r, _), ok in zip(sft, passed) if ok)  # a right answer the checker strips


def test_no_prompt_agreement_grades_is_in_the_files_and_they_are_what_the_script_writes(tmp_path):
    script = _script()
    assert script.main(["--out-dir", str(tmp_path / "a")]) == 0
    assert script.main(["--out-dir", str(tmp_path / "b")]) == 0
    for name in ("judge_sft.jsonl", "judge_heldout.jsonl"):
        written = (tmp_path / "a" / name).read_text()
        assert written == (tmp_path / "b" / name).read_text()  # seeded: the same bytes twice
        assert written == (EXAMPLE / name).read_text(), f"{name} is stale: rerun make_judge_data.py"
    cfg = load_config(CONFIG)
    graded = {t.prompt for t in build_tasks(cfg).validation}  # the tasks agreement.py has the policy answer
    assert len(graded) == cfg.eval.num_tasks
    files = {name: [conv["messages"][0]["content"].splitlines()[0] for conv in
                    map(json.loads, (EXAMPLE / name).read_text().splitlines())]
             for name in ("judge_sft.jsonl", "judge_heldout.jsonl")}
    for questions in files.values():
        assert all(q.startswith("Question: ") for q in questions)
        prompts = {q.removeprefix("Question: ").removesuffix("?") for q in questions}
        assert not prompts & graded and not any(map(is_validation_prompt, prompts))
    assert not set(files["judge_sft.jsonl"]) & set(files["judge_heldout.jsonl"])  # held-out loss on unseen prompts
    # asyncrl sft reads the file as the same messages (the gateway's form of them)
    loaded = load_conversations([str(EXAMPLE / "judge_sft.jsonl")])
    rows = [json.loads(line) for line in (EXAMPLE / "judge_sft.jsonl").read_text().splitlines()]
    assert [c.messages for c in loaded] == [r["messages"] for r in rows] and len(rows) == 160


def test_the_sft_config_trains_on_the_files_and_the_server_serves_its_output():
    from asyncrl.sft.config import load_sft_config

    sft = load_sft_config(EXAMPLE / "judge_sft.yaml")
    assert sft.data.train == ["examples/judge/judge_sft.jsonl"]
    assert sft.data.eval == ["examples/judge/judge_heldout.jsonl"]
    assert sft.output_dir == "runs/judge-sft" and sft.model.path == "smollm2-135m-instruct"
    served = load_config(str(EXAMPLE / "judge_server.yaml"), [f"model.path={sft.output_dir}"])
    assert served.model.path == "runs/judge-sft" and served.gateway.port == 8001
