"""The learner and the one loop for all modes, end to end on CPU with a tiny random policy."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import reference_logprobs
from tolerances import assert_same_adam_step, assert_within, chain_terms, logprob_atol
from transformers import AutoModelForCausalLM

from asyncrl.cli import main
from asyncrl.config import AlgorithmConfig, OptimConfig
from asyncrl.learner import Learner, pack_batch
from asyncrl.learner.learner import micro_batch_bounds
from asyncrl.orchestrator.train_steps import TrainSteps
from asyncrl.tiny import build_tiny_model
from asyncrl.types import Trajectory


def train_run(tmp_path, policy_dir, name, *overrides):
    out = tmp_path / name
    args = ["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
            "total_steps=4", "batch_size=2", "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=1",
            "eval_every=0", "algorithm.filter_zero_variance=false", "task.num_train=64",
            "task.num_validation=8", *overrides]
    assert main(args) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, samples, metrics


def staleness(samples):
    return [s["trained_version"] - s["behavior_version_min"] for s in samples]


def test_sync_is_on_policy(tmp_path, policy_dir):
    out, samples, metrics = train_run(tmp_path, policy_dir, "sync", "mode=sync", "partial_rollout=off")
    assert len(samples) == 4 * 2 * 4
    assert set(staleness(samples)) == {0}
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4] and "eval/reward_mean" in metrics[0]
    assert (out / "checkpoints" / "step_4" / "config.json").exists()


def test_a_run_shorter_than_eval_every_still_ends_with_an_evaluation(tmp_path, policy_dir, capsys):
    _, _, metrics = train_run(tmp_path, policy_dir, "short", "total_steps=3", "eval_every=10")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert metrics[-1]["eval/version"] == 3 and "eval/reward_mean" not in metrics[1]
    err = capsys.readouterr().err
    first, last = metrics[0], metrics[-1]
    assert (f"eval reward {first['eval/reward_mean']:.3f} → {last['eval/reward_mean']:.3f}, pass@1 "
            f"{first['eval/pass@1']:.3f} → {last['eval/pass@1']:.3f} (step 0 → 3)") in err
    assert f"report: asyncrl report {tmp_path / 'short'}" in err


def test_one_step_off_is_at_most_one_behind(tmp_path, policy_dir):
    _, samples, _ = train_run(tmp_path, policy_dir, "one", "mode=one_step_off", "partial_rollout=off")
    assert max(staleness(samples)) <= 1 and len(samples) == 32
    assert all(not s["resumed"] for s in samples)


async def freeze_mid_generation(worker, _index: int, timeout_s: float = 300) -> int:
    """Stop ``worker``'s engine between two of its steps (``pause("keep")``: the rows keep
    their place) at a moment it runs a generation — every running row has sampled a token
    by then, as a prefill samples one. Returns how many rows it froze; the weight sync
    that comes next aborts them, and its ``resume`` lets the engine go on."""
    engine = await worker.ready_engine()
    deadline = time.monotonic() + timeout_s
    while True:
        await engine.pause("keep")
        running = engine.queue_state().running
        if running:
            return running
        await engine.resume()
        assert time.monotonic() < deadline, f"no generation ran within {timeout_s} s of the learner's first step"
        await asyncio.sleep(0.01)


def test_async_abort_resumes_and_respects_eta(tmp_path, policy_dir, monkeypatch):
    """A weight sync lands mid-generation by arrangement, not by the machine's timing: the
    learner's first step starts only once a generation runs, and the engine waits frozen
    there until that step's sync aborts it (the first take lets the next groups start, so
    one always comes)."""
    frozen, learn = [], TrainSteps._learn

    async def learn_beside_a_frozen_generation(self, trained, step, call):
        if step == 1:
            frozen.extend(await self.rollout.apply(freeze_mid_generation))
        return await learn(self, trained, step, call)

    monkeypatch.setattr(TrainSteps, "_learn", learn_beside_a_frozen_generation)
    _, samples, metrics = train_run(tmp_path, policy_dir, "async", "mode=async", "max_staleness=2",
                                    "partial_rollout=abort", "total_steps=6", "sampling.max_tokens=96")
    assert sum(frozen) >= 1
    assert max(staleness(samples)) <= 2
    resumed = [s for s in samples if s["resumed"]]
    assert resumed, "weight syncs mid-generation should abort and resume some trajectories"
    assert any(s["behavior_version_max"] > s["behavior_version_min"] for s in resumed)
    assert all(m["staleness/max"] <= 2 for m in metrics if m["step"] > 0)


def make_learner(model, tokenizer, micro_batch_size=64, lr=0.01):
    return Learner(model, tokenizer, algorithm=AlgorithmConfig(), total_steps=10, temperature=1.0,
                   optim=OptimConfig(lr=lr, micro_batch_size=micro_batch_size))


def fixed_batch(model, tokenizer):
    """One prompt, a rewarded and an unrewarded completion, with on-policy behavior logprobs."""
    prompt = tokenizer.encode("<|im_start|>user\n1 2 3 -> 6<|im_end|>\n<|im_start|>assistant\n")
    good, bad = tokenizer.encode("1+2+3<|im_end|>"), tokenizer.encode("hello<|im_end|>")
    trajectories = [Trajectory(prompt, ids, [1] * len(ids), reference_logprobs(model, prompt, ids).tolist(),
                               [0] * len(ids), reward=r) for ids, r in ((good, 1.0), (bad, 0.0))]
    return prompt, good, bad, pack_batch(trajectories, [0.7071, -0.7071], tokenizer.pad_token_id)


def test_one_step_raises_probability_of_rewarded_completion(char_tokenizer):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=1)
    prompt, good, bad, batch = fixed_batch(model, tokenizer)
    before_good = reference_logprobs(model, prompt, good).sum()
    before_bad = reference_logprobs(model, prompt, bad).sum()
    learner = make_learner(model, tokenizer)
    stats = learner.train_step(batch)
    assert learner.version == 1 and stats["actor/grad_norm"] > 0
    after_good = reference_logprobs(model, prompt, good).sum()
    after_bad = reference_logprobs(model, prompt, bad).sum()
    assert after_good > before_good
    assert after_good - after_bad > before_good - before_bad  # and more than the unrewarded one


def assert_same_step(actual, expected, batch, lr=0.01):
    """The same gradients and the same AdamW step from the same weights, within the bounds
    tests/tolerances.py derives: AdamW moves a weight by ~lr whatever its gradient's size,
    so rounding on a near-zero gradient may move it by up to ~lr, a clear one hardly."""
    assert_same_adam_step(actual, expected, lr, chain_terms(expected.config, batch.input_ids.numel()))


@pytest.mark.equivalence
def test_micro_batching_gives_the_same_step(char_tokenizer):
    base, tokenizer = build_tiny_model(char_tokenizer, seed=2)
    *_, batch = fixed_batch(base, tokenizer)
    whole, split = copy.deepcopy(base), copy.deepcopy(base)
    make_learner(whole, tokenizer, micro_batch_size=2).train_step(batch)
    make_learner(split, tokenizer, micro_batch_size=1).train_step(batch)
    assert_same_step(split, whole, batch)


def test_micro_batch_bounds_cap_rows_and_padded_positions():
    # 2 × 30 fits 60; a third row would pad to 3 × 30; 50 alone; a row past the budget trains alone
    assert micro_batch_bounds([10, 30, 10, 10, 50, 5], max_rows=3, max_tokens=60) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert micro_batch_bounds([10] * 7, max_rows=3, max_tokens=None) == [(0, 3), (3, 6), (6, 7)]
    assert micro_batch_bounds([100, 100, 7], max_rows=8, max_tokens=60) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batch_bounds([], max_rows=4, max_tokens=10) == []


@pytest.mark.equivalence
def test_token_budget_micro_batches_give_the_same_logprobs_loss_and_step(char_tokenizer):
    """A padded-position budget changes how many rows pass through the model at once, not
    what the learner computes: off-policy behavior logprobs, so the recompute, the ratio
    and the clip all take part."""
    base, tokenizer = build_tiny_model(char_tokenizer, seed=3)
    prompt = tokenizer.encode("<|im_start|>user\n1 2 3 -> 6<|im_end|>\n<|im_start|>assistant\n")
    replies = ["1+2+3<|im_end|>", "6<|im_end|>", "a longer reply that pads the others<|im_end|>", "3+3<|im_end|>",
               "2*3<|im_end|>", "no<|im_end|>"]
    trajectories = []
    for i, reply in enumerate(replies):
        ids = tokenizer.encode(reply)
        # 0, 0.04 or 0.08 off the learner: never at mismatch/beyond_fraction's bound (0.1), where
        # float noise between one pass and six would flip a token across it
        behavior = (reference_logprobs(base, prompt, ids) - 0.04 * (i % 3)).tolist()
        trajectories.append(Trajectory(prompt, ids, [1] * len(ids), behavior, [0] * len(ids)))
    batch = pack_batch(trajectories, [1.0, -0.5, 0.8, -1.2, 0.3, -0.4], tokenizer.pad_token_id)
    runs = {}
    for budget in (None, 1):  # one pass of six rows; then each row alone, past the budget
        model = copy.deepcopy(base)
        learner = Learner(model, tokenizer, algorithm=AlgorithmConfig(), total_steps=10, temperature=1.0,
                          optim=OptimConfig(lr=0.01, micro_batch_tokens=budget))
        runs[budget] = (len(learner.micro_batches(batch)), learner.logprobs(model, batch),
                        learner.train_step(batch), model)
    (passes, logprobs, metrics, whole), (split_passes, split_logprobs, split_metrics, split) = runs.values()
    assert (passes, split_passes) == (1, len(replies))
    mask = batch.loss_mask  # past a row's end, one pass reads padding and a split pass nothing
    n = chain_terms(base.config, batch.input_ids.numel())
    assert_within(split_logprobs * mask, logprobs * mask, logprob_atol(logprobs * mask, n), "logprobs")
    assert set(split_metrics) == set(metrics)
    for key, value in metrics.items():
        assert split_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert_same_step(split, whole, batch)


def test_checkpoint_loads_with_same_logits(tmp_path, char_tokenizer):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=3)
    *_, batch = fixed_batch(model, tokenizer)
    learner = make_learner(model, tokenizer)
    learner.train_step(batch)
    path = learner.save_checkpoint(tmp_path / "step_1")
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert (path / "trainer_state.pt").exists() and not (tmp_path / "step_1.tmp").exists()
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch.input_ids).logits, model.eval()(batch.input_ids).logits)


@pytest.mark.slow
def test_sigint_finishes_step_checkpoints_and_exits_0(tmp_path, policy_dir):
    out = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "train", "examples/countdown/async.yaml", f"model.path={policy_dir}",
         f"output_dir={out}", "total_steps=100000", "batch_size=2", "group_size=2", "eval.num_tasks=2",
         "eval.samples_per_task=1", "eval_every=0", "task.num_train=64", "task.num_validation=4",
         "algorithm.filter_zero_variance=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output.decode()[-2000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert (out / "checkpoints" / f"step_{steps[-1]}" / "model.safetensors").exists()
    assert f"interrupted at step {steps[-1]}; continue with the same command and resume=true" in output.decode()


@pytest.mark.equivalence
def test_on_policy_step_equals_recomputed_step(char_tokenizer):
    """Skipping the recompute when μ came from the current weights changes nothing."""
    base, tokenizer = build_tiny_model(char_tokenizer, seed=4)
    *_, batch = fixed_batch(base, tokenizer)
    recomputed, skipped = copy.deepcopy(base), copy.deepcopy(base)
    make_learner(recomputed, tokenizer).train_step(batch)
    make_learner(skipped, tokenizer).train_step(batch, on_policy=True)
    assert_same_step(skipped, recomputed, batch)


def test_a_used_output_dir_is_refused_unchanged_unless_resumed(tmp_path, policy_dir, capsys):
    """A fresh run into an earlier run's directory would truncate its logs and mix its
    checkpoints with the old ones: refused (exit 2), every byte left as it was."""
    out, _, _ = train_run(tmp_path, policy_dir, "again", "mode=sync", "partial_rollout=off", "total_steps=3")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code = main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "mode=sync", "partial_rollout=off", "total_steps=2"])
    assert code == 2
    err = capsys.readouterr().err
    assert str(out) in err and "resume=true" in err and "not empty" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    _, samples, metrics = train_run(tmp_path, policy_dir, "again", "mode=sync", "partial_rollout=off",
                                    "total_steps=5", "resume=true", "keep_last=1")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5]  # one history, every step once
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_5"]
    final = capsys.readouterr().out.strip().splitlines()[-1]
    assert final == f"done; final checkpoint: {out / 'checkpoints' / 'step_5'}"


def test_rotation_never_removes_the_checkpoint_just_written(tmp_path):
    from asyncrl.orchestrator.checkpoint import LEARNER_STATE_FILE, RUN_STATE_FILE, rotate

    for step in (3, 10, 30):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / LEARNER_STATE_FILE).touch()
        (tmp_path / f"step_{step}" / RUN_STATE_FILE).touch()
    rotate(tmp_path, keep_last=2, newest=tmp_path / "step_3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_3", "step_30"]
    rotate(tmp_path, keep_last=1, newest=tmp_path / "step_30")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_30"]
