"""The training core's one micro-batch loop (``learner/core.py``, ``MicroBatchLoop``) on a
two-weight model, against gradients worked by hand: what it adds up, where it autocasts,
when it asks for cores, and what a sharded rank's passes are (a stand-in for the process
group: the loop asks a ``Sharding`` for four things only)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from asyncrl.learner.core import MicroBatchLoop

# w = [1, 2]; loss of a part = Σ (w·x)² / 3 over its rows: the three rows' w·x are 1, 2, 3,
# so the step's gradient is Σ 2(w·x)x / 3 = ([2, 0] + [0, 4] + [6, 6]) / 3
ROWS = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0], [1.0, 1.0]])]
GRADIENT = torch.tensor([[8.0, 10.0]]) / 3


def model() -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0]]))
    return layer


def share_of_step(layer: torch.nn.Linear):
    def loss(part: torch.Tensor) -> torch.Tensor:
        return (layer(part) ** 2).sum() / 3
    return loss


def test_the_parts_add_up_to_the_whole_steps_gradient():
    layer = model()
    MicroBatchLoop(layer).backward(ROWS, share_of_step(layer))
    torch.testing.assert_close(layer.weight.grad, GRADIENT, rtol=0, atol=1e-6)


def test_forward_and_loss_autocast_and_the_cores_are_taken_before_each_forward_and_backward():
    layer, seen, calls = model(), [], []

    class Budget:
        def working(self, side):
            calls.append(side)

    def loss(part):
        out = layer(part)
        seen.append(out.dtype)
        return (out.float() ** 2).sum()

    loop = MicroBatchLoop(layer, autocast=torch.bfloat16)
    loop.thread_budget = Budget()
    loop.backward(ROWS, loss)
    assert seen == [torch.bfloat16, torch.bfloat16]  # the matmul in bf16 ...
    assert layer.weight.grad.dtype == torch.float32  # ... the weights' gradient in theirs
    assert calls == ["learner"] * 4  # two per pass
    assert loop.forward(ROWS, lambda part: layer(part).dtype) == [torch.bfloat16] * 2


class TwoRanks:
    """Rank 0 of two whose peer has three passes; both wrappers average over ranks."""

    device = torch.device("cpu")
    loss_scale = 2.0

    def __init__(self):
        self.synced = []

    def count(self, n):
        return max(n, 3)

    @contextlib.contextmanager
    def grad_sync(self, model, enabled):
        self.synced.append(enabled)
        yield


def test_a_sharded_rank_fills_up_to_its_peers_passes_scales_the_loss_and_syncs_on_the_last():
    layer, sharding, filled = model(), TwoRanks(), []

    def filler():
        filled.append(True)
        return torch.zeros(1, 2)  # w·0 = 0: a pass that trains nothing

    loop = MicroBatchLoop(layer, sharding=sharding)
    loop.backward(ROWS, share_of_step(layer), filler)
    assert filled == [True] and sharding.synced == [False, False, True]
    # ×2 (the loss scale): the wrappers' average over two ranks then gives this rank's share
    torch.testing.assert_close(layer.weight.grad, 2 * GRADIENT, rtol=0, atol=1e-6)
    assert loop.forward(ROWS, lambda part: len(part), filler) == [1, 2]  # fillers' results are not returned
    with pytest.raises(ValueError, match="needs a filler"):
        loop.backward(ROWS, share_of_step(layer))
