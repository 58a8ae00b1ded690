"""``learner.streaming``: the learner runs forward and backward on a step's groups as they
arrive (``Learner.accumulate``) and takes the optimizer step when the batch is complete
(``finish_step``); that step is ``train_step``'s on the whole batch, within float rounding,
and a run trains on the same samples either way."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from types import SimpleNamespace

import pytest
import torch
from test_reproducible import WEIGHT_ATOL, run, same_run
from test_sharded_learner import assert_same_metrics
from tolerances import assert_same_adam_step, chain_terms

from asyncrl.cli import main
from asyncrl.config import AlgorithmConfig, ConfigError, OptimConfig, load_config
from asyncrl.learner import Learner, pack_batch
from asyncrl.orchestrator.buffer import GroupBuffer, ReadyGroup
from asyncrl.orchestrator.staleness import AsyncStalenessGate, StalenessGate
from asyncrl.orchestrator.stopping import StopControl
from asyncrl.orchestrator.train_steps import TrainSteps
from asyncrl.orchestrator.watchdog import Watchdog
from asyncrl.tiny import build_tiny_model
from asyncrl.types import Episode, Group, Trajectory


def groups(seed, sizes=(3, 1, 4)):
    """Groups of rows of different lengths (a group's longest differs from the batch's),
    tool tokens masked out, one row with no model token at all; μ a little off the policy."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for size in sizes:
        trajectories = []
        for i in range(size):
            prompt = torch.randint(4, 90, (3 + i % 3,), generator=g).tolist()
            response = torch.randint(4, 90, (2 + (5 * i + size) % 7,), generator=g).tolist()
            mask = [0 if j == 1 or (size == 4 and i == 2) else 1 for j in range(len(response))]
            behavior = (-torch.rand(len(response), generator=g) * 4).tolist()
            trajectories.append(Trajectory(prompt, response, mask, behavior, [0] * len(response), reward=0.0))
        out.append((trajectories, torch.randn(size, generator=g).tolist()))
    return out


def packed(parts):
    return pack_batch([t for ts, _ in parts for t in ts], [a for _, advs in parts for a in advs], pad_id=0)


def learners(char_tokenizer, aggregation="token_mean", kl_coef=0.0, **optim):
    base, tokenizer = build_tiny_model(char_tokenizer, seed=3)
    algorithm = AlgorithmConfig(aggregation=aggregation, kl_coef=kl_coef)
    # a clip that engages (the norm is ~1): the norm of the divided gradients is part of what is compared
    options = {"lr": 1e-2, "grad_clip": 0.3, **optim}
    return [Learner(copy.deepcopy(base), tokenizer, algorithm=algorithm, optim=OptimConfig(**options), total_steps=10,
                    temperature=1.0) for _ in range(2)]


def streamed_step(learner, parts, on_policy=False):
    for trajectories, advantages in parts:
        learner.accumulate(pack_batch(trajectories, advantages, pad_id=0), on_policy=on_policy)
    return learner.finish_step()


def assert_same_step(a, b, parts, earlier=()):
    """The same clipped gradient went into the optimizer step (``p.grad`` is kept until the
    next step), and the weights agree within what AdamW makes of its rounding: both bounds
    derived in tests/tolerances.py (the gradient's rounding through the model's chain of
    sums; AdamW's step of ~lr whatever the gradient's size where a gradient is within that
    rounding of 0). Both learners took the step from the same weights."""
    n = chain_terms(b.model.config, packed(parts).input_ids.numel())
    return assert_same_adam_step(a.model, b.model, b.optimizer.defaults["lr"], n, earlier)


@pytest.mark.equivalence
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_a_streamed_step_is_the_batched_step(char_tokenizer, aggregation, on_policy):
    """Group by group against the whole batch at once, two steps (the second on each
    learner's own AdamW state from the first): the same gradients and weights, and the
    same metrics, keys and values. Before the second step the streamed learner takes the
    batched one's weights: rounding in the first step moves weights whose gradient is ~0
    by up to ~lr (tests/tolerances.py), and the second step's gradients are compared
    from equal weights."""
    batched, streamed = learners(char_tokenizer, aggregation)
    earlier = []
    for seed in (0, 1):
        parts = groups(seed)
        expected = batched.train_step(packed(parts), on_policy=on_policy)
        actual = streamed_step(streamed, parts, on_policy)
        assert_same_metrics(actual, expected)
        earlier.append(assert_same_step(streamed, batched, parts, earlier))
        streamed.model.load_state_dict(batched.model.state_dict())
    assert streamed.version == batched.version == 2
    assert expected["actor/clip_fraction"] == 0.0 or on_policy  # r = 1 when π_prox is the step's own forward


@pytest.mark.equivalence
def test_micro_batches_kl_and_parts_of_several_groups_change_nothing(char_tokenizer):
    """Micro-batches of one row, a KL term (a reference forward per part), and a part of
    two groups followed by a part of one: still the batched step."""
    batched, streamed = learners(char_tokenizer, "seq_mean", kl_coef=0.1, micro_batch_size=1)
    parts = groups(2)
    expected = batched.train_step(packed(parts))
    streamed.accumulate(packed(parts[:2]))
    streamed.accumulate(packed(parts[2:]))
    actual = streamed.finish_step()
    assert "actor/kl_ref" in actual
    assert_same_metrics(actual, expected)
    assert_same_step(streamed, batched, parts)


def test_nothing_moves_until_the_step_and_a_step_needs_a_part(char_tokenizer):
    learner, _ = learners(char_tokenizer)
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    learner.accumulate(packed(groups(0)))
    assert learner.version == 0
    assert all(torch.equal(p, before[name]) for name, p in learner.model.named_parameters())
    learner.finish_step()
    assert learner.version == 1
    with pytest.raises(RuntimeError, match="finish_step without a part"):
        learner.finish_step()


def test_a_streamed_step_is_refused_with_sample_reuse(char_tokenizer):
    learner, _ = learners(char_tokenizer, ppo_epochs=2)
    with pytest.raises(ValueError, match="optim.ppo_epochs=1"):
        learner.accumulate(packed(groups(0)))


@pytest.mark.parametrize("overrides, named", [
    (["optim.ppo_epochs=2"], "optim.ppo_epochs=2"),
    (["optim.mini_batches=2"], "optim.mini_batches=2"),
    (["learner.world_size=2"], "learner.world_size=2"),
])
def test_config_refuses_streaming_beyond_one_step_on_one_rank(overrides, named):
    with pytest.raises(ConfigError, match=f"learner.streaming=true .* but {named}; set learner.streaming=false"):
        load_config(None, ["learner.streaming=true", *overrides])
    load_config(None, overrides)  # each alone is fine


def test_the_command_line_exits_2_naming_the_keys(tmp_path, capsys):
    code = main(["train", "examples/countdown/async.yaml", "learner.streaming=true", "optim.ppo_epochs=2",
                 f"output_dir={tmp_path / 'never'}"])
    assert code == 2
    assert "learner.streaming=true" in capsys.readouterr().err and not (tmp_path / "never").exists()


class RecordingLearner:
    """The two learner calls of a streamed step, recorded: (call, rows, on_policy)."""

    def __init__(self):
        self.calls = []

    async def accumulate(self, batch, on_policy):
        self.calls.append(("accumulate", batch.size, on_policy))

    async def finish_step(self):
        self.calls.append(("finish_step",))
        return {"actor/loss": 0.0}


def streaming_trainer(batch_size):
    """A run's train-step part only (no run, no pre-flight): a real buffer and gate, a
    recording learner, η = 1."""
    cfg = load_config(None, [f"batch_size={batch_size}", "learner.streaming=true"])
    gate = AsyncStalenessGate(StalenessGate(max_staleness=1, groups_per_step=batch_size))
    stop, t0 = StopControl(), time.perf_counter()

    async def engine_work():
        return {"busy_s": 0.0}

    steps = TrainSteps(GroupBuffer(gate), RecordingLearner(),
                       SimpleNamespace(engine_work=engine_work),  # read around each learner call
                       batch_size=batch_size, pad_token_id=0, stop=stop,
                       watchdog=Watchdog(cfg.watchdog), on_train=lambda *a: None,
                       now=lambda: time.perf_counter() - t0)
    steps.stop = stop.request
    return steps


async def land(trainer, order, rows=2):
    """A group of ``rows`` on-policy trajectories finishes and enters the buffer."""
    await trainer.buffer.gate.acquire()
    episodes = [Episode(f"t{order}", [Trajectory([1], [2, 3], [1, 1], [-1.0, -1.0], [0, 0])], reward=float(i))
                for i in range(rows)]
    await trainer.buffer.put(ReadyGroup(Group(f"t{order}", episodes, [0.5] * rows), order))


def test_the_train_loop_accumulates_what_is_ready_then_each_group_as_it_lands():
    async def main():
        trainer = streaming_trainer(batch_size=3)
        await land(trainer, 1)
        await land(trainer, 0)
        step = asyncio.create_task(trainer.streamed(0, 1))
        await asyncio.sleep(0.05)
        assert trainer.learner.calls == [("accumulate", 4, True)]  # both ready groups in one part
        await land(trainer, 2, rows=3)
        trained = await step
        assert trainer.learner.calls == [("accumulate", 4, True), ("accumulate", 3, True), ("finish_step",)]
        assert [g.start_order for g in trained.groups] == [0, 1, 2] and len(trained.trajectories) == 7
        assert trained.actor == {"actor/loss": 0.0} and trained.waited_s > 0.04

    asyncio.run(main())


def test_a_stop_mid_step_puts_the_groups_taken_back_and_takes_no_step():
    async def main():
        trainer = streaming_trainer(batch_size=2)
        await land(trainer, 0)
        step = asyncio.create_task(trainer.streamed(0, 1))
        await asyncio.sleep(0.05)
        trainer.stop()
        assert await step is None
        assert trainer.learner.calls == [("accumulate", 2, True)]
        assert [g.start_order for g in trainer.buffer.snapshot()] == [0]  # a checkpoint keeps it

    asyncio.run(main())


@pytest.mark.equivalence
def test_a_sync_run_streamed_trains_on_the_same_samples_as_batched(tmp_path, policy_dir):
    """At η = 0 the batches are the same groups either way, so the same steps make the same
    samples: every sampled token equal, the weights within float noise."""
    batched = run(tmp_path, policy_dir, "batched", "mode=sync", "partial_rollout=off")
    streamed = run(tmp_path, policy_dir, "streamed", "mode=sync", "partial_rollout=off", "learner.streaming=true")
    assert same_run(batched, streamed) < WEIGHT_ATOL
    assert [set(m) for m in streamed[1]] == [set(m) for m in batched[1]]  # the same keys, row by row
    rows = [m for m in streamed[1] if m["step"] > 0]
    assert all(0 <= m["trainer/learner_idle_ratio"] <= 1 and m["time/learner"] > 0 for m in rows)


def test_an_async_run_streamed_stays_within_eta(tmp_path, policy_dir):
    out = tmp_path / "async"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "total_steps=5", "batch_size=3", "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=1",
                 "eval_every=0", "algorithm.filter_zero_variance=false", "task.num_train=64", "task.num_validation=8",
                 "max_staleness=1", "sampling.max_tokens=64", "learner.streaming=true"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 5 * 3 * 4
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 1
    for step in range(1, 6):  # each step's rows in start order, whatever order its groups came in
        order = [s["group"] for s in samples if s["step"] == step]
        assert order == sorted(order)
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    assert {e["step"] for e in timeline if e["kind"] == "train"} == set(range(1, 6))
