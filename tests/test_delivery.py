"""Weights delivered, checked (``asyncrl/weight_sync/delivery.py``): after a sync each engine's
logprobs on a fixed probe equal the learner's within ``weight_sync.check_tolerance``, with
full fine-tuning and with LoRA; a delivery dropped on purpose (the engine takes the new
version but not its weights) stops the run with exit 1 naming the version and the max |Δ|;
``weight_sync/bytes`` is what one engine is sent, less with LoRA."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.engine import TorchEngine
from asyncrl.learner import Learner, pack_batch
from asyncrl.types import Trajectory
from asyncrl.runtime.learner_worker import LearnerWorker
from asyncrl.weight_sync.delivery import DeliveryCheck, WeightsNotDelivered, engine_weight_bytes, probe_prompts

POLICY = "models/addition-tiny"
TOLERANCE = 1e-4
"""``weight_sync.check_tolerance``'s default: the engine/learner bound in float32."""


def make_learner(*overrides: str) -> Learner:
    cfg = load_config(None, [f"model.path={POLICY}", "optim.lr=0.01", *overrides])
    return Learner(AutoModelForCausalLM.from_pretrained(POLICY), AutoTokenizer.from_pretrained(POLICY),
                   algorithm=cfg.algorithm, optim=cfg.optim, total_steps=10, temperature=1.0, lora=cfg.model.lora,
                   seed=cfg.seed)


def train_one_step(learner: Learner) -> None:
    trajectories = [Trajectory([5, 6, 7], [8 + i, 9, 10], [1, 1, 1], [-1.0, -1.2, -0.8], [0, 0, 0]) for i in range(4)]
    learner.train_step(pack_batch(trajectories, [1.0, -1.0, 0.5, -0.5], 0))


class InProcess:
    """A handle's ``apply`` on one worker in this process (the learner's or the rollout's)."""

    def __init__(self, worker: SimpleNamespace, rollout: bool) -> None:
        self.worker, self.rollout = worker, rollout

    async def apply(self, fn, *args):
        result = fn(self.worker, 0, *args) if self.rollout else fn(self.worker, *args)
        return [await result if asyncio.iscoroutine(result) else result]


async def sync_and_check(learner: Learner, *, deliver: bool, every: int = 1) -> dict[str, float]:
    """One step, a sync to an engine started from ``model.path`` (delivered or not: the version
    only), then the check."""
    engine = TorchEngine(AutoModelForCausalLM.from_pretrained(POLICY))

    async def ready_engine():
        return engine

    try:
        check = DeliveryCheck(InProcess(worker_of(learner), False),
                              InProcess(SimpleNamespace(ready_engine=ready_engine), True),
                              AutoTokenizer.from_pretrained(POLICY), every=every, tolerance=TOLERANCE)
        first = await check.after_sync(0)  # version 0: both hold model.path
        train_one_step(learner)
        if deliver:
            await engine.update_weights(learner.export_weights(), learner.version)
        else:
            engine._version = learner.version  # the version arrives, the weights do not
        return {"first": first, **await check.after_sync(learner.version)}
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("lora", [[], ["model.lora.rank=4"]], ids=["full", "lora"])
def test_a_delivered_sync_passes_and_a_dropped_one_is_named(lora):
    metrics = asyncio.run(sync_and_check(make_learner(*lora), deliver=True))
    assert 0 <= metrics["weight_sync/probe_max_abs_diff"] <= TOLERANCE
    assert metrics["first"]["weight_sync/probe_max_abs_diff"] <= TOLERANCE
    with pytest.raises(WeightsNotDelivered) as err:
        asyncio.run(sync_and_check(make_learner(*lora), deliver=False))
    message = str(err.value)
    assert "weight sync of version 1" in message and "max |Δ|" in message and "check_tolerance=0.0001" in message
    diff = float(message.split("differ from the learner's by up to ")[1].split(" ")[0])
    assert diff > 10 * TOLERANCE  # one step moves the probe well past the bound


def test_the_check_runs_every_n_syncs_the_first_included():
    metrics = asyncio.run(sync_and_check(make_learner(), deliver=False, every=2))  # the 2nd sync is not checked
    assert "weight_sync/probe_max_abs_diff" in metrics["first"] and "weight_sync/probe_max_abs_diff" not in metrics
    assert metrics["weight_sync/bytes"] == metrics["first"]["weight_sync/bytes"] > 0
    off = asyncio.run(sync_and_check(make_learner(), deliver=False, every=0))
    assert "weight_sync/probe_max_abs_diff" not in off["first"] and off["weight_sync/bytes"] > 0


def worker_of(learner) -> LearnerWorker:
    """A learner rank around ``learner`` (only what ``engine_weight_bytes`` asks of it)."""
    worker = LearnerWorker.__new__(LearnerWorker)
    worker.learner = learner
    return worker


def test_bytes_per_sync_with_lora_are_the_merged_targeted_layers_only():
    full = engine_weight_bytes(worker_of(make_learner()))
    model = AutoModelForCausalLM.from_pretrained(POLICY)
    assert full == sum(p.numel() * 4 for p in model.parameters())  # float32, every parameter
    lora = engine_weight_bytes(worker_of(make_learner("model.lora.rank=4", "model.lora.sync=merged")))
    targeted = sum(m.weight.numel() * 4 for name, m in model.named_modules()
                   if type(m).__name__ == "Linear" and not name.endswith("lm_head"))
    assert lora == targeted < full
    # the default with the built-in engine: the adapters alone, r × (in + out) a layer
    adapters = engine_weight_bytes(worker_of(make_learner("model.lora.rank=4")))
    assert adapters == sum(4 * 4 * sum(m.weight.shape) for name, m in model.named_modules()
                           if type(m).__name__ == "Linear" and not name.endswith("lm_head")) < targeted


def test_the_probe_is_the_runs_tokenizer_on_fixed_texts():
    prompts = probe_prompts(AutoTokenizer.from_pretrained(POLICY))
    assert len(prompts) == 4 and all(0 < len(p) <= 16 for p in prompts)
    assert prompts == probe_prompts(AutoTokenizer.from_pretrained(POLICY))


@pytest.mark.slow
def test_train_stops_with_exit_1_when_a_delivery_is_dropped(tmp_path, monkeypatch, capsys):
    """``asyncrl train`` (the local runtime's engine in this process): the second sync's
    weights never reach the engine, which still reports the version."""
    loads = []
    update = TorchEngine.update_weights

    async def drop_the_second(self, weights, version):
        loads.append(version)
        if len(loads) == 2:
            self._version = version
            return
        await update(self, weights, version)

    monkeypatch.setattr(TorchEngine, "update_weights", drop_the_second)
    args = ["train", "examples/addition/async.yaml", f"output_dir={tmp_path / 'run'}", "batch_size=2",
            "group_size=4", "eval_every=0", "task.num_validation=4", "total_steps=4", "optim.lr=0.01",
            "weight_sync.check_every=1"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"weight sync of version {loads[1]}" in err and "max |Δ|" in err and "Traceback" not in err
    # the failed step's row was written before the stop, so the run's own files name it
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    failed = rows[-1]
    assert failed["step"] == loads[1] and failed["weight_sync/probe_max_abs_diff"] > TOLERANCE, failed
    assert all(r["weight_sync/probe_max_abs_diff"] <= TOLERANCE for r in rows[1:-1])
    assert main(["doctor", str(tmp_path / "run")]) == 2
    said = [line for line in capsys.readouterr().out.splitlines() if "weights delivered" in line]
    assert said and said[0].startswith("FAIL") and f"step {loads[1]}" in said[0], said


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["model.lora.rank=4"]], ids=["full", "lora"])
def test_a_healthy_train_run_passes_the_check_and_reports_the_bytes(tmp_path, lora):
    out = tmp_path / "run"
    assert main(["train", "examples/addition/async.yaml", f"output_dir={out}", "batch_size=2", "group_size=4",
                 "eval_every=0", "task.num_validation=4", "total_steps=2", "weight_sync.check_every=1", *lora]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["weight_sync/probe_max_abs_diff"] <= TOLERANCE for r in rows)
    assert len({r["weight_sync/bytes"] for r in rows}) == 1
