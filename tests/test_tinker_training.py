"""One Tinker training client (asyncrl/tinker/training.py) without a server: a call cut into
micro-batches adds the gradient of the whole call, clients share the base's tensors, and a
datum that cannot be trained is refused naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tolerances import assert_within, chain_terms, grad_atol

pytest.importorskip("tinker")
pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from asyncrl.tinker.futures import UserError  # noqa: E402
from asyncrl.tinker.training import TinkerLora, TrainingRun  # noqa: E402
from asyncrl.tinker.wire import WireDatum  # noqa: E402

POLICY = Path(__file__).resolve().parents[1] / "models" / "addition-tiny"


@pytest.fixture(scope="module")
def base():
    model = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(POLICY)


def rl_datum(tokens: list[int], advantage: float) -> WireDatum:
    n = len(tokens) - 1
    return WireDatum(tokens[:-1], {"target_tokens": np.array(tokens[1:]), "logprobs": np.full(n, -2.0, np.float32),
                                   "advantages": np.full(n, advantage, np.float32)})


def grads(run: TrainingRun) -> list[torch.Tensor]:
    return [p.grad.clone() for p in run.state.model.parameters() if p.requires_grad]


def test_micro_batches_add_up_to_the_whole_calls_gradient(base):
    model, tokenizer = base
    data = [rl_datum([6, 7, 16, 8, 9, 22, 9, 11], 1.0), rl_datum([6, 16, 7, 22, 13], -0.5),
            rl_datum([7, 7, 16, 9, 22, 1, 6], 2.0)]
    whole = TrainingRun("a", model, tokenizer, TinkerLora(4, seed=3), max_rank=8)
    parts = TrainingRun("b", model, tokenizer, TinkerLora(4, seed=3), max_rank=8, micro_rows=1)
    for run in (whole, parts):  # a first step, so the adapters' B is no longer 0 and every gradient flows
        run.forward_backward(data, "ppo", {}, forward_only=False)
        run.optim_step(1e-2, 0.9, 0.95, 1e-12, 0.0, 0.0)
    out_whole, metrics_whole = whole.forward_backward(data, "ppo", {"clip_high_threshold": 1.1}, forward_only=False)
    out_parts, metrics_parts = parts.forward_backward(data, "ppo", {"clip_high_threshold": 1.1}, forward_only=False)
    assert metrics_parts["loss:sum"] == pytest.approx(metrics_whole["loss:sum"], rel=1e-5)
    assert metrics_parts["clip_fraction:mean"] == pytest.approx(metrics_whole["clip_fraction:mean"], abs=1e-6)
    for a, b in zip(out_whole, out_parts):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    # the same sums in another order: within the derived float32 bound (tests/tolerances.py, item 1),
    # not a fixed 1e-6, which one element broke by rounding alone on some runs (4.2e-6 of a gradient ~0.03)
    n = chain_terms(model.config, sum(len(d.tokens) for d in data))
    for i, (a, b) in enumerate(zip(grads(whole), grads(parts), strict=True)):
        assert_within(b, a, grad_atol(a, n), f"adapter gradient {i}")


def test_clients_share_the_base_tensors_and_leave_the_base_untouched(base):
    model, tokenizer = base
    before = {name: p.clone() for name, p in model.named_parameters()}
    run = TrainingRun("c", model, tokenizer, TinkerLora(4), max_rank=8)
    shared = {id(p) for p in model.parameters()}
    assert sum(id(p) in shared for p in run.state.model.parameters()) == len(shared)  # no copy of the base
    run.forward_backward([rl_datum([6, 7, 16, 8, 9, 22, 9, 11], 1.0)], "importance_sampling", {}, forward_only=False)
    run.optim_step(1e-2, 0.9, 0.95, 1e-12, 0.0, 0.0)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_token_outside_the_vocabulary_or_a_datum_past_the_context_is_refused(base):
    model, tokenizer = base
    run = TrainingRun("d", model, tokenizer, TinkerLora(4), max_rank=8)
    with pytest.raises(UserError, match=r"data\[0\] has token 99999, outside this model's vocabulary"):
        run.forward_backward([rl_datum([6, 99999, 7], 1.0)], "importance_sampling", {}, forward_only=True)
    with pytest.raises(UserError, match=r"data\[0\] has 40 input tokens; this model takes 1 to 32"):
        run.forward_backward([rl_datum([6] * 41, 1.0)], "importance_sampling", {}, forward_only=True)


def test_a_call_whose_every_advantage_is_0_trains_nothing_and_does_not_fail(base):
    """tinker-cookbook keeps groups whose rewards are all equal (their advantages all 0): a
    multi-turn recipe's first batch on a weak model is all such groups. The loss has no
    gradient anywhere, so the call must answer a zero loss, the logprobs, and a step that
    moves no weight (it failed with "does not require grad" on the server's backward)."""
    model, tokenizer = base
    run = TrainingRun("z", model, tokenizer, TinkerLora(4, seed=1), max_rank=8, micro_rows=1)
    data = [rl_datum([6, 7, 16, 8, 9, 22, 9, 11], 1.0), rl_datum([6, 16, 7, 22, 13], 0.0)]
    run.forward_backward(data, "importance_sampling", {}, forward_only=False)  # a first step: B no longer 0
    run.optim_step(1e-2, 0.9, 0.95, 1e-12, 0.0, 0.0)
    before = [p.clone() for p in run.state.model.parameters() if p.requires_grad]
    zero = [rl_datum([6, 7, 16, 8, 9], 0.0), rl_datum([7, 22, 13], 0.0)]
    outputs, metrics = run.forward_backward(zero, "importance_sampling", {}, forward_only=False)
    scored, _ = run.forward_backward(zero, "importance_sampling", {}, forward_only=True)
    assert metrics["loss:sum"] == 0.0
    for got, want in zip(outputs, scored, strict=True):  # the logprobs still answered, as a forward's
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-6)
    # the step is Adam's on a zero gradient: its moments from step 1 still move the weights, as on
    # a run whose step-2 advantages are 1e-30 (a gradient lost in float32 rounding beside the moments)
    twin = TrainingRun("t", model, tokenizer, TinkerLora(4, seed=1), max_rank=8, micro_rows=1)
    twin.forward_backward(data, "importance_sampling", {}, forward_only=False)
    twin.optim_step(1e-2, 0.9, 0.95, 1e-12, 0.0, 0.0)
    twin.forward_backward([rl_datum([6, 7, 16, 8, 9], 1e-30), rl_datum([7, 22, 13], 1e-30)], "importance_sampling", {},
                          forward_only=False)
    for run_ in (run, twin):
        run_.optim_step(1e-2, 0.9, 0.95, 1e-12, 0.0, 0.0)
    after = [p for p in run.state.model.parameters() if p.requires_grad]
    expected = [p for p in twin.state.model.parameters() if p.requires_grad]
    assert sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True)) > 0
    for a, b in zip(after, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
