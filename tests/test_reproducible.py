"""η = 0 is sync, and a run repeats itself: every episode samples with a seed derived from
the run's seed and the episode's coordinates (``asyncrl/seeding.py``), and at η = 0 the
gate makes every batch the same groups in the same order whatever order they finished in.

What is exact and what is not: the sampled tokens (and so rewards, advantages, the
groups that were filtered, the evaluations) are compared exactly. The weights are
compared within a float tolerance: the behavior logprobs the engine reports for the same
token differ in the last bits with the batch it was decoded in (which requests shared a
decode step is timing), and μ enters the loss (the ratio against μ, or the importance
weight). Measured on this CPU, 12 steps × 16 samples × 10 seeds (44,110 tokens) of
``mode=sync`` against ``mode=async max_staleness=0``: no token differed, with the engine
and learner threads pinned alike or left to each mode's default; the weights differed by
at most 1.6e-4 after 12 steps at lr 1e-2, while training moved them by ~4e-2."""

from __future__ import annotations

import asyncio
import json

import pytest
from safetensors.torch import load_file

from asyncrl.cli import main
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.config import load_config
from asyncrl.engine import TorchEngine
from asyncrl.rollout.eval_scoring import evaluate
from asyncrl.orchestrator.task_stream import TaskStream
from asyncrl.policy import load_policy
from asyncrl.seeding import derive_seed, episode_seed
from asyncrl.tasks import Task
from asyncrl.types import Episode, SamplingParams
from asyncrl.rollout.workflows import run_episode
from asyncrl.rollout.workflows.registry import build_tasks

STEPS = 4
WEIGHT_ATOL = 1e-4  # float noise from μ (module docstring): ~3e-6 measured over these 4 steps; lr = 1e-2


def parity(task, text):
    """A reward a random policy earns half the time, so groups have advantages and some
    groups are all equal (filtered, and replaced by the next task of the stream)."""
    return float(len(text) % 2)


def run(tmp_path, policy_dir, name, *overrides):
    out = tmp_path / name
    args = ["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
            f"total_steps={STEPS}", "batch_size=2", "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=2",
            "eval_every=2", "task.num_train=64", "task.num_validation=8", "optim.lr=1e-2",
            "task.reward_fn=test_reproducible:parity", *overrides]
    assert main(args) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = max(out.glob("checkpoints/step_*"), key=lambda path: int(path.name[5:]))
    weights = load_file(last / ("adapter_model.safetensors" if (last / "adapter_config.json").exists()  # model.lora
                                else "model.safetensors"))
    return samples, metrics, weights


SAMPLE_KEYS = ("step", "task_id", "group", "episode", "response", "response_tokens", "reward", "advantage",
               "behavior_version_min", "behavior_version_max", "trained_version", "finish_reason")
METRIC_KEYS = ("step", "version", "reward/mean", "rollout/reward_mean", "rollout/episodes",
               "rollout/groups_filtered_total", "rollout/groups_accepted_total", "actor/tokens",
               "eval/reward_mean", "eval/pass@1", "eval/pass@2", "eval/version")


def same_run(a, b, metric_keys=METRIC_KEYS):
    """The same samples in the same steps and order, the same evaluations, weights within float noise."""
    (samples_a, metrics_a, weights_a), (samples_b, metrics_b, weights_b) = a, b
    assert [[s[k] for k in SAMPLE_KEYS] for s in samples_a] == [[s[k] for k in SAMPLE_KEYS] for s in samples_b]
    assert [[m.get(k) for k in metric_keys] for m in metrics_a] == [[m.get(k) for k in metric_keys] for m in metrics_b]
    assert weights_a.keys() == weights_b.keys()
    return max(float((weights_a[k] - weights_b[k]).abs().max()) for k in weights_a)


@pytest.mark.equivalence
@pytest.mark.slow
def test_async_with_eta_0_trains_on_the_sync_samples_and_a_run_repeats_itself(tmp_path, policy_dir):
    sync = run(tmp_path, policy_dir, "sync", "mode=sync", "partial_rollout=off")
    async0 = run(tmp_path, policy_dir, "async0", "mode=async", "max_staleness=0")
    again = run(tmp_path, policy_dir, "again", "mode=sync", "partial_rollout=off")
    samples, metrics, weights = sync
    assert len(samples) == STEPS * 2 * 4 and {s["trained_version"] - s["behavior_version_min"] for s in samples} == {0}
    # the run exercises what could reorder a batch: filtered groups replaced mid-step, evaluations beside rollouts
    assert metrics[-1]["rollout/groups_filtered_total"] > 0
    assert [m["step"] for m in metrics if "eval/reward_mean" in m] == [0, 2, 4]
    initial = load_file(policy_dir / "model.safetensors")
    assert max(float((weights[k] - initial[k]).abs().max()) for k in initial) > 1e-2  # training moved them
    assert same_run(sync, async0) <= WEIGHT_ATOL
    assert same_run(sync, again) <= WEIGHT_ATOL
    other_seed = run(tmp_path, policy_dir, "seed1", "mode=sync", "partial_rollout=off", "seed=1")
    assert [s["response"] for s in other_seed[0]] != [s["response"] for s in samples]


def test_episode_seeds_are_stable_and_differ_in_every_coordinate():
    # pinned: a change here silently changes every run's samples
    assert episode_seed(0, "train", "t1", 0, 0, 1) == 1309475529489435366
    base = (0, "train", "t1", 0, 0, 1)
    variants = [(1, "train", "t1", 0, 0, 1), (0, "eval", "t1", 0, 0, 1), (0, "train", "t2", 0, 0, 1),
                (0, "train", "t1", 1, 0, 1), (0, "train", "t1", 0, 1, 1), (0, "train", "t1", 0, 0, 2)]
    seeds = {episode_seed(*v) for v in [base, *variants]}
    assert len(seeds) == 1 + len(variants) and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed("1", 2) != derive_seed(1, "2") != derive_seed(12)


def test_a_task_stream_keeps_each_draws_epoch_and_start_order_across_a_resume():
    tasks = [Task(str(i), "p") for i in range(3)]
    stream = TaskStream(tasks, seed=0)
    draws = [stream.next_draw() for _ in range(7)]
    assert [d.epoch for d in draws] == [0, 0, 0, 1, 1, 1, 2] and {d.order for d in draws} == {None}
    resumed = TaskStream(tasks, seed=0, epoch=1, index=1,
                         reissue=[draws[2]._replace(order=3), draws[3]._replace(order=4)])
    assert resumed.next_draw() == draws[2]._replace(order=3) and resumed.next_draw() == draws[3]._replace(order=4)
    assert resumed.next_draw() == draws[4]  # then the cursor's next, with no start order yet


class Flaky:
    """Fails its first attempt after sampling; records each attempt's seed."""

    def __init__(self):
        self.seeds = []

    async def run(self, task, llm):
        self.seeds.append(llm.sampling.seed)
        await llm.generate(task.prompt)
        if len(self.seeds) == 1:
            raise RuntimeError("first attempt fails")
        return Episode(task_id=task.id, trajectories=llm.trajectories, reward=1.0)


def test_each_attempt_and_each_evaluation_sample_gets_its_own_seed(tiny_policy):
    model, tokenizer = tiny_policy
    task = Task("t0", "2+3=")

    async def go():
        engine = TorchEngine(model, max_batch_size=8)
        try:
            make_client = lambda: LLMClient(engine, tokenizer, SamplingParams(max_tokens=6))  # noqa: E731
            flaky = Flaky()
            episode = await run_episode(flaky, task, make_client, timeout_s=30, max_retries=1,
                                        seed=lambda attempt: 100 + attempt)
            seen = []

            async def one(t, sample):
                seen.append((t.id, sample))
                client = LLMClient(engine, tokenizer, SamplingParams(max_tokens=6, seed=sample))
                await client.generate(t.prompt)
                return Episode(task_id=t.id, trajectories=client.trajectories, reward=float(sample))

            result = await evaluate(one, [task, Task("t1", "1+1=")], samples_per_task=3, max_concurrent=4,
                                    indexed=True)
            return flaky, episode, seen, result
        finally:
            await engine.shutdown()

    flaky, episode, seen, result = asyncio.run(go())
    assert flaky.seeds == [101, 102] and episode.attempts == 2 and episode.status == "ok"
    assert sorted(seen) == [(t, s) for t in ("t0", "t1") for s in range(3)]
    # in (task, sample) order whatever order they finished in
    assert [(e.task_id, e.reward) for e in result.episodes] == [(t, float(s)) for t in ("t0", "t1") for s in range(3)]


def test_the_trainer_seeds_each_episode_by_its_coordinates(tmp_path, policy_dir):
    """A trained response is what its seed — (run seed, "train", task, draw, sample,
    attempt) — samples on the initial weights alone, on another engine with another
    generator seed: step 1 trains on version 0's samples."""
    overrides = [f"model.path={policy_dir}", "task.num_train=64", "task.num_validation=8", "seed=3"]
    samples, _, _ = run(tmp_path, policy_dir, "seeded", "mode=sync", "partial_rollout=off", *overrides[1:])
    cfg = load_config("examples/countdown/async.yaml", overrides)
    tasks = {t.id: t for t in build_tasks(cfg).train}
    model, tokenizer = load_policy(cfg.model)
    firsts = [s for s in samples if s["step"] == 1]

    async def resample(sample):
        engine = TorchEngine(model, max_batch_size=4, seed=12345)
        try:
            seed = episode_seed(3, "train", sample["task_id"], 0, sample["episode"], 1)
            sampling = SamplingParams(max_tokens=cfg.sampling.max_tokens, stop_token_ids=stop_token_ids(tokenizer),
                                      seed=seed)
            response = await LLMClient(engine, tokenizer, sampling).chat(
                [{"role": "user", "content": tasks[sample["task_id"]].prompt}])
            return response.text
        finally:
            await engine.shutdown()

    assert [asyncio.run(resample(s)) for s in firsts] == [s["response"] for s in firsts]


@pytest.mark.equivalence
def test_a_resumed_sync_run_trains_on_the_uninterrupted_runs_samples(tmp_path, policy_dir):
    """Stopped at step 2 and resumed: the same samples, step for step, in the same groups
    and order; weights within float noise. The groups of step 3 were generated or in
    flight at the checkpoint (timing); any generated one is turned into an in-flight one
    here, so the resume always re-issues them: with their seeds and their start order.
    (The first row after the resume counts no finished episodes: what it trains on was
    started before the checkpoint.)"""
    whole = run(tmp_path, policy_dir, "whole", "mode=sync", "partial_rollout=off")
    run(tmp_path, policy_dir, "parts", "mode=sync", "partial_rollout=off", "total_steps=2")
    state_file = tmp_path / "parts" / "checkpoints" / "step_2" / "run_state.json"
    state = json.loads(state_file.read_text())
    cfg = load_config("examples/countdown/async.yaml", ["task.num_train=64", "task.num_validation=8"])
    index = {t.id: i for i, t in enumerate(build_tasks(cfg).train)}
    for g in state.pop("buffered"):
        state["reissue"].append({"index": index[g["group"]["task_id"]], "epoch": 0, "order": g["start_order"]})
        state["counters"]["groups_accepted"] -= 1  # not finished, so not counted yet
    state_file.write_text(json.dumps({**state, "buffered": []}))
    assert state["reissue"]
    resumed = run(tmp_path, policy_dir, "parts", "mode=sync", "partial_rollout=off", "resume=true")
    since_last_step = ("rollout/reward_mean", "rollout/episodes")
    assert same_run(whole, resumed, [k for k in METRIC_KEYS if k not in since_last_step]) <= WEIGHT_ATOL
