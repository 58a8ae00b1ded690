"""examples/calculator_agent: the calculator never evaluates more than arithmetic, the reward
reads the final answer, make_data is deterministic with the noise it says, and the agent
runs through the gateway over two model calls with the tool's tokens masked."""

from __future__ import annotations

import importlib.util
import json
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples/calculator_agent"


def _load(name: str):
    sys.path.insert(0, str(EXAMPLE))  # make_data imports the agent by its file name
    try:
        spec = importlib.util.spec_from_file_location(f"calculator_{name}", EXAMPLE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLE))


agent = _load("agent")
make_data = _load("make_data")


# ---- the calculator ---------------------------------------------------------------------
@pytest.mark.parametrize("expression, value", [
    ("347 * 89 - 1206", "29677"), ("(421 + 570) * 29", "28739"), ("-3 + +5", "2"), ("7 / 2", "3.5"),
    ("1 / 3", "0.333333"), ("2.5 * 4", "10"), ("  12*34 ", "408"), ("((1))", "1"),
])
def test_the_calculator_computes_arithmetic_exactly(expression, value):
    assert agent.calculate(expression) == value


def test_the_calculator_is_exact_where_floats_are_not():
    assert agent.evaluate("0.1 + 0.2") == Fraction(3, 10)
    assert agent.calculate("123456789 * 987654321") == str(123456789 * 987654321)


@pytest.mark.parametrize("expression, named", [
    ("__import__('os').system('true')", "Call"), ("x + 1", "Name"), ("(1).real", "Attribute"),
    ("abs(-1)", "Call"), ("2 ** 10", "BinOp"), ("7 // 2", "BinOp"), ("7 % 2", "BinOp"), ("[1][0]", "Subscript"),
    ("'a' * 3", "Constant"), ("True + 1", "Constant"), ("1j", "Constant"), ("lambda: 1", "Lambda"),
    ("1 if 1 else 2", "IfExp"), ("1 < 2", "Compare"), ("~1", "UnaryOp"), ("not 1", "UnaryOp"),
])
def test_the_calculator_rejects_everything_but_numbers_and_four_operators(expression, named):
    with pytest.raises(agent.CalculatorError, match=f"only numbers and \\+ - \\* / \\( \\) are allowed, not {named}"):
        agent.evaluate(expression)
    assert agent.calculate(expression).startswith("error: ")


@pytest.mark.parametrize("expression, says", [
    ("1 +", "not an arithmetic expression"), ("1; 2", "not an arithmetic expression"),
    ("1 / (2 - 2)", "division by zero"), ("1 + " * 60 + "1", "expression longer than 200 characters"),
    ("1e999 - 1e999", "number out of range"),
    ("x = 1", "not an arithmetic expression"), ("1\x00", "not an arithmetic expression"),
])
def test_the_calculator_says_what_is_wrong(expression, says):
    assert agent.calculate(expression).startswith(f"error: {says}")


def test_a_tool_call_the_agent_cannot_run_is_a_result_for_the_model():
    assert agent.run_tool("calculate", json.dumps({"expression": "6 * 7"})) == "42"
    assert agent.run_tool("search", "{}") == "unknown tool: search"
    for arguments in ("not json", "[1]", "{}", '{"expression": 42}'):
        assert agent.run_tool("calculate", arguments).startswith("error: calculate needs")


# ---- the reward -------------------------------------------------------------------------
@pytest.mark.parametrize("answer, reward", [
    ("29677", 1.0), ("The answer is 29,677.", 1.0), ("347 * 89 - 1206 = 29677", 1.0), (" 29677\n", 1.0),
    ("29676", 0.0), ("29677 or 29678", 0.0), ("", 0.0), ("I cannot compute that.", 0.0), ("-29677", 0.0),
])
def test_the_reward_is_the_last_number_of_the_final_answer(answer, reward):
    task = SimpleNamespace(data={"answer": 29677})
    assert agent.score(task, answer) == reward


# ---- make_data ----------------------------------------------------------------------------
SHARES = {"skip": 0.15, "slip": 0.15, "miscopy": 0.2}


def test_make_data_is_deterministic_by_seed():
    first = make_data.make_all(0, 50, 20, 30, SHARES)
    assert make_data.make_all(0, 50, 20, 30, SHARES) == first
    assert make_data.make_all(1, 50, 20, 30, SHARES) != first
    # growing one split leaves the others as they were
    assert make_data.make_all(0, 50, 20, 60, SHARES)[:2] == first[:2]


def test_held_out_tasks_are_new_and_every_answer_is_the_calculators():
    train, heldout, trace_tasks, _ = make_data.make_all(0, 2000, 128, 600, SHARES)
    held = {t["expression"] for t in heldout}
    assert not held & {t["expression"] for t in train} and not held & {t["expression"] for t in trace_tasks}
    for task in train + heldout:
        assert task["answer"] == int(agent.calculate(task["expression"])) > 0
        assert task["expression"] in task["prompt"]
    assert len({t["id"] for t in train + heldout}) == len(train) + len(heldout)


def test_the_traces_hold_the_noise_they_say_in_the_agents_own_format():
    n = 4000
    _, _, trace_tasks, traces = make_data.make_all(0, 10, 10, n, SHARES)
    kinds = [make_data.kind_of(t, task) for t, task in zip(traces, trace_tasks)]
    expected = {"clean": 1 - sum(SHARES.values()), **SHARES}
    for kind, share in expected.items():  # 4 standard errors of a binomial share
        assert abs(kinds.count(kind) / n - share) < 4 * (share * (1 - share) / n) ** 0.5, kind
    for example, task, kind in zip(traces, trace_tasks, kinds):
        messages = example["messages"]
        assert example["tools"] == agent.TOOLS
        assert messages[0] == {"role": "system", "content": agent.SYSTEM}
        assert messages[1] == {"role": "user", "content": task["prompt"]}
        final = messages[-1]["content"]
        if kind == "skip":  # one turn, a wrong guess
            assert len(messages) == 3 and final != str(task["answer"]) and final.isdigit()
            continue
        call = messages[2]["tool_calls"][0]
        assert messages[2]["content"] is None and call["function"]["name"] == "calculate"
        expression = json.loads(call["function"]["arguments"])["expression"]
        result = messages[3]
        assert result == {"role": "tool", "tool_call_id": call["id"], "content": agent.calculate(expression)}
        assert (final == result["content"]) == (kind in ("clean", "slip"))
        assert (agent.score(SimpleNamespace(data=task), final) == 1.0) == (kind == "clean")


def test_make_data_writes_the_files_the_configs_name(tmp_path):
    make_data.main(["--out-dir", str(tmp_path), "--train", "30", "--heldout", "8", "--traces", "12"])
    from asyncrl.tasks import load_tasks

    splits = load_tasks("jsonl", path=tmp_path / "train.jsonl", validation_path=tmp_path / "heldout.jsonl", seed=0,
                        num_train=0, num_validation=8)
    assert len(splits.train) == 30 and len(splits.validation) == 8
    assert splits.validation[0].data["answer"] == int(agent.calculate(splits.validation[0].data["expression"]))
    lines = (tmp_path / "sft.jsonl").read_text().splitlines()
    assert len(lines) == 12 and set(json.loads(lines[0])) == {"messages", "tools"}


def test_bad_noise_shares_are_refused_naming_them():
    with pytest.raises(ValueError, match="noise shares"):
        make_data.make_all(0, 5, 5, 5, {"skip": 0.5, "slip": 0.5, "miscopy": 0.5})


# ---- the pipeline in miniature: make_data's trace -> asyncrl sft -> asyncrl train -----
def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
def test_the_agent_trains_through_the_gateway_over_two_calls_with_the_tools_tokens_masked(tmp_path, policy_dir):
    """A random tiny policy cannot copy an expression, so every task asks the same one:
    ``asyncrl sft`` on the example's own clean trace of it makes the policy call the tool,
    then ``asyncrl train`` with the example's config runs the agent through the gateway."""
    pytest.importorskip("asyncrl.sft")
    import random

    from asyncrl.cli import main

    task = {"prompt": "What is 12 * 34?", "expression": "12 * 34", "answer": 408}
    train = _write_jsonl(tmp_path / "train.jsonl", [{"id": f"t{i}", **task} for i in range(8)])
    heldout = _write_jsonl(tmp_path / "heldout.jsonl", [{"id": f"h{i}", **task} for i in range(2)])
    trace = make_data.trace(task, "clean", random.Random(0))
    traces = _write_jsonl(tmp_path / "sft.jsonl", [trace] * 4)
    sft_dir = tmp_path / "sft"
    assert main(["sft", "examples/calculator_agent/sft.yaml", f"model.path={policy_dir}", f"output_dir={sft_dir}",
                 f"data.train={traces}", "epochs=64", "batch_size=4", "optim.micro_batch_size=4", "optim.lr=0.003",
                 "optim.warmup_steps=0", "optim.schedule=constant"]) == 0

    out = tmp_path / "rl"
    assert main(["train", "examples/calculator_agent/async.yaml", f"model.path={sft_dir}", f"output_dir={out}",
                 f"task.path={train}", f"task.validation_path={heldout}", "total_steps=2", "batch_size=2",
                 "group_size=2", "eval_every=2", "eval.num_tasks=2", "sampling.temperature=0.3",
                 "sampling.max_tokens=128",  # one token a character: the call is ~80
                 "eval.temperature=0.3", "algorithm.filter_zero_variance=false", "workflow.timeout_s=60"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 2  # steps x groups x episodes, one trajectory each
    two_calls = [s for s in samples if [seg["role"] for seg in s["response_segments"]] == ["model", "environment",
                                                                                          "model"]]
    assert len(two_calls) >= len(samples) // 2, [s["response"] for s in samples]
    for s in two_calls:  # the call is the model's (trained), the tool's result is not (mask 0)
        call, result, answer = (seg["text"] for seg in s["response_segments"])
        assert '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 34"}}</tool_call>' in call
        assert "408" in result and "408" not in call
        assert s["reward"] == agent.score(SimpleNamespace(data=task), answer)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if m["step"] > 0]
    assert all(m["agent/tool_calls_mean"] > 0 and m["agent/multi_turn_fraction"] > 0 for m in trained)
