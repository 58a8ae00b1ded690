"""Evaluations recorded as they go: ``eval_samples.jsonl`` of ``asyncrl eval`` and of a
training run's evaluations (one row per scored episode, written as it finishes, with the
step evaluated), parsed tool calls beside the text in the rows, and the template /
tool-call format line ``asyncrl eval`` and ``asyncrl sft`` print as ``train`` does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.orchestrator.announce import template_notes
from asyncrl.orchestrator.buffer import ReadyGroup
from asyncrl.orchestrator.metrics import eval_sample_row, sample_rows, tool_calls_in
from asyncrl.rollout.eval_scoring import EVAL_SAMPLE
from asyncrl.rollout.gateway.tool_calls import get_format, resolve_format
from asyncrl.types import AgentDiagnostics, Episode, Group, Step, Trajectory

ROOT = Path(__file__).resolve().parent.parent
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ADD = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def agent_episode() -> Episode:
    """An agent's episode as the gateway records it: one trajectory, the model's call (its
    text, as sampled), the tool's answer (mask 0), the model's final answer."""
    pieces = [(CALL, 1), ("\ntool: 5\n", 0), ("5", 1)]
    ids = [ord(c) for text, _ in pieces for c in text]
    mask = [m for text, m in pieces for _ in text]
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    t = Trajectory(prompt_ids=[1], response_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids),
                   versions=[0] * len(ids), reward=1.0,
                   steps=[Step(messages[:1], 1, len(CALL), "stop"), Step(messages, 20, 1, "stop")])
    return Episode("t0", [t], reward=1.0, metadata={"agent": AgentDiagnostics(2, 1, 0, 0.1, 2, False).to_dict()})


def test_samples_carry_the_tool_calls_read_beside_the_text():
    hermes = get_format("hermes")
    row, = sample_rows(3, 2, [ReadyGroup(Group("t0", [agent_episode()], [0.0]), 0)], decode, hermes)
    assert row["tool_calls"] == [ADD]  # the model's segments, read as the gateway reads them
    assert CALL in row["response"]  # the text they were written in stays
    call_message = row["conversation"][1]
    assert call_message["content"] == CALL and call_message["tool_calls"] == [ADD]
    assert "tool_calls" not in row["conversation"][-1]  # the final answer "5" calls nothing
    plain, = sample_rows(3, 2, [ReadyGroup(Group("t0", [agent_episode()], [0.0]), 0)], decode)
    assert "tool_calls" not in plain and "tool_calls" not in plain["conversation"][1]  # no gateway: not read
    assert tool_calls_in("no call here", hermes) == []


def test_an_eval_row_names_the_step_the_version_the_sample_and_the_calls():
    episode = agent_episode()
    episode.metadata[EVAL_SAMPLE] = 1
    row = eval_sample_row(episode, 4, decode, get_format("hermes"), step=4)
    assert (row["step"], row["version"], row["task_id"], row["sample"], row["reward"]) == (4, 4, "t0", 1, 1.0)
    assert row["tool_calls"] == [ADD] and row["conversation"][1]["tool_calls"] == [ADD]
    assert row["response"] == decode(episode.trajectories[0].response_ids)
    assert row["trajectories"][0]["response_ids"] == episode.trajectories[0].response_ids
    assert "step" not in eval_sample_row(episode, 0, decode)  # asyncrl eval's: no training step
    json.dumps(row)


def test_a_training_runs_evaluations_are_recorded_with_their_step(tmp_path, policy_dir, capsys):
    out = tmp_path / "run"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "mode=sync", "partial_rollout=off", "total_steps=2", "eval_every=1", "batch_size=2", "group_size=2",
                 "eval.num_tasks=3", "eval.samples_per_task=2", "task.num_train=16", "task.num_validation=4",
                 "sampling.max_tokens=6", "algorithm.filter_zero_variance=false"]) == 0
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["task_id"], r["sample"]) for r in rows) == sorted(
        (step, task, sample) for step in (0, 1, 2) for task in {r["task_id"] for r in rows} for sample in (0, 1))
    assert all(r["version"] == r["step"] for r in rows)  # each step's evaluation scores its own version
    metrics = {m["step"]: m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    for step in (0, 1, 2):  # the rows are the episodes whose mean the step's row holds
        rewards = [r["reward"] for r in rows if r["step"] == step]
        assert metrics[step]["eval/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))


def test_eval_and_sft_print_the_format_line_train_prints(tmp_path, policy_dir, char_tokenizer, capsys):
    notes = template_notes(char_tokenizer, templated=True, tool_format=resolve_format("auto", char_tokenizer))
    assert any(note.startswith("tool calls: hermes") for note in notes)  # an agent's run: train says the format
    out = tmp_path / "eval"
    assert main(["eval", "examples/openai_agent/train.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "workflow.agent=tests/agent_two_calls.py:run", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "task.num_validation=2", "sampling.max_tokens=4"]) == 0
    err = capsys.readouterr().err
    assert f"asyncrl eval → {out}" in err and all(f"  {note}" in err for note in notes)
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r["version"], r["sample"]) for r in rows] == [(0, 0), (0, 0)] and "step" not in rows[0]
    assert all(isinstance(r["tool_calls"], list) and r["conversation"] for r in rows)  # read through the gateway

    from asyncrl.sft.trainer import format_notes

    lines = format_notes(char_tokenizer)
    assert lines[:len(notes)] == notes and lines[-1].startswith("tool calls: hermes (auto")
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1"},
                                             {"role": "assistant", "content": "2"}]}) + "\n")
    assert main(["sft", str(ROOT / "examples/sft/conversations.yaml"), f"model.path={policy_dir}",
                 f"output_dir={tmp_path / 'sft'}", f"data.train={data}", "data.eval=[]", "total_steps=1",
                 "batch_size=1"]) == 0
    err = capsys.readouterr().err
    assert all(f"asyncrl sft: {line}" in err for line in lines)


CALLS = {"n": 0}
LOCK = threading.Lock()


def reward_that_hangs_after_three(task, response: str) -> float:
    """The first three episodes are scored; every later one waits (an evaluation that is
    stopped part-way)."""
    with LOCK:
        CALLS["n"] += 1
        n = CALLS["n"]
    if n > 3:
        time.sleep(600)
    return float(len(response) % 2)


@pytest.mark.slow
def test_a_stopped_eval_keeps_the_episodes_it_scored(tmp_path, policy_dir):
    out = tmp_path / "eval"
    args = [sys.executable, "-m", "asyncrl.cli", "eval", "examples/countdown/eval.yaml", f"model.path={policy_dir}",
            f"output_dir={out}", "eval.num_tasks=4", "eval.samples_per_task=2", "task.num_validation=4",
            "sampling.max_tokens=4", "task.reward_fn=test_eval_samples:reward_that_hangs_after_three"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    samples, deadline = out / "eval_samples.jsonl", time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if samples.exists() and samples.read_text().count("\n") >= 3:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "the evaluation cannot have finished: its later episodes hang"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 3, proc.stderr.read().decode()[-2000:]
    assert all({"task_id", "sample", "reward", "version", "response", "trajectories"} <= set(r) for r in rows)
    assert not (out / "eval.json").exists()
