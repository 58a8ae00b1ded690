"""The equivalence tests' bounds (tests/tolerances.py): the formulas against hand-computed
values, the failure message, and a real bug (a part skipped, a group's share weighted
twice) failing both the gradient bound and, on its own, the weight bound."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_model, reference_logprobs
from test_streaming_learner import groups, learners, packed, streamed_step
from tolerances import (
    F32_EPS,
    adam_step_atol,
    assert_same_adam_step,
    assert_same_logprobs,
    assert_within,
    chain_terms,
    gamma,
    grad_atol,
    logprob_atol,
)

from asyncrl.learner import pack_batch


def test_the_formulas_by_hand():
    assert F32_EPS == 2.0 ** -23
    assert gamma(1000) == pytest.approx(1000 * 2.0 ** -23 / (1 - 1000 * 2.0 ** -23))
    with pytest.raises(ValueError, match="n·ε ≥ 1"):
        gamma(2 ** 23)
    config = SimpleNamespace(hidden_size=64, intermediate_size=128, vocab_size=100, num_hidden_layers=2)
    assert chain_terms(config, tokens=40) == 40 + 11 * 128
    assert chain_terms(config, tokens=300) == 300 + 11 * 300  # attention over a longer sequence is the widest
    assert grad_atol(torch.tensor([0.5, -2.0]), 1000) == pytest.approx(2 * gamma(1000) * 2.0)
    torch.testing.assert_close(logprob_atol(torch.tensor([0.0, -3.0]), 10),
                               2 * gamma(10) * torch.tensor([1.0, 4.0], dtype=torch.float64))
    # a clear gradient: 2δ/|g|·lr; a gradient at the rounding level or 0: 2·lr (×1.001) whatever δ
    g, w = torch.tensor([1e-3, 1e-9, 0.0]), torch.zeros(3)
    torch.testing.assert_close(adam_step_atol(1e-2, [(g, 1e-8)], w),
                               torch.tensor([1e-2 * 2e-8 / 1e-3, 2.002e-2, 2.002e-2], dtype=torch.float64))
    # an earlier step's rounding adds its share; the weight's own ulp comes on top
    torch.testing.assert_close(adam_step_atol(1.0, [(g[:1], 1e-8), (g[:1], 1e-8)], torch.tensor([4.0])),
                               torch.tensor([4e-5 + 4 * F32_EPS], dtype=torch.float64))


def test_a_broken_bound_names_the_gap_the_bound_and_where():
    assert_within(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-7]), 1e-6, "w")
    with pytest.raises(AssertionError, match=r"w: \|Δ\| 0.1 > bound 0.01 at \(1, 0\) .*1 of 4 elements over"):
        assert_within(torch.tensor([[1.0, 2.0], [3.1, 4.0]]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0.01, "w")
    with pytest.raises(AssertionError, match="bound 0 at"):  # a per-element bound, a NaN on one side
        assert_within(torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]), "nan")


def step_with(char_tokenizer, bug):
    """The batched step and a streamed one with ``bug`` done to its parts; both learners'
    models after the step."""
    batched, streamed = learners(char_tokenizer)
    parts = groups(0)
    batched.train_step(packed(parts))
    if bug == "a part skipped":
        streamed_step(streamed, parts[:1] + parts[2:])
    else:  # the third group's share counted twice: its rows' advantages doubled
        (ts, advs), *rest = parts[::-1]
        for trajectories, advantages in [*rest[::-1], (ts, [2 * a for a in advs])]:
            streamed.accumulate(pack_batch(trajectories, advantages, pad_id=0))
        streamed.finish_step()
    return batched, streamed, parts


@pytest.mark.parametrize("bug", ["a part skipped", "a share weighted twice"])
def test_a_real_bug_fails_the_gradient_bound_and_the_weight_bound_alone(char_tokenizer, bug):
    batched, streamed, parts = step_with(char_tokenizer, bug)
    n = chain_terms(batched.model.config, packed(parts).input_ids.numel())
    lr = batched.optimizer.defaults["lr"]
    with pytest.raises(AssertionError, match=r"\.grad \(2·γ_n"):
        assert_same_adam_step(streamed.model, batched.model, lr, n)
    # without the gradients to compare (a whole run's weights), the weights alone still tell
    broken = 0
    for (name, x), (_, y) in zip(streamed.model.named_parameters(), batched.model.named_parameters(), strict=True):
        try:
            assert_within(x, y, adam_step_atol(lr, [(y.grad, grad_atol(y.grad, n))], y), name)
        except AssertionError:
            broken += 1
    tensors = len(list(batched.model.parameters()))
    assert broken > tensors // 2, f"{bug}: only {broken} of {tensors} weight tensors outside their bound"


@pytest.mark.parametrize("lr", [1e-3, 1e-4])
def test_the_logprob_bound_tells_a_version_one_small_step_apart(lr):
    """Logprobs of the weights one AdamW-sized step away (every weight moved by ±lr, what a
    sync that did not land leaves) fail the engine–learner bound; the same weights pass."""
    model, prompt, tokens = make_model(), [5, 6, 7, 8], list(range(10, 40))
    reference = reference_logprobs(model, prompt, tokens)
    assert_same_logprobs(reference_logprobs(make_model(), prompt, tokens), reference, model, len(prompt + tokens))
    moved = make_model()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(lr * torch.sign(torch.randn(p.shape, generator=g)))
    with pytest.raises(AssertionError, match=r"logprobs \(2·γ_n"):
        assert_same_logprobs(reference_logprobs(moved, prompt, tokens), reference, model, len(prompt + tokens))
