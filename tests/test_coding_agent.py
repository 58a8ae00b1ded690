"""examples/coding_agent: make_data is seeded with held-out functions of families never trained on,
every task's reference solution passes its tests in the sandbox and its slip does not, the
reward is 0 for an answer that reaches for the host or loops, and (slow) the Responses-API
agent trains through the gateway on SmolLM2 with the sandbox's seconds in the step rows."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("openai")

from real_model import smollm2_path

from asyncrl.tools.sandbox import recording_seconds

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples/coding_agent"


def _load(name: str):
    sys.path.insert(0, str(EXAMPLE))  # make_data imports the agent by its file name
    try:
        spec = importlib.util.spec_from_file_location(f"coding_{name}", EXAMPLE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # a dataclass looks its module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLE))


agent = _load("agent")
make_data = _load("make_data")
SHARES = {"tested": 0.3, "wrong": 0.2}


def _score(task: dict, answer: str) -> float:
    return asyncio.run(agent.score(SimpleNamespace(data=task), answer))


# ---- the data -----------------------------------------------------------------------------
def test_make_data_is_deterministic_by_seed():
    assert make_data.make_all(0, 20, SHARES) == make_data.make_all(0, 20, SHARES)
    assert make_data.make_all(0, 20, SHARES) != make_data.make_all(1, 20, SHARES)


def test_held_out_functions_are_in_no_training_task_or_trace():
    train, heldout, traces = make_data.make_all(0, 160, SHARES)
    held = {t["function"] for t in heldout}
    assert len(held) == len(heldout) and len(heldout) > 50
    assert not held & {t["function"] for t in train}
    asked = " ".join(trace["messages"][1]["content"] for trace in traces)
    assert not [name for name in held if f"`{name}(" in asked]
    assert {t["function"] for t in heldout} >= {"smallest", "mod_7", "whisper"}  # other families, not other k


def test_the_traces_hold_the_noise_they_say_in_the_agents_own_format():
    _, _, traces = make_data.make_all(0, 400, SHARES)
    tested = [t for t in traces if len(t["messages"]) == 5]
    assert 0.2 < len(tested) / len(traces) < 0.4
    for t in traces:
        assert t["messages"][0] == {"role": "system", "content": agent.SYSTEM} and t["tools"] == agent.TOOLS
    for t in tested:
        call = t["messages"][2]["tool_calls"][0]["function"]
        assert call["name"] == "run_python" and "print(" in json.loads(call["arguments"])["code"]
        assert t["messages"][3]["role"] == "tool"


def test_the_shipped_traces_are_conversations_asyncrl_sft_accepts():
    pytest.importorskip("asyncrl.sft")
    from asyncrl.sft.data import load_conversations

    assert len(load_conversations([str(EXAMPLE / "sft.jsonl")])) == 160


def test_bad_noise_shares_are_refused_naming_them():
    with pytest.raises(ValueError, match="noise shares"):
        make_data.make_all(0, 5, {"tested": 0.7, "wrong": 0.5})


def test_make_data_writes_the_files_the_configs_name(tmp_path):
    make_data.main(["--out-dir", str(tmp_path), "--traces", "8"])
    assert {p.name for p in tmp_path.iterdir()} == {"train.jsonl", "heldout.jsonl", "sft.jsonl"}
    for name in ("train.jsonl", "heldout.jsonl", "sft.jsonl"):  # the shipped files are what the seed writes
        assert (tmp_path / name).read_text().splitlines()[:8] == (EXAMPLE / name).read_text().splitlines()[:8]


def test_the_answers_code_is_the_last_fenced_block_or_the_lines_that_parse():
    assert agent.extract_code("def f(x):\n    return x") == "def f(x):\n    return x\n"
    assert agent.extract_code("def f(x):\n    return x\n```\n\nIn the above code, f returns x.") \
        == "def f(x):\n    return x\n"
    assert agent.extract_code("I cannot write that.") == ""
    assert agent.extract_code("Here:\n```python\ndef f(x):\n    return 1\n```\n"
                              "and\n```\ndef f(x):\n    return 2\n```") \
        == "def f(x):\n    return 2\n"


# ---- the reward, through the sandbox -------------------------------------------------------
@pytest.mark.sandbox
def test_a_reference_solution_scores_1_and_its_slip_0():
    train, heldout, _ = make_data.make_all(0, 0, SHARES)
    r = random.Random(0)
    for task in r.sample(train, 3) + r.sample(heldout, 3):
        assert _score(task, task["solution"]) == 1.0, task
        assert _score(task, f"```python\n{task['solution']}```") == 1.0, task
        family = next(f for f in make_data.TRAIN_FAMILIES + make_data.HELDOUT_FAMILIES
                      if f.fill(f.name, k := _k(f, task["function"])) == task["function"])
        assert _score(task, make_data.solution(family, k, family.wrong)) == 0.0, task


def _k(family, name: str) -> int | None:
    return int(name.rsplit("_", 1)[1]) if family.has_k and name.rsplit("_", 1)[-1].isdigit() else None


@pytest.mark.parametrize("answer", [
    "",
    "def double(x):\n    return open('/etc/shadow').read()\n",  # the host's file is not in the sandbox
    "def double(x):\n    while True:\n        pass\n",  # stopped at the wall deadline
    "import os\nos.system('echo hi > /tmp/escaped')\ndef double(x):\n    return 2 * x + 1\n",
    "def double(x)\n    return 2 * x\n",  # a syntax error
])
@pytest.mark.sandbox
def test_a_wrong_or_malicious_answer_scores_0(answer, monkeypatch):
    monkeypatch.setattr(agent, "TEST_TIMEOUT_S", 2.0)
    task = {"tests": "from solution import double\nassert double(3) == 6\nassert double(-2) == -4\n"}
    assert _score(task, answer) == 0.0
    assert _score(task, "def double(x):\n    return 2 * x\n") == 1.0  # the same tests pass a right answer


@pytest.mark.sandbox
def test_the_sandbox_seconds_of_an_episode_are_recorded():
    task = {"tests": "from solution import double\nassert double(3) == 6\n"}

    async def episode() -> list[float]:
        with recording_seconds() as seconds:
            await agent.score(SimpleNamespace(data=task), "def double(x):\n    return 2 * x\n")
            await agent.run_tool("run_python", json.dumps({"code": "print(1)"}))
        return seconds

    seconds = asyncio.run(episode())
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


class _Item(SimpleNamespace):
    def model_dump(self, exclude_none: bool = False) -> dict:
        return dict(vars(self))


class _ScriptedResponses:
    """``client.responses`` that replies from a script and keeps every request."""

    def __init__(self, replies: list[list[_Item]]) -> None:
        self.replies, self.requests = replies, []

    async def create(self, **request):
        self.requests.append(request)
        output = self.replies[len(self.requests) - 1]
        text = "".join(i.text for i in output if i.type == "message")
        return SimpleNamespace(id=f"resp_{len(self.requests)}", output=output, output_text=text)


@pytest.mark.sandbox
def test_the_agent_runs_a_call_in_the_sandbox_and_answers_on_previous_response_id():
    """The Responses loop, the model scripted: a ``function_call`` is run in the sandbox, its
    output goes back as a ``function_call_output`` on ``previous_response_id`` with the
    instructions again, and the reply without a call is the answer."""
    program = "def double(x):\n    return 2 * x\nprint(double(21))\n"
    responses = _ScriptedResponses([
        [_Item(type="function_call", call_id="call_0", name="run_python", arguments=json.dumps({"code": program}))],
        [_Item(type="message", text="def double(x):\n    return 2 * x")],
    ])
    answer, items = asyncio.run(agent.converse(SimpleNamespace(responses=responses), "Write double(x).",
                                               agent.RESPONSES_TOOLS))
    assert answer == "def double(x):\n    return 2 * x"
    first, second = responses.requests
    assert first["input"] == "Write double(x)." and first["tools"] == agent.RESPONSES_TOOLS
    assert second["previous_response_id"] == "resp_1" and second["instructions"] == agent.SYSTEM
    assert second["input"] == [{"type": "function_call_output", "call_id": "call_0", "output": "42"}]
    assert [i["type"] for i in items[1:]] == ["function_call", "function_call_output", "message"]


@pytest.mark.sandbox
def test_the_agent_stops_after_max_turns_of_calls_with_no_answer():
    call = _Item(type="function_call", call_id="c", name="run_python", arguments=json.dumps({"code": "print(1)"}))
    responses = _ScriptedResponses([[call]] * agent.MAX_TURNS)
    answer, _ = asyncio.run(agent.converse(SimpleNamespace(responses=responses), "Write f.", agent.RESPONSES_TOOLS))
    assert answer == "" and len(responses.requests) == agent.MAX_TURNS


def test_the_step_rows_sandbox_seconds_are_a_mean_over_the_episodes_that_ran_any():
    from asyncrl.orchestrator.metrics import sandbox_metrics
    from asyncrl.types import Episode

    ran = [Episode("a", timings={"sandbox_s": 1.0}), Episode("b", timings={"sandbox_s": 0.5, "total_s": 9.0})]
    assert sandbox_metrics([*ran, Episode("c", timings={"total_s": 2.0})]) == {"sandbox/seconds_mean": 0.75}
    assert sandbox_metrics([Episode("c")]) == {}


def test_a_tool_call_the_agent_cannot_run_is_an_output_for_the_model():
    assert asyncio.run(agent.run_tool("shell", "{}")) == "unknown tool: shell"
    assert "needs" in asyncio.run(agent.run_tool("run_python", "not json"))
    assert "needs" in asyncio.run(agent.run_tool("run_python", json.dumps({"program": "1"})))


# ---- end to end -------------------------------------------------------------------------------
def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.sandbox
@pytest.mark.slow
def test_the_agent_trains_through_the_responses_api_with_the_sandbox_seconds_in_the_rows(tmp_path):
    """Two steps of ``async.yaml`` on SmolLM2 (base: no SFT, tiny sizes): the agent's Responses
    calls run through the gateway, every episode's reward is its tests in the sandbox, and the
    step rows carry ``sandbox/seconds_mean``. A smoke run: it proves the plumbing, not learning."""
    smollm2_dir = smollm2_path()  # skips, naming why, where SmolLM2 cannot be fetched
    from asyncrl.cli import main

    train, heldout, _ = make_data.make_all(0, 0, SHARES)
    out = tmp_path / "rl"
    assert main(["train", "examples/coding_agent/async.yaml", f"model.path={smollm2_dir}", f"output_dir={out}",
                 f"task.path={_write_jsonl(tmp_path / 'train.jsonl', train[:4])}",
                 f"task.validation_path={_write_jsonl(tmp_path / 'heldout.jsonl', heldout[:2])}",
                 "total_steps=2", "batch_size=2", "group_size=2", "eval_every=2", "eval.num_tasks=2",
                 "algorithm.filter_zero_variance=false", "optim.micro_batch_size=4", "workflow.timeout_s=300"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if m["step"] > 0 and "rollout/episodes" in m]
    assert len(trained) == 2, metrics
    assert all(m["sandbox/seconds_mean"] > 0 for m in trained), trained
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reward"] in (0.0, 1.0) for s in samples)


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_tool_call_runs_in_the_sandbox_through_the_gateway_with_its_output_masked(tmp_path, policy_dir):
    """A random tiny policy cannot write code, so every task asks for the same function:
    ``asyncrl sft`` on the example's own ``tested`` trace of it makes the policy call
    ``run_python``, then ``async.yaml`` runs the Responses agent through the gateway: the
    call's output comes back from the sandbox as an environment segment (mask 0)."""
    pytest.importorskip("asyncrl.sft")
    from asyncrl.cli import main

    family = next(f for f in make_data.TRAIN_FAMILIES if f.name == "double")
    task = make_data.task(family, None, random.Random(0), "t")
    train = _write_jsonl(tmp_path / "train.jsonl", [{**task, "id": f"t{i}"} for i in range(8)])
    heldout = _write_jsonl(tmp_path / "heldout.jsonl", [{**task, "id": f"h{i}"} for i in range(2)])
    traces = _write_jsonl(tmp_path / "sft.jsonl", [make_data.trace(task, family, None, "tested", random.Random(0))] * 4)
    sft_dir = tmp_path / "sft"
    assert main(["sft", "examples/coding_agent/sft.yaml", f"model.path={policy_dir}", f"output_dir={sft_dir}",
                 f"data.train={traces}", "epochs=64", "batch_size=4", "optim.micro_batch_size=4", "optim.lr=0.003",
                 "optim.warmup_steps=0", "optim.schedule=constant"]) == 0
    out = tmp_path / "rl"
    assert main(["train", "examples/coding_agent/async.yaml", f"model.path={sft_dir}", f"output_dir={out}",
                 f"task.path={train}", f"task.validation_path={heldout}", "total_steps=2", "batch_size=2",
                 "group_size=2", "eval_every=2", "eval.num_tasks=2", "sampling.temperature=0.3",
                 "sampling.max_tokens=256",  # one token a character: the call is ~150
                 "eval.temperature=0.3", "algorithm.filter_zero_variance=false", "workflow.timeout_s=120"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    with_call = [s for s in samples if [seg["role"] for seg in s["response_segments"]][:2] == ["model", "environment"]]
    assert len(with_call) >= len(samples) // 2, [s["response"] for s in samples]
    checked = 0
    for s in with_call:  # the call is the model's (trained); the sandbox's output is the environment's (masked)
        call, output = (seg["text"] for seg in s["response_segments"][:2])
        assert '"name": "run_python"' in call
        printed = re.search(r"print\(double\((-?\d+)\)\)", call)
        if printed and "return 2 * x" in call:  # the program as traced: its output is what the sandbox printed
            assert str(2 * int(printed.group(1))) in output and str(2 * int(printed.group(1))) not in call
            checked += 1
    assert checked, [s["response"] for s in with_call]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if m["step"] > 0 and "rollout/episodes" in m]
    assert all(m["agent/tool_calls_mean"] > 0 and m["sandbox/seconds_mean"] > 0 for m in trained), trained
