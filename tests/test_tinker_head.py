"""serve-tinker's memory bounded by the micro-batch: the logits a chunk at a time
(asyncrl/learner/head.py) — no logits tensor spans more than a chunk of positions, forward or
backward, none is kept for the backward, the gradient is taken only where the loss weighs a
position — and the decoder layers recomputed in the backward (``recompute_layers``: none of
their inner activations kept); the logprobs, loss and gradients equal those of the whole
forward's logits with every activation kept."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerances import assert_within, chain_terms, grad_atol, logprob_atol

pytest.importorskip("tinker")
pytest.importorskip("peft")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from asyncrl import heap  # noqa: E402
from asyncrl.learner import head as head_module  # noqa: E402
from asyncrl.tinker import training  # noqa: E402
from asyncrl.tinker.losses import gradient_positions  # noqa: E402
from asyncrl.tinker.training import TinkerLora, TrainingRun, layers_to_recompute  # noqa: E402
from asyncrl.tinker.wire import WireDatum  # noqa: E402

POLICY = Path(__file__).resolve().parents[1] / "models" / "addition-tiny"
ROWS = 3  # positions a chunk of logits holds here


@pytest.fixture(scope="module")
def untied():
    """The tiny policy's shape with its own LM head (untied), so the head has adapters too and
    their gradient goes through the chunks' recompute."""
    config = AutoConfig.from_pretrained(POLICY)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(POLICY)


def datum(tokens: list[int], advantages: list[float]) -> WireDatum:
    n = len(tokens) - 1
    return WireDatum(tokens[:-1], {"target_tokens": np.array(tokens[1:]), "logprobs": np.full(n, -5.0, np.float32),
                                   "advantages": np.array(advantages, np.float32)})


DATA = [datum([6, 7, 16, 8, 9, 22, 9, 11], [0, 0, 0, 1, 1, 1, 1]),  # a prompt (advantage 0), then a turn
        datum([6, 16, 7, 22, 13], [0, 0, -0.5, -0.5]),
        datum([7, 7, 16, 9, 22, 1, 6, 5, 30, 2], [0, 0, 0, 0, 2, 2, 0, 2, 2])]  # a 0 inside the turn too


def test_logits_in_chunks_where_the_loss_weighs_and_layers_recomputed_equal_the_whole_forward(untied, monkeypatch):
    model, tokenizer = untied
    vocab = model.config.vocab_size
    monkeypatch.setattr(head_module, "LOGITS_CHUNK_FLOATS", ROWS * vocab)
    chunked = TrainingRun("a", model, tokenizer, TinkerLora(4, seed=3), max_rank=8, recompute=True)
    whole = TrainingRun("b", model, tokenizer, TinkerLora(4, seed=3), max_rank=8, recompute=False)
    assert chunked.split and any("lm_head" in n for n, p in chunked.state.model.named_parameters() if p.requires_grad)
    whole.split = False  # the whole forward's logits: (B, T, V), and every layer's activations kept, as before
    for run in (chunked, whole):  # a first step, so the adapters' B is no longer 0 and every gradient flows
        run.forward_backward(DATA, "ppo", {}, forward_only=False)
        run.optim_step(1e-2, 0.9, 0.95, 1e-12, 0.0, 0.0)

    def traced(run: TrainingRun) -> tuple[list[int], list[tuple[int, ...]], list, dict[str, float]]:
        """The call, with the positions of every logits tensor the head makes (forward and the
        backward's recompute) and the shape of every tensor the graph keeps for the backward."""
        rows: list[int] = []
        kept: list[tuple[int, ...]] = []
        hook = run.state.model.get_output_embeddings().register_forward_hook(
            lambda module, args, out: rows.append(int(np.prod(out.shape[:-1]))))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
            out, metrics = run.forward_backward(DATA, "ppo", {"clip_high_threshold": 1.1}, forward_only=False)
        hook.remove()
        return rows, kept, out, metrics

    rows, kept, out_chunked, metrics_chunked = traced(chunked)
    rows_whole, kept_whole, out_whole, metrics_whole = traced(whole)

    positions = sum(len(d.tokens) for d in DATA)  # 7 + 4 + 9 = 20
    weighed = sum(int((d.inputs["advantages"] != 0).sum()) for d in DATA)  # 4 + 2 + 4 = 10
    assert max(rows) <= ROWS  # no logits beyond a chunk, forward or backward
    assert sum(rows) == positions + weighed  # each position once, and again in the backward where the loss weighs
    assert not [shape for shape in kept if shape and shape[-1] == vocab]  # no logits kept for the backward
    assert rows_whole == [3 * 9] and (3, 9, vocab) in kept_whole  # the whole forward: every row padded to 9, all kept
    mlp = model.config.intermediate_size  # the layers' widest activations: kept only where they are not recomputed
    assert not [shape for shape in kept if shape and shape[-1] == mlp] and (3, 9, mlp) in kept_whole
    assert metrics_chunked["loss:sum"] == pytest.approx(metrics_whole["loss:sum"], rel=1e-5)
    assert metrics_chunked["clip_fraction:mean"] == pytest.approx(metrics_whole["clip_fraction:mean"], abs=1e-6)
    n = chain_terms(model.config, positions)
    for i, (a, b) in enumerate(zip(out_chunked, out_whole, strict=True)):
        reference = torch.from_numpy(b["logprobs"])
        assert_within(torch.from_numpy(a["logprobs"]), reference, logprob_atol(reference, n), f"datum {i} logprobs")
    grads = [(name, p.grad) for name, p in chunked.state.model.named_parameters() if p.requires_grad]
    references = [p.grad for p in whole.state.model.parameters() if p.requires_grad]
    assert any("lm_head" in name and g.abs().max() > 0 for name, g in grads)  # the head's adapters trained
    for (name, got), expected in zip(grads, references, strict=True):
        assert_within(got, expected, grad_atol(expected, n), name)


def test_the_positions_with_a_gradient_are_where_the_losss_weight_is_not_zero():
    mask = torch.tensor([[True, True, True, False]])
    inputs = {"advantages": torch.tensor([[0.0, 1.0, -2.0, 0.0]]), "weights": torch.tensor([[1.0, 0.0, 0.5, 1.0]])}
    assert gradient_positions("ppo", inputs, mask).tolist() == [[False, True, True, False]]
    assert gradient_positions("cross_entropy", inputs, mask).tolist() == [[True, False, True, False]]
    assert gradient_positions("dro", inputs, mask).tolist() == [[True, True, True, False]]  # its pull weighs every one


def test_auto_recomputes_the_fewest_layers_that_keep_a_micro_batch_within_the_budget(untied):
    """``recompute_layers: auto``: a micro-batch of P padded positions keeps P·hidden·4 bytes
    (float32) × 18 a layer it does not recompute and × 1 a layer it does. The tiny policy: 2
    layers, hidden 64, so 256 bytes a position a hidden state; budget 10 · 256 · 19 = 48,640 B.
    Kept with k layers recomputed: P·256·(k + 18·(2 − k)) — P ≤ 5 keeps 9,216·P ≤ 46,080 with
    none; 6 ≤ P ≤ 10 keeps 4,864·P ≤ 48,640 with one; P = 11 needs both (53,504 with one)."""
    model, tokenizer = untied
    budget = 10 * 256 * 19
    assert [layers_to_recompute(p, layers=2, hidden=64, element_size=4, budget=budget)
            for p in (0, 1, 5, 6, 10, 11, 40)] == [0, 0, 0, 1, 1, 2, 2]
    # SmolLM2-135M (30 layers, hidden 576, float32) at the default 768 MiB: the bench's 8 × 127
    # positions recompute 12 layers (1,016 · 2,304 B · (12 + 18 · 18) = 787 MB); a 4096-token
    # micro-batch 27 (4,096 · 2,304 · (27 + 54) = 764 MB).
    smol = {"layers": 30, "hidden": 576, "element_size": 4, "budget": 768 << 20}
    assert [layers_to_recompute(p, **smol) for p in (600, 1016, 4096, 100_000)] == [0, 12, 27, 30]

    run = TrainingRun("auto", model, tokenizer, TinkerLora(4, seed=3), max_rank=8, micro_rows=1,
                      activation_budget=budget)
    calls: list[tuple[int, int]] = []  # (layer, positions) each time a layer runs forward, recompute included
    for i, layer in enumerate(run.layers):  # its first norm's hook: the layer's own hooks sit outside its checkpoint
        layer.input_layernorm.register_forward_pre_hook(
            lambda module, args, i=i: calls.append((i, int(np.prod(args[0].shape[:2])))))
    data = [datum(list(range(6, 6 + n + 1)), [1.0] * n) for n in (5, 8, 11)]  # one micro-batch each (micro_rows=1)
    run.forward_backward(data, "importance_sampling", {}, forward_only=False)
    runs = {(layer, p): calls.count((layer, p)) for layer, p in set(calls)}
    # a recomputed layer runs twice (forward, then again in the backward), a kept one once
    assert runs == {(0, 5): 1, (1, 5): 1, (0, 8): 2, (1, 8): 1, (0, 11): 2, (1, 11): 2}
    calls.clear()
    run.forward_backward(data, "importance_sampling", {}, forward_only=True)  # no backward: nothing recomputed
    assert sorted(calls) == sorted((layer, p) for p in (5, 8, 11) for layer in (0, 1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: elsewhere mapped_above is a no-op")
def test_a_large_micro_batch_maps_its_backward_too_and_a_small_one_runs_it_from_the_heap(untied, monkeypatch):
    """Every forward runs within a ``mapped_above`` span; the backward only where the
    micro-batch's hidden state (padded positions × hidden × 4 bytes, 256 a position here)
    reaches ``HEAP_BACKWARD_BELOW``, set to 8 positions' worth: a 5-position call's gradient
    is made outside every span, an 11-position call's within one (``asyncrl/heap.py``)."""
    model, tokenizer = untied
    monkeypatch.setattr(training, "HEAP_BACKWARD_BELOW", 8 * 256)
    run = TrainingRun("spans", model, tokenizer, TinkerLora(4, seed=3), max_rank=8, recompute=False)
    forward: list[int] = []
    backward: list[int] = []
    run.layers[0].input_layernorm.register_forward_pre_hook(lambda module, args: forward.append(len(heap._SPANS)))
    trained = next(p for p in run.state.model.parameters() if p.requires_grad)
    trained.register_hook(lambda grad: backward.append(len(heap._SPANS)))
    for n in (5, 11):
        run.forward_backward([datum(list(range(6, 6 + n + 1)), [1.0] * n)], "importance_sampling", {},
                             forward_only=False)
    assert forward == [1, 2]  # the forward's own span, within the backward's for the large call
    assert backward == [0, 1]
    assert heap._SPANS == []  # every span ended: glibc's threshold is back
