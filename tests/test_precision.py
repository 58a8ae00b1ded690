"""Precision: the learner under bf16 autocast keeps float32 master weights and scores within
a stated bound of float32; a bf16 engine holds rounded copies of the learner's weights; the
delivery check picks its tolerance from the dtypes (docs/results.md, "Precision")."""

from __future__ import annotations

import asyncio
import copy
import math
from types import SimpleNamespace

import pytest
import torch
from test_delivery import InProcess, train_one_step
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.bench.precision import mismatch, run_precision_bench
from asyncrl.config import ConfigError, load_config
from asyncrl.engine import TorchEngine
from asyncrl.learner import Learner, pack_batch
from asyncrl.learner.learner import autocast_dtype
from asyncrl.orchestrator.invariants import Limits
from asyncrl.types import Trajectory
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.weight_sync.delivery import (
    FLOAT32_TOLERANCE,
    ROUNDED_TOLERANCE,
    DeliveryCheck,
    check_tolerance,
    probe_prompts,
)

POLICY = "models/countdown-tiny"
AUTOCAST_MAX_ABS = 0.25
"""The stated bound on |Δ| between the learner's logprobs under bf16 autocast and in float32
on the tiny Countdown policy at temperature 1, for any response tokens (bf16 keeps 8 bits of
mantissa, ~0.4 % of a logit). Measured: 0.11 on :func:`countdown_batch`'s fixed answers,
0.061 on the policy's own samples (``asyncrl bench precision``)."""
AUTOCAST_MEAN_ABS = 0.05
"""... and on their mean |Δ| over the response tokens (measured 0.026 on the fixed answers,
which the policy finds less likely than its own samples: 0.0022 on those)."""


def learner(autocast: str | None, *, model=None, lr: float = 1e-3) -> Learner:
    cfg = load_config(None, [f"model.path={POLICY}", f"optim.lr={lr}"])
    return Learner(model if model is not None else AutoModelForCausalLM.from_pretrained(POLICY),
                   AutoTokenizer.from_pretrained(POLICY), algorithm=cfg.algorithm, optim=cfg.optim, total_steps=10,
                   temperature=1.0, autocast=autocast)


def countdown_batch():
    """Rows of the task's own text (prompt, then an answer-like response), so the logits are
    the trained policy's, not noise."""
    tokenizer = AutoTokenizer.from_pretrained(POLICY)
    texts = [("Numbers: 3 5 7. Target: 22.", " 3*5+7"), ("Numbers: 2 9 4. Target: 17.", " 2*4+9"),
             ("Numbers: 6 6 1. Target: 37.", " 6*6+1"), ("Numbers: 8 3 2. Target: 13.", " 8+3+2")]
    trajectories = []
    for prompt, response in texts:
        p, r = tokenizer(prompt).input_ids, tokenizer(response).input_ids
        trajectories.append(Trajectory(p, r, [1] * len(r), [-1.0] * len(r), [0] * len(r)))
    return pack_batch(trajectories, [1.0, -1.0, 0.5, -0.5], tokenizer.pad_token_id or 0)


def test_autocast_setting_resolves_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype(None, cpu) is None  # as before: the weights' own dtype on CPU ...
    assert autocast_dtype(None, cuda) is torch.bfloat16  # ... and bf16 on CUDA
    assert autocast_dtype("bfloat16", cpu) is torch.bfloat16
    assert autocast_dtype("off", cuda) is None
    with pytest.raises(ConfigError, match="learner.autocast='float16'"):
        autocast_dtype("float16", cpu)


def test_bf16_autocast_logprobs_are_within_the_stated_bound_of_float32():
    model = AutoModelForCausalLM.from_pretrained(POLICY)
    fp32, bf16 = learner("off", model=copy.deepcopy(model)), learner("bfloat16", model=model)
    batch = countdown_batch()
    exact, rounded = fp32.logprobs(fp32.model, batch), bf16.logprobs(bf16.model, batch)
    diff = (exact - rounded).abs()[batch.loss_mask.bool()]
    assert 0 < diff.max() <= AUTOCAST_MAX_ABS  # > 0: autocast did run in bf16 on the CPU
    assert diff.mean() <= AUTOCAST_MEAN_ABS
    assert rounded.dtype == torch.float32  # logits read back as float32 before the softmax


def test_bf16_autocast_keeps_float32_master_weights_and_optimizer_state():
    trained = learner("bfloat16")
    before = {n: p.detach().clone() for n, p in trained.model.named_parameters()}
    train_one_step(trained)
    assert {p.dtype for p in trained.model.parameters()} == {torch.float32}
    states = [s for s in trained.optimizer.state.values() if s]
    assert states and {s["exp_avg"].dtype for s in states} == {s["exp_avg_sq"].dtype for s in states} == {torch.float32}
    # an update below bf16's resolution of a weight still lands (it would round away in bf16 weights)
    hidden = sum(int(((p != before[n]) & (p.bfloat16() == before[n].bfloat16())).sum())
                 for n, p in trained.model.named_parameters())
    assert hidden > 0


def test_a_bf16_engine_rounds_what_it_is_sent():
    async def run():
        engine = TorchEngine(AutoModelForCausalLM.from_pretrained(POLICY), dtype="bfloat16")
        try:
            assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
            sent = {n: p.detach() + 1e-3 for n, p in AutoModelForCausalLM.from_pretrained(POLICY).named_parameters()}
            await engine.update_weights(sent, 1)
            held = dict(engine.model.named_parameters())
            assert all(torch.equal(held[n], t.to(torch.bfloat16)) for n, t in sent.items())
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_check_tolerance_is_picked_from_the_dtypes():
    assert check_tolerance(None, "float32", "float32") == FLOAT32_TOLERANCE == 1e-4
    assert check_tolerance(None, "float32", "bfloat16") == ROUNDED_TOLERANCE == 0.5
    assert check_tolerance(None, "bfloat16", "bfloat16") == ROUNDED_TOLERANCE
    assert check_tolerance(0.5, "float32", "float32") == 0.5  # set: as given
    cfg = load_config(None, ["rollout.dtype=bfloat16"])
    assert (cfg.engine_dtype, load_config(None, ["model.dtype=bfloat16"]).engine_dtype) == ("bfloat16", "bfloat16")
    check = DeliveryCheck.for_config(None, None, AutoTokenizer.from_pretrained(POLICY), cfg)
    assert check.tolerance == ROUNDED_TOLERANCE
    # asyncrl doctor reads the same tolerance from a run's config.yaml
    run = {"model": {"dtype": "float32"}, "rollout": {"dtype": "bfloat16"}, "weight_sync": {"check_tolerance": None}}
    assert Limits.from_config(run, None).check_tolerance == ROUNDED_TOLERANCE
    assert Limits.from_config({"model": {"dtype": "float32"}}, None).check_tolerance == FLOAT32_TOLERANCE


def test_lora_adapters_sync_refuses_an_engine_in_another_dtype():
    with pytest.raises(ConfigError, match="rollout.dtype=bfloat16 is not model.dtype=float32"):
        load_config(None, ["model.lora.sync=adapters", "rollout.dtype=bfloat16"])


def test_the_delivery_probe_of_a_bf16_engine_passes_the_picked_tolerance_not_float32s():
    """A delivered sync to a bf16 engine: over float32's bound (so the dtype must pick the
    tolerance), within the rounded one; weights not delivered still fail it."""
    async def run():
        trained = learner("off", lr=0.01)
        engine = TorchEngine(AutoModelForCausalLM.from_pretrained(POLICY), dtype="bfloat16")

        async def ready_engine():
            return engine

        try:
            check = DeliveryCheck(InProcess(rank_of(trained), False),
                                  InProcess(SimpleNamespace(ready_engine=ready_engine), True),
                                  AutoTokenizer.from_pretrained(POLICY), every=1,
                                  tolerance=check_tolerance(None, "float32", "bfloat16"))
            delivered = await check.check(0)
            for _ in range(3):
                train_one_step(trained)
            engine._version = trained.version  # the version arrives, the weights do not
            with pytest.raises(Exception, match="weights not delivered"):
                await check.check(trained.version)
            return delivered
        finally:
            await engine.shutdown()

    assert probe_prompts(AutoTokenizer.from_pretrained(POLICY))
    delivered = asyncio.run(run())
    assert FLOAT32_TOLERANCE < delivered <= ROUNDED_TOLERANCE


def test_mismatch_figures_by_hand():
    engine = torch.tensor([[-1.0, -2.0, -9.0]])
    learner = torch.tensor([[-1.1, -2.0, 0.0]])
    m = mismatch(engine, learner, torch.tensor([[1.0, 1.0, 0.0]]))  # the third token is masked
    w = math.exp(-0.1)  # π/μ of the first token; the second's is 1
    assert m["tokens"] == 2
    assert m["max_abs_diff"] == pytest.approx(0.1) and m["mean_abs_diff"] == pytest.approx(0.05)
    assert m["kl_k3"] == pytest.approx((w - 1 + 0.1) / 2)  # k3 = exp(d) - d - 1, d = π - μ
    assert (m["is_min"], m["is_max"], m["is_mean"]) == pytest.approx((w, 1.0, (w + 1) / 2))
    assert m["is_std"] == pytest.approx((1 - w) / math.sqrt(2))  # two values: |a - b| / sqrt(2), unbiased


def test_bench_precision_on_the_tiny_policy(capsys):
    """float32 on both sides agrees to float32's bound; any bf16 side does not, within the
    stated autocast bound; the table is printed."""
    result = run_precision_bench(["configs=[examples/countdown/async.yaml]", "repeats=1", "threads=1"])
    (r,) = result["results"]
    exact = r["mismatch"]["engine float32 / learner fp32"]
    assert exact["max_abs_diff"] <= FLOAT32_TOLERANCE and exact["probe_max_abs_diff"] <= FLOAT32_TOLERANCE
    for name in ("engine float32 / learner bf16-autocast", "engine bfloat16 / learner fp32"):
        assert FLOAT32_TOLERANCE < r["mismatch"][name]["max_abs_diff"] <= AUTOCAST_MAX_ABS
    assert r["engine"]["float32"]["tok_s"] > 0 and r["learner"]["bf16-autocast"]["step_s"] > 0
    assert "bf16/fp32" in capsys.readouterr().out


def test_on_policy_batches_skip_the_recompute_only_when_the_engine_computes_as_the_learner():
    """π_prox := μ for an on-policy batch only without weight noise, with the engine in the
    weights' dtype and the learner not under bf16 autocast; `learner.autocast=off` on the
    command line (YAML's false) is the `off` setting."""
    from asyncrl.config import load_config
    from asyncrl.orchestrator.trainer import engine_computes_as_learner

    def exact(*overrides: str) -> bool:
        return engine_computes_as_learner(load_config(None, ["model.device=cpu", *overrides]))

    assert load_config(None, ["learner.autocast=off"]).learner.autocast == "off"
    assert exact() and exact("learner.autocast=off")
    assert not exact("learner.autocast=bfloat16")
    assert not exact("rollout.dtype=bfloat16")
    assert not exact("rollout.engine_weight_noise=0.1", "weight_sync.check_every=0")


def rank_of(learner) -> LearnerWorker:
    """A learner rank around ``learner`` (what the delivery check asks of a rank)."""
    worker = LearnerWorker.__new__(LearnerWorker)
    worker.learner = learner
    return worker
