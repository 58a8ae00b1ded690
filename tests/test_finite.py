"""Finite or stopped: a reward, advantage, loss, gradient norm or weight that is not a
finite number stops the run (exit 1) naming it, and no checkpoint of bad weights is ever
written; the logs stay valid JSON."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.algorithms.finite import (
    NonFiniteError,
    check_advantages,
    check_rewards,
    count_nonfinite,
    first_nonfinite,
    nonfinite_parameters,
)
from asyncrl.algorithms.losses import policy_loss
from asyncrl.cli import main
from asyncrl.config import AlgorithmConfig, OptimConfig
from asyncrl.learner.learner import Learner
from asyncrl.orchestrator.runlog import _strict_json
from asyncrl.tiny.model import build_tiny_model
from test_trainer import fixed_batch

CALLS = {"loss": 0}


def huge_reward(task, response: str) -> float:
    """Finite in Python, infinite in float32."""
    return 1e300 if len(response) % 2 else 0.0


def nan_reward(task, response: str) -> float:
    return float("nan")


def nan_loss_on_third_call(*args, **kwargs):
    CALLS["loss"] += 1
    loss, metrics = policy_loss(*args, **kwargs)
    return (loss * float("nan"), metrics) if CALLS["loss"] >= 3 else (loss, metrics)


def nan_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """Divides by the group's spread without an epsilon."""
    return (rewards - rewards.mean(-1, keepdim=True)) / torch.zeros_like(rewards)


def run(tmp_path, policy_dir, name, *extra):
    out = tmp_path / name
    start = time.perf_counter()
    code = main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "total_steps=4", "batch_size=2", "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "eval_every=0", "task.num_train=64", "task.num_validation=4", "algorithm.filter_zero_variance=false",
                 "workflow.max_retries=0", *extra])
    return code, out, time.perf_counter() - start


def strict_rows(path):
    """Every line parsed by a JSON reader that refuses NaN and Infinity, as other languages' do."""
    def refuse(name):
        raise ValueError(f"{path} holds {name}, which is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------ pure checks
def test_reward_checks_name_the_task_and_the_limit():
    check_rewards([0.0, -3.5, 1e6], max_abs=1e6, task_id="t1", step=3)
    with pytest.raises(NonFiniteError, match=r"non-finite reward nan for task t7 \(step 2\)"):
        check_rewards([1.0, float("nan")], max_abs=1e6, task_id="t7", step=2)
    with pytest.raises(NonFiniteError, match=r"reward -inf for task t7"):
        check_rewards([float("-inf")], max_abs=1e6, task_id="t7", step=2)
    with pytest.raises(NonFiniteError,
                       match=r"1e\+300 for task t9 \(step 5\) is beyond algorithm.max_abs_reward=1e\+06"):
        check_rewards([0.0, 1e300], max_abs=1e6, task_id="t9", step=5)


def test_advantage_and_scalar_checks():
    check_advantages(torch.tensor([0.5, -0.5]), estimator="grpo", task_id="t", step=1)
    with pytest.raises(NonFiniteError, match="estimator 'mine' for task t"):
        check_advantages(torch.tensor([0.5, float("nan")]), estimator="mine", task_id="t", step=1)
    assert first_nonfinite({"a": torch.tensor(1.0), "b": torch.tensor(2.0)}) is None
    assert first_nonfinite({"a": torch.tensor(1.0), "b": torch.tensor(math.inf), "c": torch.tensor(math.nan)}) == "b"
    big = torch.full((4,), 3e38)  # finite; its norm overflows float32 — not a NaN weight
    assert nonfinite_parameters([("w", big), ("v", torch.tensor([1.0, math.nan])), ("u", torch.zeros(2))]) == ["v"]
    assert count_nonfinite([big, torch.tensor([1.0, math.nan]), torch.tensor([math.inf]), torch.zeros(2)]) == 2


# ------------------------------------------------------------------ the learner
def test_nan_loss_takes_no_step_and_leaves_the_weights(char_tokenizer):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=1)
    _, _, _, batch = fixed_batch(model, tokenizer)
    learner = Learner(model, tokenizer, algorithm=AlgorithmConfig(), total_steps=10, temperature=1.0,
                      optim=OptimConfig(lr=0.01))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch.advantages[:] = float("nan")
    with pytest.raises(NonFiniteError, match="non-finite actor/loss at step 1; the optimizer step was not taken"):
        learner.train_step(batch)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_weights_gone_non_finite_after_a_step_stop_it(char_tokenizer):
    """An optimizer that writes an infinity (a fused kernel's bug, an lr near float32's
    limit) although the loss and gradients were finite."""
    model, tokenizer = build_tiny_model(char_tokenizer, seed=1)
    _, _, _, batch = fixed_batch(model, tokenizer)
    learner = Learner(model, tokenizer, algorithm=AlgorithmConfig(), total_steps=10, temperature=1.0,
                      optim=OptimConfig(lr=0.01))

    def overflow(optimizer, args, kwargs):
        with torch.no_grad():
            dict(model.named_parameters())["model.norm.weight"][0] = math.inf

    learner.optimizer.register_step_post_hook(overflow)
    with pytest.raises(NonFiniteError, match=r"non-finite weights after step 1 \(first \['model.norm.weight'\]\)"):
        learner.train_step(batch)


def test_a_checkpoint_of_nan_weights_is_refused(char_tokenizer, tmp_path):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=1)
    learner = Learner(model, tokenizer, algorithm=AlgorithmConfig(), total_steps=10, temperature=1.0,
                      optim=OptimConfig(lr=0.01))
    learner.save_checkpoint(tmp_path / "step_1")
    with torch.no_grad():
        next(model.parameters())[0] = float("nan")
    with pytest.raises(NonFiniteError, match="refusing to write .*step_2: 1 weight tensors hold NaN"):
        learner.save_checkpoint(tmp_path / "step_2")
    assert not (tmp_path / "step_2").exists() and not (tmp_path / "step_2.tmp").exists()
    assert (tmp_path / "step_1" / "model.safetensors").exists()


# ------------------------------------------------------------------ whole runs
def test_a_huge_finite_reward_stops_the_run_naming_the_task(tmp_path, policy_dir, capsys):
    code, out, seconds = run(tmp_path, policy_dir, "huge", "task.reward_fn=test_finite:huge_reward")
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    assert "is beyond algorithm.max_abs_reward=1e+06" in err and "reward 1e+300 for task" in err
    assert "last good checkpoint: none yet" in err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    for name in ("metrics.jsonl", "samples.jsonl"):
        strict_rows(out / name)
    assert seconds < 120


def test_a_nan_reward_stops_the_run(tmp_path, policy_dir, capsys):
    code, _, _ = run(tmp_path, policy_dir, "nan", "task.reward_fn=test_finite:nan_reward")
    err = capsys.readouterr().err
    assert code == 1 and "non-finite reward nan for task" in err


def test_a_nan_advantage_stops_the_run_naming_the_estimator(tmp_path, policy_dir, capsys):
    code, _, _ = run(tmp_path, policy_dir, "adv", "algorithm.advantage=test_finite:nan_advantage")
    err = capsys.readouterr().err
    assert code == 1 and "non-finite advantage from estimator 'test_finite:nan_advantage'" in err


def test_a_nan_loss_stops_the_run_with_the_last_good_checkpoint(tmp_path, policy_dir, capsys):
    CALLS["loss"] = 0
    code, out, _ = run(tmp_path, policy_dir, "loss", "algorithm.policy_loss=test_finite:nan_loss_on_third_call",
                       "save_every=1", "optim.micro_batch_size=8", "optim.micro_batch_tokens=null")
    err = capsys.readouterr().err
    assert code == 1
    assert "non-finite actor/loss at step 3" in err
    assert f"last good checkpoint: {out / 'checkpoints' / 'step_2'}" in err
    assert not (out / "checkpoints" / "step_3").exists()
    weights = load_file(out / "checkpoints" / "step_2" / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())
    rows = strict_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_the_logs_are_strict_json_even_with_a_nan_metric(tmp_path, policy_dir):
    """A step whose finished episodes all errored has no reward mean (NaN): written as null."""
    code, out, _ = run(tmp_path, policy_dir, "ok", "total_steps=1")
    assert code == 0
    assert _strict_json({"a": float("nan"), "b": [1.0, float("inf")], "c": "x"}) == {"a": None, "b": [1.0, None],
                                                                                    "c": "x"}
    assert strict_rows(out / "metrics.jsonl") and strict_rows(out / "samples.jsonl")

