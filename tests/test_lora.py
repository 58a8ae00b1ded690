"""``model.lora``: LoRA adapters trained on a frozen base (``asyncrl/learner/lora.py``).

The equivalences: only the adapters train and the base stays bit-identical; the KL
reference is the base (adapters off); the engine, sent the merged weights, computes the
learner's logprobs; the checkpoint is a PEFT adapter directory that ``PeftModel`` loads to
the learner's logprobs, and a resumed learner takes the step the uninterrupted one takes;
``asyncrl train`` runs and resumes with ``model.lora.rank=4``."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from peft import PeftModel
from tolerances import assert_same_adam_step, assert_same_logprobs, chain_terms
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config
from asyncrl.engine import AdapterUpdate, FullWeights, TorchEngine
from asyncrl.learner import Learner, pack_batch
from asyncrl.learner.lora import linear_names, merged_targets, merged_weight, peft_reads_deprecated, save_merged
from asyncrl.types import SamplingParams, Trajectory
from asyncrl.weight_sync import fingerprint

POLICY = "models/countdown-tiny"
PROMPT = [5, 6, 7, 8, 9]
ENGINE_TOLERANCE = 1e-4
"""Engine (merged weights, x·(W + s·B·A)ᵀ) vs learner (adapter forward, x·Wᵀ + s·(x·Aᵀ)·Bᵀ)
logprobs, float32: the two sum in another order, so they agree to rounding, not bit for bit.
Where one sequence is compared, the bound is derived from it (``assert_same_logprobs``,
tests/tolerances.py); this figure is for the evaluations' logprobs of two whole runs."""


def base_model():
    return AutoModelForCausalLM.from_pretrained(POLICY).eval()


def make_learner(*overrides: str) -> Learner:
    cfg = load_config(None, [f"model.path={POLICY}", "model.lora.rank=4", "optim.lr=0.01", *overrides])
    return Learner(base_model(), AutoTokenizer.from_pretrained(POLICY), algorithm=cfg.algorithm, optim=cfg.optim,
                   total_steps=10, temperature=1.0, lora=cfg.model.lora, seed=cfg.seed)


def batch():
    trajectories = [Trajectory([5, 6, 7], [8 + i, 9, 10], [1, 1, 1], [-1.0, -1.2, -0.8], [0, 0, 0])
                    for i in range(4)]
    return pack_batch(trajectories, [1.0, -1.0, 0.5, -0.5], 0)


def logprobs_of(model, b) -> torch.Tensor:
    """(B, L-1) log π of each next token, a plain forward pass."""
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1) * b.loss_mask


def test_only_the_adapters_train_and_the_base_stays_bit_identical():
    learner = make_learner()
    trained = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    names = {name for name, p in learner.model.named_parameters() if id(p) in trained}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == sum(1 for n, _ in learner.model.named_parameters() if "lora_" in n)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    learner.train_step(batch())
    after = dict(learner.model.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in names if ".lora_B." in n)  # B starts at 0 and moves
    frozen = [n for n in before if n not in names]
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen)
    original = base_model().state_dict()  # and the frozen weights are the base's, bit for bit
    base = learner.module.get_base_model()
    for name, layer in base.named_modules():
        if hasattr(layer, "base_layer"):
            assert torch.equal(layer.base_layer.weight, original[f"{name}.weight"])


@pytest.mark.equivalence
def test_the_kl_reference_is_the_base_with_adapters_off():
    learner = make_learner("algorithm.kl_coef=0.1")
    assert learner.reference is None  # no second copy of the weights
    for _ in range(2):
        metrics = learner.train_step(batch())
    b = batch()
    reference = learner.reference_logprobs(b) * b.loss_mask
    # the same forward (shared prompts included) on the untouched base: bit for bit
    assert torch.equal(reference, learner.logprobs(base_model(), b) * b.loss_mask)
    assert_same_logprobs(logprobs_of(base_model(), b), reference, learner.model, b.input_ids.shape[1])  # a plain pass
    policy = learner.logprobs(learner.model, b) * b.loss_mask
    assert (policy - reference).abs().max() > 1e-3  # the adapters moved the policy away from it
    assert metrics["actor/kl_ref"] > 0


def test_merged_weights_are_peft_merge_and_only_the_targeted_layers():
    learner = make_learner("model.lora.sync=merged")
    learner.train_step(batch())
    sent = learner.export_weights()
    peft_merged = dict(copy.deepcopy(learner.module).merge_and_unload().named_parameters())
    assert set(sent) == {f"{n}.weight" for n, m in learner.module.get_base_model().named_modules()
                         if hasattr(m, "base_layer")}
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, peft_merged[name], atol=1e-6, rtol=1e-6)
    full = sum(p.numel() for p in base_model().parameters())
    assert sum(t.numel() for t in sent.values()) < full  # embeddings and norms never travel


def test_an_engine_that_reloads_whole_layers_is_sent_every_weight():
    """vLLM takes every weight or none (``send_every_weight``): the base's names exactly,
    the targeted layers merged, the rest the base's own."""
    learner = make_learner()
    learner.update_kind = "merged_every_weight"  # what export.update_kind picks for engine=vllm
    learner.train_step(batch())
    sent, base = learner.engine_weights(), dict(base_model().named_parameters())
    assert set(sent) == set(base)
    merged = merged_targets(learner.module)
    for name, tensor in sent.items():
        assert torch.equal(tensor, merged[name] if name in merged else base[name]), name


def test_adapters_alone_are_merged_by_the_engine_into_the_merged_weights_bit_for_bit():
    """``model.lora.sync=adapters``: the engine, sent A, B and the scale, holds at each sync
    exactly what a merged sync would have given it (each merge from its base, not from the
    previous merge), for fewer bytes; the in-process engine's start is the base."""
    learner = make_learner("model.lora.sync=adapters")
    assert fingerprint(learner.policy_copy().named_parameters()) == fingerprint(base_model().named_parameters())

    async def run():
        merged, alone = TorchEngine(base_model()), TorchEngine(base_model())
        try:
            for _ in range(2):
                learner.train_step(batch())
                payload = learner.export_weights()
                assert isinstance(payload, AdapterUpdate) and payload.layers
                sent = merged_targets(learner.module)
                assert payload.nbytes < FullWeights(sent).nbytes / 4
                await merged.update_weights(sent, learner.version)
                await alone.update_weights(payload, learner.version)
                assert alone.version == learner.version
                assert fingerprint(alone.model.named_parameters()) == fingerprint(merged.model.named_parameters())
        finally:
            await merged.shutdown()
            await alone.shutdown()

    asyncio.run(run())
    with pytest.raises(ConfigError, match="model.lora.sync=adapters needs the built-in engine"):
        load_config(None, ["model.lora.sync=adapters", "engine=vllm"])


@pytest.mark.slow
@pytest.mark.parametrize("process", ["false", "true"])
def test_a_resumed_engine_sent_adapters_alone_starts_on_the_checkpoints_policy(tmp_path, process):
    """Resumed with ``model.lora.sync=adapters``, the engine starts from the base with the
    checkpoint's adapters merged, whether it shares the learner's process (its base copy,
    then the adapters) or not (``model.path``, then the adapters): the delivery probe passes
    before any sync (and the run goes on, every sync checked)."""
    from asyncrl.policy import load_policy
    from asyncrl.runtime import start
    from asyncrl.weight_sync.delivery import DeliveryCheck

    out = tmp_path / "run"
    args = ["train", "examples/addition/async.yaml", f"output_dir={out}", "model.lora.rank=4", "batch_size=2",
            "group_size=4", "eval_every=0", "save_every=2", "task.num_validation=4", "optim.lr=0.01",
            "model.lora.sync=adapters", "weight_sync.check_every=1", f"learner.process={process}"]
    assert main([*args, "total_steps=2"]) == 0
    cfg = load_config(args[1], [a for a in args[2:]])

    async def probe():
        model, tokenizer = load_policy(cfg.model)
        async with start(cfg, model=model, tokenizer=tokenizer, checkpoint=out / "checkpoints" / "step_2",
                         version=2) as runtime:
            check = DeliveryCheck(runtime.learner, runtime.rollout, tokenizer, every=1, tolerance=ENGINE_TOLERANCE)
            return await check.check(2)

    assert asyncio.run(probe()) <= ENGINE_TOLERANCE
    assert main([*args, "total_steps=3", "resume=true"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_sync/probe_max_abs_diff"] <= ENGINE_TOLERANCE for r in rows if r["step"] > 0] == [True] * 3


def test_merged_weight_is_base_plus_scaled_b_a():
    base, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    torch.testing.assert_close(merged_weight(base, a, b, 0.5), base + 0.5 * b @ a)
    torch.testing.assert_close(merged_weight(base.T, a, b, 0.5, transposed=True), (base + 0.5 * b @ a).T)
    low = merged_weight(base.bfloat16(), a, b, 0.5)
    assert low.dtype == torch.bfloat16


@pytest.mark.equivalence
def test_the_engine_sent_the_merged_weights_gives_the_learners_logprobs():
    learner = make_learner("model.lora.sync=merged")
    for _ in range(3):
        learner.train_step(batch())

    async def run():
        engine = TorchEngine(base_model())  # what a rollout worker loads from model.path
        await engine.update_weights(learner.export_weights(), learner.version)
        completion = await engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=1))
        await engine.shutdown()
        return completion

    completion = asyncio.run(run())
    assert completion.versions == [learner.version] * len(completion.token_ids)
    trajectory = Trajectory(PROMPT, completion.token_ids, [1] * len(completion.token_ids), completion.logprobs,
                            completion.versions)
    b = pack_batch([trajectory], [0.0], 0)
    ours = learner.logprobs(learner.model, b)[0, len(PROMPT) - 1:]
    assert_same_logprobs(completion.logprobs, ours, learner.model, len(PROMPT) + len(completion.token_ids))
    before = logprobs_of(base_model(), b)[0, len(PROMPT) - 1:]
    assert (ours - before).abs().max() > 10 * ENGINE_TOLERANCE  # the bound is tighter than what training moved


@pytest.mark.equivalence
def test_the_checkpoint_is_a_peft_adapter_dir_and_a_resume_takes_the_same_step(tmp_path):
    learner = make_learner("algorithm.kl_coef=0.1")
    learner.train_step(batch())
    path = learner.save_checkpoint(tmp_path / "step_1")
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= {p.name for p in path.iterdir()}
    assert not (path / "model.safetensors").exists()  # the base is model.path's, not copied
    b = batch()
    ours = learner.logprobs(learner.model, b) * b.loss_mask
    with peft_reads_deprecated():  # peft's own read of a deprecated transformers property
        loaded = PeftModel.from_pretrained(base_model(), path).eval()
    assert torch.equal(learner.logprobs(loaded.get_base_model(), b) * b.loss_mask, ours)  # the same forward
    assert_same_logprobs(logprobs_of(loaded, b), ours, learner.model, b.input_ids.shape[1])  # peft's own forward
    merged = AutoModelForCausalLM.from_pretrained(save_merged(path, tmp_path / "merged", POLICY)).eval()
    assert_same_logprobs(logprobs_of(merged, b), ours, learner.model, b.input_ids.shape[1])

    resumed = make_learner("algorithm.kl_coef=0.1")
    resumed.load_checkpoint(path)
    assert resumed.version == learner.version == 1
    going_on, after_resume = learner.train_step(batch()), resumed.train_step(batch())
    assert going_on == after_resume  # same adapters, AdamW moments, schedule: the same step
    for (name, p), (_, q) in zip(learner.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name


def eval_samples(run) -> tuple[list[list[int]], torch.Tensor]:
    """``asyncrl eval``'s samples in order: each response's tokens, and every token's logprob."""
    trajectories = [t for line in (run / "eval_samples.jsonl").read_text().splitlines()
                    for t in json.loads(line)["trajectories"]]
    return [t["response_ids"] for t in trajectories], torch.tensor([lp for t in trajectories for lp in t["logprobs"]])


@pytest.mark.equivalence
def test_eval_on_a_lora_checkpoint_scores_base_plus_adapters(tmp_path, capsys):
    """``asyncrl eval model.path=<a LoRA checkpoint>``: the base its adapter_config.json
    names, with the adapters merged, scores exactly what the merged model directory does."""
    cfg = load_config("examples/addition/async.yaml", ["model.lora.rank=4", "optim.lr=0.05"])
    learner = Learner(AutoModelForCausalLM.from_pretrained(cfg.model.path),
                      AutoTokenizer.from_pretrained(cfg.model.path),
                      algorithm=cfg.algorithm, optim=cfg.optim, total_steps=10, temperature=1.0, lora=cfg.model.lora)
    for _ in range(3):
        learner.train_step(batch())
    checkpoint = learner.save_checkpoint(tmp_path / "step_3", {"step": 3})
    assert not (checkpoint / "config.json").exists()
    merged = save_merged(checkpoint, tmp_path / "merged")
    args = ["eval", "examples/addition/async.yaml", "eval.num_tasks=8", "eval.samples_per_task=2"]
    assert main([*args, f"model.path={checkpoint}", f"output_dir={tmp_path / 'adapters'}"]) == 0
    assert main([*args, f"model.path={merged}", f"output_dir={tmp_path / 'merged_eval'}"]) == 0
    assert main([*args, "model.path=models/addition-tiny", f"output_dir={tmp_path / 'base'}"]) == 0
    (tokens, adapters), (merged_tokens, merged_eval), (_, base) = (
        eval_samples(tmp_path / run) for run in ("adapters", "merged_eval", "base"))
    assert tokens == merged_tokens and tokens
    # their logprobs within the engine's rounding (each run batches its requests in its own way)
    torch.testing.assert_close(adapters, merged_eval, atol=ENGINE_TOLERANCE, rtol=0)
    assert base.shape != adapters.shape or (adapters - base).abs().max() > 10 * ENGINE_TOLERANCE  # adapters count
    assert main([*args, f"model.path={checkpoint}", "engine=vllm", f"output_dir={tmp_path / 'vllm'}"]) == 2
    assert "holds LoRA adapters, which engine=vllm does not load" in capsys.readouterr().err


def test_target_modules_that_match_nothing_name_the_ones_there_are(tmp_path, capsys):
    with pytest.raises(ConfigError) as err:
        make_learner("model.lora.target_modules=[qkv_proj]")
    message = str(err.value)
    assert "qkv_proj" in message and "q_proj" in message and "down_proj" in message
    assert "q_proj" in linear_names(base_model())
    assert main(["train", "examples/addition/async.yaml", "model.lora.target_modules=[qkv_proj]",
                 f"output_dir={tmp_path / 'run'}"]) == 2  # in pre-flight, before any work
    assert "target_modules ['qkv_proj'] match no linear layer" in capsys.readouterr().err


def test_a_sharded_lora_learner_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="model.lora trains on one learner rank.*learner.world_size=1"):
        load_config(None, ["model.lora.rank=4", "learner.world_size=2"])
    assert main(["train", "examples/addition/async.yaml", "model.lora.rank=4", "learner.world_size=2",
                 f"output_dir={tmp_path / 'run'}"]) == 2
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides", [["model.lora=true", "model.lora.alpha=8"],
                                       ["model.lora.alpha=8", "model.lora=true"],
                                       ["model.lora=null", "model.lora.alpha=8"]])
def test_the_switch_and_a_key_of_lora_combine_in_either_order(overrides, tmp_path):
    """``model.lora=true`` turns LoRA on keeping any key already set; a key of it turns it
    on too, after ``true`` or ``null`` (it was 'model.lora is not a section')."""
    assert load_config(None, overrides).model.lora.model_dump() == {
        "rank": 16, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear", "sync": "auto"}
    (tmp_path / "c.yaml").write_text("model:\n  lora: true\n")  # the file's switch, then an override's key
    assert load_config(tmp_path / "c.yaml", ["model.lora.rank=4"]).model.lora.rank == 4
    assert load_config(None, ["model.lora.rank=4", "model.lora=false"]).model.lora is None


def test_without_lora_the_learner_is_todays():
    cfg = load_config(None, [f"model.path={POLICY}"])
    assert cfg.model.lora is None
    learner = Learner(base_model(), AutoTokenizer.from_pretrained(POLICY), algorithm=cfg.algorithm, optim=cfg.optim,
                      total_steps=10, temperature=1.0)
    assert learner.lora is None and learner.module is learner.model
    assert set(learner.export_weights()) == {n for n, _ in learner.model.named_parameters()}


@pytest.mark.slow
def test_train_and_resume_with_lora(tmp_path):
    out = tmp_path / "run"
    args = ["train", "examples/addition/async.yaml", f"output_dir={out}", "model.lora.rank=4", "batch_size=2",
            "group_size=4", "eval_every=0", "save_every=2", "task.num_validation=4"]
    assert main([*args, "total_steps=2"]) == 0
    checkpoint = out / "checkpoints" / "step_2"
    assert (checkpoint / "adapter_config.json").is_file()
    assert json.loads((checkpoint / "adapter_config.json").read_text())["r"] == 4
    assert main([*args, "total_steps=3", "resume=true"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2, 3]  # (step 0: the evaluation before training)


@pytest.mark.equivalence
@pytest.mark.slow
def test_eta_0_is_sync_with_lora(tmp_path, policy_dir):
    """``mode=async max_staleness=0`` trains on ``mode=sync``'s samples with LoRA too: the same
    tokens, rewards and evaluations, the adapters within float noise
    (``tests/test_reproducible.py`` says why not bit for bit)."""
    from test_reproducible import WEIGHT_ATOL, run, same_run

    sync = run(tmp_path, policy_dir, "sync", "mode=sync", "partial_rollout=off", "model.lora.rank=4")
    async0 = run(tmp_path, policy_dir, "async0", "mode=async", "max_staleness=0", "model.lora.rank=4")
    adapters = sync[2]
    assert adapters and all("lora_" in name for name in adapters)
    assert max(float(t.abs().max()) for name, t in adapters.items() if "lora_B" in name) > 1e-3  # B left 0
    # every metric too: the rollout side's counters are read before the sync opens the gate to the next version
    assert same_run(sync, async0) <= WEIGHT_ATOL


@pytest.mark.parametrize("shipped", ["merged", "adapters"])
def test_a_collective_sync_sends_the_merged_layers(policy_dir, shipped):
    """``weight_sync=collective`` plans its buckets from and sends what ``object_store``
    does: the merged targeted layers, or with ``model.lora.sync=adapters`` the adapters the
    engines merge; either way the engines hold the merged layers, their other weights the base's."""
    from test_weight_sync import in_process, train_one_step

    async def scenario(cfg, learner_worker, sync, workers):
        train_one_step(learner_worker)
        await sync.sync(1, "abort")
        sent = merged_targets(learner_worker.learner.module)
        base = dict(AutoModelForCausalLM.from_pretrained(policy_dir).named_parameters())
        expected = fingerprint((name, sent.get(name, p)) for name, p in base.items())
        assert await sync.rollout.fingerprints() == [(1, expected)] * 2
        assert fingerprint(base.items()) != expected

    asyncio.run(in_process(policy_dir, scenario, "model.lora.rank=4", "weight_sync.bucket_mb=0.01",
                           f"model.lora.sync={shipped}"))


def adapter_grads(learner: Learner) -> dict[str, torch.Tensor]:
    """The adapters' gradients of the last step (kept until the next step zeroes them)."""
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.requires_grad}


@pytest.mark.equivalence
def test_micro_batches_and_a_streamed_step_train_the_adapters_as_one_batch():
    """The learner's invariants hold with adapters: any micro-batch size, or the batch given
    in parts (accumulate, finish_step), takes the step one whole batch takes. Compared on
    the gradients, and on the weights each within its own bound: AdamW's first step is
    about lr · sign(g), so a gradient near 0 turns float rounding into a visible difference
    of that weight (tests/tolerances.py)."""
    whole = make_learner("optim.micro_batch_size=8")
    whole.train_step(batch())
    micro = make_learner("optim.micro_batch_size=1")
    micro.train_step(batch())
    streamed = make_learner("optim.micro_batch_size=8")
    b = batch()
    streamed.accumulate(b.rows(0, 2))
    streamed.accumulate(b.rows(2, 4))
    streamed.finish_step()
    expected = adapter_grads(whole)
    assert any(g.abs().max() > 1e-3 for g in expected.values())
    n = chain_terms(whole.model.config, b.input_ids.numel())
    for other in (micro, streamed):
        assert other.version == whole.version == 1
        assert set(adapter_grads(other)) == set(expected)
        # the adapters' gradients within their rounding, their weights within what AdamW makes
        # of it, the frozen base untouched (tests/tolerances.py)
        assert_same_adam_step(other.model, whole.model, whole.optimizer.defaults["lr"], n)


def test_sample_reuse_moves_only_the_adapters():
    learner = make_learner("optim.ppo_epochs=2", "optim.mini_batches=2", "algorithm.kl_coef=0.1")
    frozen = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
    metrics = learner.train_step(batch())
    assert metrics["actor/optimizer_steps"] == 4.0 and learner.version == 1
    assert all(torch.equal(p, frozen[n]) for n, p in learner.model.named_parameters() if n in frozen)
