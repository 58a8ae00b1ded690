"""``learner.share_prompts``: each distinct prompt of a micro-batch runs through the model
once and the responses run on its keys and values — the same logprobs, entropies and
gradients as running every row whole, up to float rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import assert_same_adam_step, assert_within, chain_terms, grad_atol, logprob_atol

from asyncrl.config import AlgorithmConfig, OptimConfig
from asyncrl.learner import Learner, pack_batch
from asyncrl.learner.shared_prompts import prompt_index
from asyncrl.tiny import build_char_tokenizer, build_tiny_model
from asyncrl.types import Trajectory


def _batch(tokenizer, prompts: list[str], responses: list[list[str]]):
    """Groups of responses to prompts of different lengths; the second turn of a response
    (after ``|``) is a tool's, mask 0, as in a multi-turn episode; μ made up."""
    trajectories, advantages = [], []
    for g, (prompt, group) in enumerate(zip(prompts, responses)):
        prompt_ids = tokenizer.encode(prompt)
        for i, text in enumerate(group):
            model_part, _, tool_part = text.partition("|")
            ids = tokenizer.encode(model_part) + tokenizer.encode(tool_part)
            mask = [1] * len(tokenizer.encode(model_part)) + [0] * len(tokenizer.encode(tool_part))
            trajectories.append(Trajectory(prompt_ids, ids, mask, [-1.5 - 0.1 * i] * len(ids), [0] * len(ids)))
            advantages.append((-1) ** (g + i) * (0.3 + 0.1 * i))
    return pack_batch(trajectories, advantages, tokenizer.pad_token_id)


PROMPTS = ["Use 3 5 7 to make 15 with + - * /, one line: =", "Use 12 4 to make 3, one line please: ="]
RESPONSES = [["3+5+7", "7+5+3 ok", "15", "5*3|(tool says 15)done"], ["12/4", "4*3 no", "3"]]


def _learner(model, tokenizer, share: bool) -> Learner:
    return Learner(model, tokenizer, algorithm=AlgorithmConfig(), optim=OptimConfig(lr=1e-2), total_steps=10,
                   temperature=0.7, share_prompts=share)


@pytest.mark.equivalence
def test_shared_prompts_give_the_logprobs_entropies_and_gradients_of_whole_rows():
    model, tokenizer = build_tiny_model(build_char_tokenizer(), seed=3)
    model.train()
    batch = _batch(tokenizer, PROMPTS, RESPONSES)
    distinct, index = prompt_index(batch)
    assert [len(p) for p in distinct] == [len(tokenizer.encode(p)) for p in PROMPTS]
    assert index.tolist() == [0, 0, 0, 0, 1, 1, 1]

    results = []
    for share in (False, True):
        m = copy.deepcopy(model)
        learner = _learner(m, tokenizer, share)
        logprobs, entropy = learner.token_logprobs(m, batch, with_entropy=True)
        (logprobs * batch.loss_mask * torch.linspace(0.5, 1.5, batch.size)[:, None]).sum().backward()
        results.append((logprobs, entropy, [p.grad.clone() for p in m.parameters()]))
    (whole_lp, whole_ent, whole_grads), (shared_lp, shared_ent, shared_grads) = results
    on = batch.loss_mask.bool()
    assert on.sum() > 20 and not torch.equal(on, batch.attention_mask[:, 1:].bool())  # prompts and tools are off
    n = chain_terms(model.config, batch.input_ids.numel())  # the bounds: tests/tolerances.py
    assert_within(shared_lp[on], whole_lp[on], logprob_atol(whole_lp[on], n), "logprobs")
    # an entropy, -Σ p·log p, is bounded as a logprob is
    assert_within(shared_ent[on], whole_ent[on], logprob_atol(whole_ent[on], n), "entropies")
    prompt_columns = torch.arange(on.shape[1])[None] < (batch.prompt_lengths - 1)[:, None]
    assert not shared_lp[prompt_columns].any()  # nothing predicted for the prompt: 0 where the mask is 0
    for (name, _), shared_grad, whole_grad in zip(model.named_parameters(), shared_grads, whole_grads, strict=True):
        assert_within(shared_grad, whole_grad, grad_atol(whole_grad, n), f"{name}.grad")
    assert any(g.abs().sum() > 0 for g in shared_grads)


@pytest.mark.equivalence
def test_a_training_step_with_shared_prompts_is_the_step_of_whole_rows():
    model, tokenizer = build_tiny_model(build_char_tokenizer(), seed=4)
    batch = _batch(tokenizer, PROMPTS, RESPONSES)
    learners = [_learner(copy.deepcopy(model), tokenizer, share) for share in (False, True)]
    metrics = [learner.train_step(batch) for learner in learners]
    for key in ("actor/loss", "actor/entropy", "actor/grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-7), key
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    whole, shared = (torch.cat([p.detach().flatten() for p in lr.model.parameters()]) - start for lr in learners)
    assert whole.norm() > 0.1
    assert (shared - whole).norm() / whole.norm() < 1e-3
    # and weight by weight: AdamW moves a weight by ~lr whatever its gradient's size, so the
    # bound is per weight, from its gradient and that gradient's rounding (tests/tolerances.py)
    n = chain_terms(model.config, batch.input_ids.numel())
    assert_same_adam_step(learners[1].model, learners[0].model, 1e-2, n)


def test_rows_that_share_no_prompt_or_too_little_of_one_run_whole():
    tokenizer = build_char_tokenizer()
    assert prompt_index(_batch(tokenizer, PROMPTS, [["15"], ["3"]])) is None
    empty = _batch(tokenizer, PROMPTS[:1], [["", "15"]])
    assert prompt_index(empty) is None  # a row with no response: nothing of it to predict
    long_answers = _batch(tokenizer, ["1 2 ="], [["1+2 is three, since one and two make three", "3"]])
    assert prompt_index(long_answers) is None  # a shared 5-token prompt saves too little for a second pass
    assert prompt_index(_batch(tokenizer, PROMPTS, RESPONSES)) is not None
