"""The critic and GAE (``algorithm.advantage: gae``, ``critic``): its settings refused in one
line naming the key, a learner training a critic beside the policy, GAE's advantages from
its values, its checkpoint, and a short run end to end."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.algorithms.finite import NonFiniteError
from asyncrl.algorithms.gae import explained_variance, gae, value_loss, whiten
from asyncrl.cli import main
from asyncrl.config import AlgorithmConfig, ConfigError, CriticConfig, OptimConfig, load_config
from asyncrl.learner import Learner, pack_batch
from asyncrl.learner.critic import Critic
from asyncrl.learner.value_model import load_value_model, token_values
from asyncrl.orchestrator.invariants import OK, SKIP, WARN, check_run, critic_explains
from asyncrl.types import Trajectory


@pytest.mark.parametrize("overrides, says", [
    (["algorithm.advantage=gae", "critic=true", "algorithm.lam=1.5"], "'algorithm.lam'"),
    (["algorithm.advantage=gae", "critic=true", "algorithm.gamma=-0.1"], "'algorithm.gamma'"),
    (["algorithm.advantage=gae"], "algorithm.advantage=gae needs a critic"),
    (["critic.value_clip=0.2"], "critic is set, but algorithm.advantage=grpo"),
    (["algorithm.whiten_advantages=false"], "algorithm.whiten_advantages=false is for algorithm.advantage=gae"),
    (["algorithm.advantage=gae", "critic=true", "critic.value_clip=0"], "'critic.value_clip'"),
    (["algorithm.advantage=gae", "critic.lora.sync=merged"], "critic.lora.sync=merged"),
    (["algorithm.advantage=gae", "critic=true", "learner.url=http://127.0.0.1:1", "model.lora=true",
      "algorithm.bypass=true"], "algorithm.advantage=gae (needs a group-relative estimator"),
])
def test_bad_critic_settings_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_critic_is_off_by_default_and_on_with_any_of_its_keys():
    assert load_config(None, []).critic is None
    cfg = load_config(None, ["algorithm.advantage=gae", "critic.optim.lr=3e-4", "critic.lora.rank=4"])
    assert cfg.critic.optim.lr == 3e-4 and cfg.critic.lora.rank == 4 and cfg.critic.value_clip == 0.2
    assert cfg.critic.model.path is None and cfg.critic.warmup_steps == 0
    assert (cfg.algorithm.gamma, cfg.algorithm.lam, cfg.algorithm.whiten_advantages) == (1.0, 0.95, None)


POLICY = str(Path(__file__).resolve().parents[1] / "models" / "countdown-tiny")


def policy_and_tokenizer():
    return AutoModelForCausalLM.from_pretrained(POLICY), AutoTokenizer.from_pretrained(POLICY)


def hand_batch(tokenizer, outcomes=(1.0, 0.0, 0.5, 0.0)):
    """Four one-turn answers to one Countdown-like prompt, the second with a tool's output
    (mask 0) between two model turns; outcome rewards on each last model token."""
    prompt = tokenizer.encode("<|im_start|>user\n1 2 3 -> 6<|im_end|>\n<|im_start|>assistant\n")
    rows = []
    for i, text in enumerate(["1+2+3<|im_end|>", "3*2 = 6<|im_end|>", "6<|im_end|>", "2*3<|im_end|>"]):
        ids = tokenizer.encode(text)
        mask = [1] * len(ids)
        if i == 1:
            mask[3:6] = [0, 0, 0]  # a tool's output: not an action
        rows.append(Trajectory(prompt, ids, mask, [-1.5 + 0.01 * j for j in range(len(ids))], [0] * len(ids)))
    return pack_batch(rows, list(outcomes), tokenizer.pad_token_id, outcomes=True)


def critic_learner(policy, tokenizer, critic_cfg=None, *, algorithm=None, seed=0):
    cfg = critic_cfg or CriticConfig(optim={"lr": 1e-3})
    critic = Critic(load_value_model(POLICY), tokenizer, cfg, total_steps=10, seed=seed)
    return Learner(policy, tokenizer, algorithm=algorithm or AlgorithmConfig(advantage="gae"), total_steps=10,
                   temperature=1.0, optim=OptimConfig(lr=1e-3), seed=seed, critic=critic)


def test_the_batch_carries_the_outcome_on_each_last_model_token(char_tokenizer):
    _, tokenizer = policy_and_tokenizer()
    b = hand_batch(tokenizer)
    assert b.rewards.shape == b.loss_mask.shape and b.advantages.abs().sum() == 0
    for i, outcome in enumerate((1.0, 0.0, 0.5, 0.0)):
        last = int(b.loss_mask[i].nonzero().max())
        assert b.rewards[i, last] == outcome and b.rewards[i].sum() == outcome
    assert b.slice(1, 3).rewards.shape == b.slice(1, 3).loss_mask.shape


def test_a_learner_with_a_critic_trains_the_policy_on_gae_of_the_critics_values():
    policy, tokenizer = policy_and_tokenizer()
    before = copy.deepcopy(policy)
    learner = critic_learner(policy, tokenizer)
    b = hand_batch(tokenizer)
    # by hand: the critic's values now, GAE over the actions, whitened over the batch's actions
    with torch.no_grad():
        values = token_values(learner.critic.engine.model, b.input_ids, b.attention_mask)[:, :-1]
    by_hand, returns = gae(b.rewards, values, b.loss_mask, gamma=1.0, lam=0.95)
    targets = learner.critic.targets(b, learner.micro_batches, learner._filler, learner.algorithm)
    torch.testing.assert_close(targets.advantages, whiten(by_hand, b.loss_mask))
    torch.testing.assert_close(targets.returns, returns)
    critic_before = copy.deepcopy(learner.critic.engine.module.state_dict())

    metrics = learner.train_step(b)
    for key in ("critic/value_loss", "critic/explained_variance", "critic/value_clip_frac", "critic/returns_mean"):
        assert math.isfinite(metrics[key]), key
    mask = b.loss_mask.bool()
    assert metrics["critic/returns_mean"] == pytest.approx(float(returns[mask].mean()), rel=1e-5)
    explained = float(explained_variance(values, returns, b.loss_mask))
    assert metrics["critic/explained_variance"] == pytest.approx(explained, abs=1e-4)
    assert metrics["critic/value_clip_frac"] == 0.0  # the first step's V is V_old: nothing to clip
    loss, _ = value_loss(values, values, returns, b.loss_mask, clip=0.2)
    assert metrics["critic/value_loss"] == pytest.approx(float(loss), rel=1e-4)
    assert learner.version == 1 and learner.critic.engine.version == 1
    assert any(not torch.equal(p, before.state_dict()[k]) for k, p in policy.state_dict().items())
    assert any(not torch.equal(p, critic_before[k]) for k, p in learner.critic.engine.module.state_dict().items())
    second = learner.train_step(hand_batch(tokenizer))
    assert second["critic/value_loss"] < metrics["critic/value_loss"]  # the same targets, one step closer
    assert learner.version == 2


def test_the_critics_own_epochs_and_mini_batches_step_it_several_times_and_the_value_clip_binds():
    """critic.ppo_epochs × critic.mini_batches optimizer steps a batch (AdamW's count says so),
    the version once; from the second step V has left V_old, so a clip ε_v far below how
    far one step moves V binds (with one step it never can: the test above)."""
    policy, tokenizer = policy_and_tokenizer()
    cfg = CriticConfig(value_clip=1e-6, ppo_epochs=2, mini_batches=2, optim={"lr": 1e-2})
    learner = critic_learner(policy, tokenizer, cfg)
    metrics = learner.train_step(hand_batch(tokenizer))
    assert metrics["critic/optimizer_steps"] == 4 and learner.critic.engine.version == 1
    steps = {int(state["step"]) for state in learner.critic.engine.optimizer.state.values()}
    assert steps == {4}
    assert 0 < metrics["critic/value_clip_frac"] <= 0.75  # the first of four steps is at V = V_old
    assert math.isfinite(metrics["critic/value_loss"]) and math.isfinite(metrics["critic/grad_norm"])


def test_critic_warm_up_moves_the_critic_only_and_the_version_still_advances():
    policy, tokenizer = policy_and_tokenizer()
    before = copy.deepcopy(policy.state_dict())
    learner = critic_learner(policy, tokenizer, CriticConfig(warmup_steps=1))
    metrics = learner.train_step(hand_batch(tokenizer))
    assert all(torch.equal(p, before[k]) for k, p in policy.state_dict().items())
    assert metrics["actor/optimizer_steps"] == 0 and learner.version == 1 and learner.critic.engine.version == 1
    learner.train_step(hand_batch(tokenizer))
    assert any(not torch.equal(p, before[k]) for k, p in policy.state_dict().items())


def test_non_finite_critic_values_stop_the_step_before_anything_moves():
    policy, tokenizer = policy_and_tokenizer()
    learner = critic_learner(policy, tokenizer)
    with torch.no_grad():
        learner.critic.engine.module.score.weight.fill_(float("nan"))
    before = copy.deepcopy(policy.state_dict())
    with pytest.raises(NonFiniteError, match="non-finite critic values at step 1"):
        learner.train_step(hand_batch(tokenizer))
    assert all(torch.equal(p, before[k]) for k, p in policy.state_dict().items()) and learner.version == 0


def critic_state(learner):
    """The critic's weights and optimizer state. With LoRA, peft keeps the value head it
    wrapped (``score.original_module``, the new head as first drawn) beside the head that
    trains and is saved (``score.modules_to_save``): only the latter computes, so only it is
    compared."""
    engine = learner.critic.engine
    weights = {k: v.clone() for k, v in engine.module.state_dict().items() if "original_module" not in k}
    return weights, copy.deepcopy(engine.optimizer.state_dict())


def assert_same_state(a, b):
    (weights_a, optim_a), (weights_b, optim_b) = a, b
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert optim_a["param_groups"] == optim_b["param_groups"]
    assert optim_a["state"].keys() == optim_b["state"].keys()
    for i, state in optim_a["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(optim_b["state"][i][k])) for k, v in state.items())


@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["full", "lora"])
def test_a_checkpoint_holds_the_critic_and_its_optimizer_and_resume_continues_exactly(tmp_path, lora):
    policy, tokenizer = policy_and_tokenizer()
    cfg = CriticConfig(optim={"lr": 1e-3}, lora=lora)
    learner = critic_learner(policy, tokenizer, cfg)
    learner.train_step(hand_batch(tokenizer))
    learner.save_checkpoint(tmp_path / "step_1")
    assert (tmp_path / "step_1" / "critic" / "optimizer").is_dir()
    saved = critic_state(learner)

    resumed = critic_learner(policy_and_tokenizer()[0], tokenizer, cfg, seed=1)  # another head, other adapters
    resumed.load_checkpoint(tmp_path / "step_1")
    assert_same_state(critic_state(resumed), saved)
    assert resumed.version == 1 and resumed.critic.engine.version == 1
    assert resumed.critic.engine.lr == learner.critic.engine.lr
    # the next step is the uninterrupted run's
    assert resumed.train_step(hand_batch(tokenizer)) == learner.train_step(hand_batch(tokenizer))
    assert_same_state(critic_state(resumed), critic_state(learner))


def test_a_run_with_a_critic_refuses_a_checkpoint_without_one(tmp_path):
    policy, tokenizer = policy_and_tokenizer()
    plain = Learner(policy, tokenizer, algorithm=AlgorithmConfig(), total_steps=10, temperature=1.0,
                    optim=OptimConfig(lr=1e-3))
    plain.save_checkpoint(tmp_path / "step_0")
    with pytest.raises(ConfigError, match="holds no critic"):
        critic_learner(policy_and_tokenizer()[0], tokenizer).load_checkpoint(tmp_path / "step_0")


@pytest.mark.slow
def test_train_with_gae_and_resume_end_to_end(tmp_path, policy_dir):
    """``asyncrl train`` with ``algorithm.advantage=gae``: the critic's four metrics each step,
    the critic in each checkpoint, and ``resume=true`` going on from it."""
    out = tmp_path / "gae"
    args = ["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
            "algorithm.advantage=gae", "critic.value_clip=0.2", "batch_size=2", "group_size=4", "eval_every=0",
            "eval.num_tasks=4", "eval.samples_per_task=1", "task.num_validation=4", "save_every=3"]
    assert main([*args, "total_steps=3"]) == 0
    assert (out / "checkpoints" / "step_3" / "critic" / "model.safetensors").is_file()
    assert main([*args, "total_steps=4", "resume=true"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in trained] == [1, 2, 3, 4]
    for row in trained:
        assert all(math.isfinite(row[f"critic/{k}"])
                   for k in ("value_loss", "explained_variance", "value_clip_frac", "returns_mean"))


@pytest.mark.equivalence
@pytest.mark.slow
def test_eta_0_is_sync_with_a_critic(tmp_path, policy_dir):
    """``mode=async max_staleness=0`` trains on ``mode=sync``'s samples with a critic too:
    the same tokens, rewards and evaluations, the policy and the critic within float noise
    (``tests/test_reproducible.py`` says why not bit for bit)."""
    from test_reproducible import WEIGHT_ATOL, run, same_run

    gae_run = ("algorithm.advantage=gae", "critic=true")
    sync = run(tmp_path, policy_dir, "sync", "mode=sync", "partial_rollout=off", *gae_run)
    async0 = run(tmp_path, policy_dir, "async0", "mode=async", "max_staleness=0", *gae_run)
    assert same_run(sync, async0) <= WEIGHT_ATOL
    critics = [load_file(max((tmp_path / name).glob("checkpoints/step_*"), key=lambda p: int(p.name[5:]))
                         / "critic" / "model.safetensors") for name in ("sync", "async0")]
    assert critics[0].keys() == critics[1].keys()
    assert max(float((critics[0][k] - critics[1][k]).abs().max()) for k in critics[0]) <= WEIGHT_ATOL


def gae_batch(seed, rows=5):
    """``test_sharded_learner.batch``'s rows (uneven lengths, a tool token) with outcome rewards."""
    from test_sharded_learner import batch

    b = batch(seed, rows)
    g = torch.Generator().manual_seed(seed + 100)
    rewards = torch.zeros_like(b.loss_mask)
    last = (b.loss_mask * torch.arange(b.loss_mask.shape[1])).argmax(-1)  # each row's last model token
    rewards[torch.arange(rows), last] = torch.randn(rows, generator=g)
    return dataclasses.replace(b, advantages=torch.zeros(rows), rewards=rewards)


def critic_weights(worker) -> dict[str, torch.Tensor]:
    """The critic's full weights as a rank's worker holds them (gathered to rank 0 under
    FSDP2, a collective every rank runs; ``{}`` on the others), or one rank's own."""
    critic = worker.learner.critic
    if critic.sharding is None:
        return {k: v.detach().clone() for k, v in critic.engine.model.state_dict().items()}
    return critic.sharding.full_state_dict(critic.engine.model)


def one_rank_critic(cfg, *batches):
    """One rank's metrics and critic weights after a step on each batch, and each step's
    critic gradients with their rounding bounds (``tests/tolerances.py``), as
    ``test_sharded_learner.one_rank`` keeps the policy's."""
    from test_sharded_learner import joined
    from tolerances import chain_terms, grad_atol

    worker = joined(cfg)
    metrics, weights, steps = [], [], []
    for b in batches:
        metrics.append(worker.train_step(b, False))
        model = worker.learner.critic.engine.model
        n = chain_terms(model.config, b.input_ids.numel())
        steps.append({name: (p.grad.detach().clone(), grad_atol(p.grad, n))
                      for name, p in model.named_parameters() if p.grad is not None})
        weights.append(critic_weights(worker))
    return metrics, weights, steps


@pytest.mark.slow
@pytest.mark.equivalence
def test_two_ranks_train_the_critic_as_one_does(tmp_path, policy_dir):
    """``learner.world_size=2`` (FSDP2 over gloo): the critic is sharded as the policy is, and
    two steps' metrics — the second step's critic metrics read the critic the first step
    trained, its actor metrics the advantages of those values, whitened over both ranks —
    are one rank's, and the critic's weights after each step are one rank's within what
    AdamW makes of the gradients' rounding (``tolerances.adam_step_atol``, derived as the
    policy's is in ``test_sharded_learner``). Then a checkpoint the two ranks wrote, critic
    included, resumed by one rank: its next step's metrics are the two ranks' next step's."""
    from test_sharded_learner import assert_same_metrics, config, joined, started
    from tolerances import adam_step_atol, assert_within

    lr = 1e-3
    critic = ["algorithm.advantage=gae", f"critic.optim.lr={lr}"]
    expected, expected_weights, grads = one_rank_critic(config(policy_dir, *critic), gae_batch(0), gae_batch(1))

    async def scenario():
        learner = await started(config(policy_dir, *critic, "learner.world_size=2", "learner.strategy=fsdp2",
                                       "optim.micro_batch_size=1"))
        try:
            steps, weights = [], []
            for b in (gae_batch(0), gae_batch(1)):
                steps.append(await learner.train_step(b, False))
                weights.append((await learner.apply(critic_weights))[0])  # rank 0 holds the gathered weights
            await learner.save_checkpoint(tmp_path / "two_ranks", {"step": 2}, {})
            return steps, weights, await learner.train_step(gae_batch(2), False)
        finally:
            await learner.shutdown()

    steps, weights, third = asyncio.run(scenario())
    for actual, wanted in zip(steps, expected, strict=True):
        assert_same_metrics(actual, wanted)
    for k, (actual, wanted) in enumerate(zip(weights, expected_weights, strict=True)):
        assert set(actual) == set(wanted)
        for name in wanted:  # each step since the same initial weights: its gradients' rounding is in m and v
            bound = adam_step_atol(lr, [step[name] for step in grads[:k + 1]], wanted[name])
            assert_within(actual[name], wanted[name], bound, f"critic {name} after step {k + 1}")
    assert any(not torch.equal(weights[0][name], weights[1][name]) for name in weights[0])  # the critic moved
    resumed = joined(config(policy_dir, *critic))
    resumed.load_checkpoint(tmp_path / "two_ranks")
    assert resumed.learner.critic.engine.version == 2
    assert_same_metrics(resumed.train_step(gae_batch(2), False), third)


def test_doctor_warns_when_the_critic_explains_nothing_after_its_warm_up():
    rows = [{"step": i, "critic/explained_variance": v} for i, v in enumerate([0.3, -0.2, -0.1, -0.4], start=1)]
    config = {"critic": {"warmup_steps": 1}}
    finding = critic_explains(config, rows)
    assert (finding.status, finding.step) == (WARN, 2) and "the last 3 steps" in finding.evidence
    assert critic_explains(config, [*rows, {"step": 5, "critic/explained_variance": 0.1}]).status == OK
    assert critic_explains({"critic": {"warmup_steps": 4}}, rows).status == SKIP  # nothing after the warm-up
    names = [f.name for f in check_run(config, 1, [{"step": 0}, *rows], [], [])]
    assert "critic explains the returns" in names
    assert "critic explains the returns" not in [f.name for f in check_run({}, 1, [{"step": 0}, *rows], [], [])]
