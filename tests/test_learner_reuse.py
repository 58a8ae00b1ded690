"""Sample reuse: ``optim.ppo_epochs`` passes over a batch in ``optim.mini_batches`` shuffled
mini-batches, every optimizer step against the π_prox of the batch's start; the version
advances once per batch."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from conftest import reference_logprobs
from test_sharded_learner import assert_same_metrics, assert_same_weights, batch, config, one_rank, started
from tolerances import assert_same_adam_step, chain_terms

from asyncrl.algorithms import aggregate, policy_loss
from asyncrl.cli import main
from asyncrl.config import AlgorithmConfig, ConfigError, OptimConfig, load_config
from asyncrl.learner import Learner, pack_batch
from asyncrl.learner.learner import mini_batch_rows
from asyncrl.tiny import build_tiny_model
from asyncrl.types import Trajectory


def reuse_batch(model, tokenizer):
    """Four responses to one prompt with advantages of both signs; μ a little off the
    current policy, so the importance weight is not 1 either."""
    prompt = tokenizer.encode("<|im_start|>user\n1 2 3 -> 6<|im_end|>\n<|im_start|>assistant\n")
    trajectories = []
    for i, text in enumerate(["1+2+3<|im_end|>", "hello<|im_end|>", "3*2<|im_end|>", "6<|im_end|>"]):
        ids = tokenizer.encode(text)
        behavior = (reference_logprobs(model, prompt, ids) + 0.05 * (i - 1.5)).tolist()
        trajectories.append(Trajectory(prompt, ids, [1] * len(ids), behavior, [0] * len(ids), reward=float(i % 2)))
    return pack_batch(trajectories, [0.9, -0.5, 0.3, -0.7], tokenizer.pad_token_id)


def learner(model, tokenizer, lr=1e-2, share_prompts=True, **optim):
    return Learner(model, tokenizer, algorithm=AlgorithmConfig(), total_steps=10, temperature=1.0,
                   optim=OptimConfig(lr=lr, **optim), share_prompts=share_prompts)


def logprobs(model, b):
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)


@pytest.mark.equivalence
def test_one_epoch_of_one_mini_batch_is_the_plain_decoupled_ppo_step(char_tokenizer):
    """The default is the step as it was before reuse: one forward for π_prox, one for
    the loss, one clipped AdamW step — here written out by hand. (The learner takes π_prox
    from the loss's own forward pass, detached, when a batch is one optimizer step: this
    test is what says that changes nothing.)"""
    base, tokenizer = build_tiny_model(char_tokenizer, seed=5)
    b = reuse_batch(base, tokenizer)
    trained, by_hand = copy.deepcopy(base), copy.deepcopy(base)
    # rows whole, as written out below (learner.share_prompts gives this step up to float
    # rounding: tests/test_shared_prompts.py)
    metrics = learner(trained, tokenizer, share_prompts=False).train_step(b)

    cfg = AlgorithmConfig()
    proximal = logprobs(by_hand, b)
    optimizer = torch.optim.AdamW(by_hand.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    by_hand.train()
    current = torch.log_softmax(by_hand(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float(),
                                -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    loss, _ = policy_loss(current, b.behavior_logprobs, b.advantages, b.loss_mask, proximal_logprobs=proximal,
                          config=cfg)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 1.0)
    optimizer.step()
    # the same gradients and step within rounding and what AdamW makes of it (tests/tolerances.py)
    assert_same_adam_step(trained, by_hand, 1e-2, chain_terms(base.config, b.input_ids.numel()))
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/clip_fraction"] == 0.0  # r = 1: the clip is idle
    assert metrics["actor/optimizer_steps"] == 1.0
    assert metrics["actor/loss"] == pytest.approx(float(loss.detach()), abs=1e-7)


def listed(steps):
    return [p.tolist() for p in steps]


def test_mini_batch_rows_partition_each_epoch_reproducibly():
    steps = mini_batch_rows(10, epochs=3, mini_batches=4, seed=7)
    assert len(steps) == 12
    for epoch in range(3):
        parts = steps[4 * epoch:4 * epoch + 4]
        assert sorted(torch.cat(parts).tolist()) == list(range(10))
        assert sorted(len(p) for p in parts) == [2, 2, 3, 3]
    assert listed(steps[:4]) != listed(steps[4:8])  # a fresh shuffle per epoch
    assert listed(mini_batch_rows(10, epochs=3, mini_batches=4, seed=7)) == listed(steps)
    assert listed(mini_batch_rows(10, epochs=1, mini_batches=4, seed=8)) != listed(steps[:4])
    assert listed(mini_batch_rows(5, epochs=2, mini_batches=1, seed=7)) == [list(range(5))] * 2
    assert [len(p) for p in mini_batch_rows(2, epochs=1, mini_batches=4, seed=7)] == [1, 1]  # no empty steps


def test_a_second_epoch_measures_the_ratio_against_the_batch_start_and_clips(char_tokenizer):
    """With ppo_epochs=2 the first epoch is the plain step; the second sees the weights it
    left against the same π_prox: its ratio is π_θ1/π_θ0, no longer 1, and with a large lr
    some tokens leave the trust region (the clip engages). The metrics are the mean of the
    two epochs, so the second epoch's are read off them and checked against π_θ1/π_θ0
    computed here from the one-epoch learner's weights."""
    base, tokenizer = build_tiny_model(char_tokenizer, seed=6)
    b = reuse_batch(base, tokenizer)
    one, two = copy.deepcopy(base), copy.deepcopy(base)
    lr = 0.05
    first = learner(one, tokenizer, lr=lr).train_step(b)
    reusing = learner(two, tokenizer, lr=lr, ppo_epochs=2)
    both = reusing.train_step(b)
    assert reusing.version == 1 and both["actor/optimizer_steps"] == 2.0
    assert first["actor/ratio_mean"] == 1.0 and first["actor/clip_fraction"] == 0.0

    second_ratio = 2 * both["actor/ratio_mean"] - first["actor/ratio_mean"]
    second_clip = 2 * both["actor/clip_fraction"] - first["actor/clip_fraction"]
    cfg = AlgorithmConfig()
    _, expected = policy_loss(logprobs(one, b), b.behavior_logprobs, b.advantages, b.loss_mask,
                              proximal_logprobs=logprobs(base, b), config=cfg)
    assert second_ratio == pytest.approx(float(expected["ratio_mean"]), abs=1e-5)
    assert second_clip == pytest.approx(float(expected["clip_fraction"]), abs=1e-6)
    assert abs(second_ratio - 1) > 0.01 and second_clip > 0.1
    ratio = torch.exp(logprobs(one, b) - logprobs(base, b))
    assert float(aggregate(ratio, b.loss_mask)) == pytest.approx(second_ratio, abs=1e-5)
    # the second epoch moved the weights on from where the first left them
    assert max(float((p - q).abs().max()) for p, q in zip(one.state_dict().values(), two.state_dict().values())) > 1e-3


@pytest.mark.equivalence
@pytest.mark.slow
def test_two_ranks_reuse_samples_as_one_rank_does(policy_dir):
    """Mini-batches are cut from the whole batch by a seed every rank derives alike; each
    rank trains on its rows of each, weighted by the whole mini-batch's counts, so two
    ranks (3 + 2 rows, uneven mini-batches of 3 and 2 rows) take one rank's four steps."""
    reuse = ["optim.ppo_epochs=2", "optim.mini_batches=2", "batch_size=2", "group_size=5", "optim.micro_batch_size=1"]
    _, expected_weights, (expected_metrics,) = one_rank(config(policy_dir, *reuse), batch(0))

    async def scenario():
        sharded = await started(config(policy_dir, *reuse, "learner.world_size=2", "learner.strategy=ddp"))
        try:
            return await sharded.train_step(batch(0), False), await sharded.publish()
        finally:
            await sharded.shutdown()

    metrics, weights = asyncio.run(scenario())
    assert expected_metrics["actor/optimizer_steps"] == 4.0
    assert_same_metrics(metrics, expected_metrics)
    assert_same_weights(weights, expected_weights)


def test_mini_batches_keep_the_staleness_bound_and_versions_exact(tmp_path, policy_dir):
    """Four optimizer steps per batch, one version per batch: every trained token is at
    most η versions old at the version that trains it, samples name trained_version =
    step − 1, the engines are sent version = step (the trainer checks the version each
    engine serves after every sync), and the checkpoint says version = total_steps."""
    out = tmp_path / "reuse"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "total_steps=5", "batch_size=2", "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "eval_every=0", "algorithm.filter_zero_variance=false", "task.num_train=64", "task.num_validation=4",
                 "mode=async", "max_staleness=1", "partial_rollout=abort", "sampling.max_tokens=64",
                 "optim.mini_batches=2", "optim.ppo_epochs=2", "optim.micro_batch_size=2"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(samples) == 5 * 2 * 4
    for s in samples:
        assert s["trained_version"] == s["step"] - 1
        assert 0 <= s["trained_version"] - s["behavior_version_min"] <= 1
        assert s["behavior_version_min"] <= s["behavior_version_max"] <= s["trained_version"]
    assert any(s["trained_version"] > s["behavior_version_min"] for s in samples)  # η was used
    steps = [m for m in metrics if m["step"] > 0]
    assert [m["version"] for m in steps] == [1, 2, 3, 4, 5]
    assert all(m["actor/optimizer_steps"] == 4.0 and m["staleness/max"] <= 1 for m in steps)
    state = torch.load(out / "checkpoints" / "step_5" / "trainer_state.pt", weights_only=False)
    assert state["version"] == 5 and state["scheduler"]["last_epoch"] == 5  # the schedule counts batches too


@pytest.mark.parametrize("overrides,message", [
    (["optim.mini_batches=3"], "optim.mini_batches=3 does not divide the 8 trajectories of a step"),
    (["optim.mini_batches=2", "optim.micro_batch_size=3"],
     "optim.micro_batch_size=3 does not divide the 4 trajectories of a mini-batch"),
])
def test_mini_batches_must_cut_a_step_evenly(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["batch_size=2", "group_size=4", *overrides])
