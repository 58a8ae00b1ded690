"""The Tinker losses (asyncrl/tinker/losses.py) against hand-computed values, and the wire
(asyncrl/tinker/wire.py) against the SDK's own encoders and decoders: no server."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from asyncrl.tinker.losses import TINKER_LOSSES, LossInputError, tinker_loss  # noqa: E402
from asyncrl.tinker.wire import SampledRow, decode_forward_backward, forward_backward_proto, sample_proto  # noqa: E402

E = math.exp(0.5)


def _call(name, lp, config=None, **inputs):
    """The loss and d loss / d logprobs, on one row; the third position is padding."""
    logprobs = torch.tensor([lp + [123.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    tensors = {k: torch.tensor([v + [float("nan")]]) for k, v in inputs.items()}
    loss, metrics = TINKER_LOSSES[name](logprobs, tensors, mask, config or {})
    loss.backward()
    return float(loss.detach()), logprobs.grad[0].tolist(), metrics


def test_cross_entropy_is_the_weighted_sum_and_ignores_padding():
    loss, grad, _ = _call("cross_entropy", [-1.0, -2.0], weights=[1.0, 0.5])
    assert loss == pytest.approx(2.0)  # -(1·-1 + 0.5·-2)
    assert grad == pytest.approx([-1.0, -0.5, 0.0])


def test_importance_sampling_is_minus_sum_of_ratio_times_advantage():
    loss, grad, _ = _call("importance_sampling", [-1.0, -0.5], logprobs=[-1.0, -1.0], advantages=[2.0, -1.0])
    assert loss == pytest.approx(-(2.0 - E), rel=1e-6)  # r = (1, e^0.5)
    assert grad == pytest.approx([-2.0, E, 0.0], rel=1e-6)  # d(-rA)/dlp = -rA


def test_ppo_clips_the_ratio_at_its_thresholds():
    loss, grad, metrics = _call("ppo", [-1.0, -0.5], logprobs=[-1.0, -1.0], advantages=[2.0, 1.0])
    assert loss == pytest.approx(-(2.0 + 1.2))  # token 2: r = e^0.5 > 1.2 with A > 0: clipped, no gradient
    assert grad == pytest.approx([-2.0, 0.0, 0.0])
    assert metrics["clip_fraction:mean"] == pytest.approx(0.5)
    wider, _, _ = _call("ppo", [-1.0, -0.5], {"clip_high_threshold": 2.0}, logprobs=[-1.0, -1.0],
                        advantages=[2.0, 1.0])
    assert wider == pytest.approx(-(2.0 + E), rel=1e-6)


def test_cispo_weights_log_probabilities_by_the_clipped_detached_ratio():
    loss, grad, _ = _call("cispo", [-1.0, -0.5], logprobs=[-1.0, -1.0], advantages=[2.0, 1.0])
    assert loss == pytest.approx(2.6)  # -(1·2·-1 + 1.2·1·-0.5)
    assert grad == pytest.approx([-2.0, -1.2, 0.0])


def test_dro_pulls_towards_the_sampler_quadratically():
    loss, grad, _ = _call("dro", [-1.0, -0.5], {"beta": 0.5}, logprobs=[-1.0, -1.0], advantages=[2.0, 1.0])
    assert loss == pytest.approx(2.5625)  # -((-2 - 0) + (-0.5 - 0.25·0.25))
    assert grad == pytest.approx([-2.0, -1.0 + 0.25, 0.0])  # -(A - β(lp - μ))


def test_a_missing_input_or_an_unserved_loss_is_named():
    with pytest.raises(LossInputError, match="advantages"):
        _call("ppo", [-1.0, -0.5], logprobs=[-1.0, -1.0])
    with pytest.raises(LossInputError, match="beta"):
        _call("dro", [-1.0, -0.5], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])
    with pytest.raises(LossInputError, match="stable_reinforce.*not implemented.*cross_entropy.*gspo"):
        tinker_loss("stable_reinforce")
    with pytest.raises(LossInputError, match=r"'gspo' needs loss_fn_config \['clip_high_threshold'\]"):
        _call("gspo", [-1.0, -0.5], {"clip_low_threshold": 0.8}, logprobs=[-1.0, -1.0], advantages=[1.0, 1.0],
              sequence_ratio_mask=[1.0, 1.0])


def _tinker_gspo(lp, sampled, advantages, in_ratio, low, high):
    """Tinker's published implementation of ``gspo``, line for line, on one datum."""
    target = torch.tensor(lp, requires_grad=True)
    ref, adv, ratio_mask = torch.tensor(sampled), torch.tensor(advantages), torch.tensor(in_ratio)
    log_ratio = (target.detach() - ref)[ratio_mask != 0].mean()
    ratio = torch.exp(log_ratio + target - target.detach())
    clipped = torch.clamp(ratio, low, high)
    loss = -torch.min(ratio * adv, clipped * adv).sum()
    loss.backward()
    return float(loss.detach()), target.grad.tolist()


@pytest.mark.parametrize(("low", "high"), [(0.8, 1.2), (0.9997, 1.0004)])
def test_gspo_is_tinkers_published_formula(low, high):
    """The sequence ratio over the marked tokens only (the first is a prompt-side token the
    mask leaves out, with an advantage all the same), one value for every position, each
    position's own gradient; with GSPO's narrow band the whole sequence clips."""
    lp, sampled, advantages, in_ratio = [-2.0, -1.0, -0.5], [-1.0, -1.2, -0.6], [0.5, 2.0, 2.0], [0.0, 1.0, 1.0]
    logprobs = torch.tensor([lp + [9.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True, False]])
    pad = float("nan")
    inputs = {"logprobs": torch.tensor([sampled + [pad]]), "advantages": torch.tensor([advantages + [pad]]),
              "sequence_ratio_mask": torch.tensor([in_ratio + [pad]])}
    loss, metrics = TINKER_LOSSES["gspo"](logprobs, inputs, mask, {"clip_low_threshold": low,
                                                                   "clip_high_threshold": high})
    loss.backward()
    want_loss, want_grad = _tinker_gspo(lp, sampled, advantages, in_ratio, low, high)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-6)
    assert logprobs.grad[0].tolist() == pytest.approx(want_grad + [0.0], rel=1e-6)
    s = math.exp(0.15)  # mean of (-1 + 1.2, -0.5 + 0.6): the unmarked first token does not count
    assert float(loss.detach()) == pytest.approx(-min(s, high) * 4.5, rel=1e-6)
    assert float(metrics["clip_fraction:mean"]) == (1.0 if high < s else 0.0)


def test_the_sdks_forward_backward_body_decodes():
    weights = torch.tensor([[0.0, 0.0, 1.5], [0.0, 0.0, 0.0]])  # 2-D: the SDK sends it sparse (CSR)
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "advantages": [0.5, -1.0, 2.0],
                                        "weights": weights})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.9}),
        model_id="sess:train:0", seq_id=3)
    call = decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.loss_fn_config) == ("sess:train:0", 3, "ppo",
                                                                               {"clip_low_threshold": 0.9})
    (got,) = call.data
    assert got.tokens == [5, 6, 7]
    assert got.inputs["target_tokens"].tolist() == [6, 7, 8]
    assert got.inputs["advantages"].tolist() == [0.5, -1.0, 2.0]
    np.testing.assert_array_equal(got.inputs["weights"], weights.numpy())


def test_outputs_encode_as_the_sdk_decodes_them():
    outputs = [{"logprobs": np.array([-1.0, -2.0], dtype=np.float32)}, {"logprobs": np.array([-3.0], dtype=np.float32)}]
    decoded = deserialize_forward_backward_output(forward_backward_proto(outputs, {"loss:sum": 6.0}))
    assert decoded.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    rows = [SampledRow([4, 5], [-0.25, -0.5], True), SampledRow([6], [-1.0], False)]
    sample = deserialize_sample_response(sample_proto(rows, [float("nan"), -2.0]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([4, 5], [-0.25, -0.5], "stop"), ([6], [-1.0], "length")]
    assert sample.prompt_logprobs == [None, -2.0]
