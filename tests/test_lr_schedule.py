"""The learning-rate schedule, batch by batch, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import OptimConfig
from asyncrl.learner.learner import lr_lambda

# warmup_steps=2, total_steps=6: warm-up (step + 1)/2 for steps 0, 1; then progress p = (step − 2)/4,
# capped at 1, and factor 0.1 + 0.9 · decay(p)
COS = [0.5 * (1 + math.cos(math.pi * p)) for p in (0.25, 0.5, 0.75)]  # 0.853553, 0.5, 0.146447
EXPECTED = {
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "cosine": [0.5, 1.0, 1.0, 0.1 + 0.9 * COS[0], 0.55, 0.1 + 0.9 * COS[2], 0.1, 0.1],  # 0.868198, …, 0.231802
    "linear": [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1],  # 0.1 + 0.9 · (1 − p)
}


@pytest.mark.parametrize("schedule", sorted(EXPECTED))
def test_lr_per_batch_by_hand(schedule):
    lr = 2e-3
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(OptimConfig(lr=lr, warmup_steps=2, schedule=schedule), total_steps=6))
    seen = []
    for _ in EXPECTED[schedule]:  # the LR batch i trains with; the learner steps the scheduler once per batch
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr * f for f in EXPECTED[schedule]], rel=1e-12)


def test_no_warmup_starts_at_full_lr_and_warmup_as_long_as_the_run_divides_by_nothing():
    assert lr_lambda(OptimConfig(schedule="cosine"), total_steps=4)(0) == 1.0
    factor = lr_lambda(OptimConfig(schedule="linear", warmup_steps=1), total_steps=1)
    assert [factor(0), factor(1), factor(2)] == pytest.approx([1.0, 1.0, 0.1])  # progress 0/max(1, 0), then 1


def test_the_tiny_warm_ups_schedule_is_the_same_function_decaying_from_step_0_to_0():
    """The tiny warm-ups (``asyncrl/tiny/sft.py``) take the one schedule with ``decay_start=0``
    and ``floor=0``: warm-up (step + 1)/2, then cosine over p = step/6 from step 0 to 0,
    as the shipped tiny policies were built (their own loop had it)."""
    from asyncrl.learner.core import make_optimizer

    factor = lr_lambda(OptimConfig(warmup_steps=2, schedule="cosine"), total_steps=6, floor=0.0, decay_start=0)
    cos = [0.5 * (1 + math.cos(math.pi * step / 6)) for step in (2, 3, 4, 5)]  # 0.75, 0.5, 0.25, 0.066987
    assert [factor(s) for s in range(8)] == pytest.approx([0.5, 1.0, *cos, 0.0, 0.0], rel=1e-12)
    frozen, trained = torch.nn.Parameter(torch.zeros(2), requires_grad=False), torch.nn.Parameter(torch.zeros(3))
    model = torch.nn.Module()
    model.frozen, model.trained = frozen, trained
    optimizer, scheduler = make_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=2), total_steps=6)
    assert optimizer.param_groups[0]["params"] == [trained]  # only what trains (LoRA: the adapters)
    assert scheduler.get_last_lr() == pytest.approx([0.5e-2])
