"""The sharded learner (``learner.world_size`` > 1) on CPU with gloo: N ranks take the
step one rank takes, whatever the split; its checkpoints are Hugging Face directories
that any number of ranks resumes; a failing rank fails the run at once, named; and a run
trains end to end on ``runtime: local`` and ``runtime: ray`` within the staleness bound."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time

import pytest
import torch
from tolerances import adam_step_atol, assert_within, chain_terms, grad_atol
from transformers import AutoModelForCausalLM

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.learner import pack_batch
from asyncrl.learner.distributed import row_range
from asyncrl.policy import load_policy
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.runtime.rank_processes import RankProcesses
from asyncrl.runtime.transport import LearnerGroup, LearnerRankError
from asyncrl.types import Trajectory

LR = 1e-3


def config(policy_dir, *overrides):
    # clipping on (the norm is ~0.4): the global norm across shards is part of what is compared
    return load_config(None, [f"model.path={policy_dir}", f"optim.lr={LR}", "optim.grad_clip=0.1",
                              "learner.timeout_s=60", *overrides])


def batch(seed, rows=5):
    """Rows of different lengths with masked-out tool tokens; an odd count splits unevenly."""
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for i in range(rows):
        prompt = torch.randint(4, 90, (3 + i % 3,), generator=g).tolist()
        response = torch.randint(4, 90, (2 + (3 * i) % 5,), generator=g).tolist()
        mask = [0 if j == 1 else 1 for j in range(len(response))]
        behavior = (-torch.rand(len(response), generator=g) * 4).tolist()
        trajectories.append(Trajectory(prompt, response, mask, behavior, [0] * len(response), reward=0.0))
    return pack_batch(trajectories, torch.randn(rows, generator=g).tolist(), pad_id=0)


def joined(cfg) -> LearnerWorker:
    """One rank in this process, its policy loaded."""
    worker = LearnerWorker(cfg)
    worker.join()
    return worker


def one_rank(cfg, *batches):
    """The unsharded learner's weights and metrics after a step on each batch; its
    gradients of each step, with their rounding bounds, are kept as ``worker.steps`` for
    :func:`assert_same_weights`."""
    worker = joined(cfg)
    worker.steps, metrics = [], []
    for b in batches:
        metrics.append(worker.train_step(b, False))
        n = chain_terms(worker.learner.model.config, b.input_ids.numel())
        worker.steps.append({name: (p.grad.detach().clone(), grad_atol(p.grad, n))
                             for name, p in worker.learner.model.named_parameters() if p.grad is not None})
    return worker, worker.publish(), metrics


def assert_same_weights(actual, expected, steps=None):
    """With ``steps`` (the reference's :func:`one_rank` steps since the same weights, one
    optimizer step each), each weight within what AdamW makes of its gradient's rounding
    (tests/tolerances.py); without, the same tensors to 1e-5 (a transport's copy, or steps
    taken inside one call, whose gradients the reference does not keep)."""
    assert set(actual) == set(expected)
    for name in expected:
        if steps is None:
            torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=0, msg=name)
        else:
            bound = adam_step_atol(LR, [step[name] for step in steps], expected[name])
            assert_within(actual[name], expected[name], bound, name)


def assert_same_metrics(actual, expected):
    assert set(actual) == set(expected)
    for key in expected:
        assert actual[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key


async def started(cfg, **kwargs):
    """The learner handle over N rank processes, every rank joined."""
    learner = LearnerGroup(RankProcesses(cfg, **kwargs))
    try:
        await learner.transport.start()
    except BaseException:
        await learner.shutdown()
        raise
    return learner


def held(worker):
    """Each parameter as this rank holds it (its local piece under FSDP2), and its buffers."""
    module = worker.learner.module
    return ({name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
             for name, p in module.named_parameters()}, {name: b.clone() for name, b in module.named_buffers()})


def assert_rank_holds_its_slices(held_by_ranks, expected, sharded):
    """Each rank's parameters are exactly its ``torch.chunk`` rows of the one-rank model's
    (FSDP2's ``Shard(0)``), or the whole of each (DDP); its buffers exactly the model's."""
    params = dict(expected.named_parameters())
    for rank, (pieces, buffers) in enumerate(held_by_ranks):
        assert set(pieces) == set(params)
        for name, full in params.items():
            chunks = full.detach().chunk(len(held_by_ranks)) if sharded else [full.detach()] * len(held_by_ranks)
            want = chunks[rank] if rank < len(chunks) else full[:0]
            assert_within(pieces[name], want, 0.0, f"rank {rank}'s {name}")
        assert_same_weights(buffers, dict(expected.named_buffers()))


def test_rows_split_evenly_and_cover_the_batch():
    assert [row_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [row_range(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize("strategy,micro,aggregation", [("fsdp2", 1, "token_mean"), ("ddp", 2, "seq_mean")])
@pytest.mark.slow
@pytest.mark.equivalence
def test_two_ranks_take_the_one_rank_steps_save_and_resume(tmp_path, policy_dir, strategy, micro, aggregation):
    """First what each rank holds as it joined: under FSDP2 exactly its rows of the one-rank
    model (each rank read only those from the files: ``sharded_load.py``), under DDP the whole.
    Rank 0 gets 3 rows, rank 1 two; with micro-batches of 1, rank 1 runs a filler pass.
    The one-rank reference takes each batch whole: the steps must not depend on either
    split. Then checkpoints: saved by 2 ranks, loaded by ``from_pretrained`` with the
    learner's logits, and resumed by 2 ranks and by 1; saved by 1 rank (and in the format
    from before ``optimizer/``), resumed by 2. Each resume, one more step lands on the
    weights of the run that never stopped."""
    base = [f"algorithm.aggregation={aggregation}"]
    single = config(policy_dir, *base, "optim.micro_batch_size=64")
    worker, after_one, (expected_metrics,) = one_rank(single, batch(0))
    step_one = worker.steps
    worker.save_checkpoint(tmp_path / "one_rank", {"step": 1}, {})
    # and as checkpoints were before optimizer/: the optimizer's own state dict in trainer_state.pt
    legacy = worker.save_checkpoint(tmp_path / "legacy", {"step": 1}, {})
    shutil.rmtree(legacy / "optimizer")
    state = torch.load(legacy / "trainer_state.pt", weights_only=False)
    torch.save({**state, "optimizer": worker.learner.optimizer.state_dict()}, legacy / "trainer_state.pt")
    two_steps, after_two, _ = one_rank(single, batch(0), batch(1))
    steps = two_steps.steps  # the second step of a resume is the second of these, from weights within the first's bound

    async def scenario():
        learner = await started(config(policy_dir, *base, "learner.world_size=2", f"learner.strategy={strategy}",
                                       f"optim.micro_batch_size={micro}"))
        try:
            out = {"held": await learner.apply(held),
                   "metrics": await learner.train_step(batch(0), False), "one": await learner.publish(),
                   "path": await learner.save_checkpoint(tmp_path / "two_ranks", {"step": 1},
                                                         {"run_state.json": "{}"})}
            await learner.train_step(batch(1), False)
            out["two"] = await learner.publish()
            for source in ("two_ranks", "one_rank", "legacy"):
                assert await learner.load_checkpoint(tmp_path / source) == 1
                await learner.train_step(batch(1), False)
                out[f"resumed from {source}"] = await learner.publish()
            return out
        finally:
            await learner.shutdown()

    out = asyncio.run(scenario())
    assert_rank_holds_its_slices(out["held"], load_policy(single.model)[0], sharded=strategy == "fsdp2")
    assert_same_weights(out["one"], after_one, step_one)
    assert_same_metrics(out["metrics"], expected_metrics)
    assert out["metrics"]["actor/grad_norm"] > 0.1  # the clip was active
    assert_same_weights(out["two"], after_two, steps)
    assert_same_weights(out["resumed from two_ranks"], after_two, steps)
    assert_same_weights(out["resumed from one_rank"], after_two, steps)
    assert_same_weights(out["resumed from legacy"], after_two, steps)

    path = out["path"]
    assert not (tmp_path / "two_ranks.tmp").exists() and (path / "run_state.json").read_text() == "{}"
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    learner_model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    learner_model.load_state_dict(out["one"], strict=False)
    ids = batch(1).input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, learner_model(ids).logits)

    worker = joined(single)  # one rank resumes what two saved
    assert worker.load_checkpoint(path) == 1
    worker.train_step(batch(1), False)
    assert_same_weights(worker.publish(), after_two, steps)


class FailingRank(LearnerWorker):
    """Rank 1 raises in its step; rank 0 is then left waiting in a collective."""

    def train_step(self, batch, on_policy):
        if self.rank == 1:
            raise ValueError("rank one broke on purpose")
        return super().train_step(batch, on_policy)


def test_a_rank_that_raises_fails_fast_and_is_named_and_ctrl_c_is_the_drivers(policy_dir):
    async def scenario():
        learner = await started(config(policy_dir, "learner.world_size=2", "learner.timeout_s=120"),
                                worker_cls=FailingRank)
        try:
            for proc in learner.transport.procs:  # a Ctrl-C reaches the ranks too; only the driver acts on it
                os.kill(proc.pid, signal.SIGINT)
            assert set(await learner.publish()) == set(joined(config(policy_dir)).publish())
            start = time.perf_counter()
            with pytest.raises(LearnerRankError) as failure:
                await learner.train_step(batch(0), False)
            elapsed = time.perf_counter() - start
            with pytest.raises(LearnerRankError):  # the learner stays failed
                await learner.publish()
            return failure.value, elapsed, learner.transport.procs
        finally:
            await learner.shutdown()

    error, elapsed, procs = asyncio.run(scenario())
    assert error.rank == 1 and "learner rank 1 of 2 failed" in str(error)
    assert "rank one broke on purpose" in str(error) and "Traceback" in str(error)
    assert elapsed < 60  # generous for a loaded machine, and still half the process group's 120 s timeout
    assert not any(p.is_alive() for p in procs)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("runtime", ["local", "ray"])
@pytest.mark.slow
def test_train_with_two_learner_ranks(tmp_path, policy_dir, runtime):
    if runtime == "ray":
        ray = pytest.importorskip("ray")
    out = tmp_path / runtime
    extra = (["runtime=ray", "ray.num_cpus=2", "ray.num_rollout_workers=1", "ray.worker_cpus=0.5",
              "ray.learner_cpus=0.5"] if runtime == "ray" else [])
    code = main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "learner.world_size=2", "mode=async", "max_staleness=1", "total_steps=3", "batch_size=2",
                 "group_size=2", "eval_every=0", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "task.num_train=32", "task.num_validation=4", "algorithm.filter_zero_variance=false",
                 "optim.micro_batch_size=4", *extra])
    assert code == 0
    if runtime == "ray":
        assert not ray.is_initialized()
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["version"] for m in metrics] == [0, 1, 2, 3]
    assert all(m["staleness/max"] <= 1 for m in metrics[1:])
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 3 * 2 * 2
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 1
    final = out / "checkpoints" / "step_3"
    assert {f.name for f in (final / "optimizer").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # 2 ranks
    AutoModelForCausalLM.from_pretrained(final)


def test_bench_learner_shows_fsdp2_halving_the_state_per_rank(tmp_path, policy_dir, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "learner", f"model_path={policy_dir}", "hidden_size=0", "world_sizes=[1,2]",
                 "strategies=[fsdp2]", "repeats=1", "rows=3", "threads=1", "--out", str(out)]) == 0
    runs = json.loads((out / "bench.json").read_text())["models"][policy_dir.name]["runs"]
    assert [(r["world_size"], r["strategy"]) for r in runs] == [(1, None), (2, "fsdp2")]
    assert runs[1]["state_ratio_vs_1"] == pytest.approx(0.5, abs=0.02)  # counted from the local shards
    assert [len(r["memory"]) for r in runs] == [1, 2] and all(r["step_s"] > 0 for r in runs)
    assert "params+grads+optim MiB/rank" in capsys.readouterr().out


def test_bench_learner_times_lora_beside_full_fine_tuning_on_a_generated_llama(tmp_path, policy_dir, char_tokenizer):
    """A generated Llama (hidden 128, 2 layers, 4 heads of 32, 1 key/value head, MLP 384),
    LoRA r = 4 first, then full fine-tuning: LoRA's gradients are exactly its adapters', r x
    (in + out) a targeted layer; full fine-tuning's are every parameter's."""
    out = tmp_path / "bench"
    assert main(["bench", "learner", f"model_path={policy_dir}", "architecture=llama", "hidden_size=128",
                 "num_layers=2", "num_kv_heads=1", "lora_ranks=[4,0]", "world_sizes=[1]", "repeats=1", "rows=3",
                 "threads=1", "--out", str(out)]) == 0
    llama = json.loads((out / "bench.json").read_text())["models"]["llama-h128-l2"]
    per_layer = 2 * 128 * 128 + 2 * 128 * 32 + 3 * 128 * 384 + 2 * 128  # q, o; k, v; gate, up, down; 2 norms
    assert llama["params"] == len(char_tokenizer) * 128 + 2 * per_layer + 128  # tied embedding, final norm
    lora, full = llama["runs"]
    assert (lora["lora_rank"], full["lora_rank"]) == (4, 0)
    adapters = 2 * 4 * ((128 + 128) * 2 + (128 + 32) * 2 + (128 + 384) * 3)
    assert lora["memory"][0]["grads"] == 4 * adapters and full["memory"][0]["grads"] == 4 * llama["params"]
    assert lora["state_bytes_per_rank"] < full["state_bytes_per_rank"] / 3


def test_bench_learner_names_a_bad_lora_rank_or_head_count(policy_dir):
    from asyncrl.bench.learner import run_learner_bench
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match="lora_ranks"):
        run_learner_bench([f"model_path={policy_dir}", "hidden_size=0", "lora_ranks=[-1]"])
    with pytest.raises(ConfigError, match="num_kv_heads=3 must divide the 4 heads of hidden_size=128"):
        run_learner_bench([f"model_path={policy_dir}", "hidden_size=128", "num_kv_heads=3"])
