"""The training core every kind of training in the house takes its optimizer steps through:
RL's learner (``learner.py``), ``asyncrl sft`` (``asyncrl/sft/trainer.py``) and the tiny
warm-ups (``asyncrl/tiny/``). What differs between them is their data and their loss; what
they share is here, once: the one LR schedule (:func:`lr_lambda`), AdamW over the trainable
parameters (:func:`make_optimizer`: with LoRA, the adapters alone), the share-weighted
backward of micro-batches (:func:`accumulate`), and the step that clips, refuses a
non-finite loss or gradient norm before it touches the weights, and steps
(:func:`clip_and_step`). :class:`TrainState` is a trained model with its optimizer and
schedule in the shape the learner's atomic checkpoint I/O writes and reads
(``checkpoint_io.py``), so a supervised run saves and resumes as ``asyncrl train`` does.

The supervised label convention lives here too: :data:`IGNORE` (the label of a position
the loss skips) and :func:`collate` (rows padded on the right).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.algorithms.finite import NonFiniteError, first_nonfinite
from asyncrl.config import LoraConfig
from asyncrl.learner.distributed import Sharding
from asyncrl.learner.lora import add_adapters

IGNORE = -100
"""The label of a position the loss skips (``F.cross_entropy``'s ``ignore_index``)."""


class Schedule(Protocol):
    """The fields of an optimizer section the schedule and AdamW read (``optim`` of
    ``asyncrl train``, ``optim`` of ``asyncrl sft``)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int
    schedule: str


def lr_lambda(optim: Any, total_steps: int, *, floor: float = 0.1, decay_start: int | None = None
              ) -> Callable[[int], float]:
    """The LR factor of step ``step`` (for ``LambdaLR``): warm-up (step + 1) / warmup_steps,
    so the first step already trains; then 1 (``constant``), or a ``cosine`` or ``linear``
    decay to ``floor`` at ``total_steps``, held there after it. The decay runs from
    ``decay_start`` (default: the end of the warm-up; the tiny warm-ups count from step 0,
    ``floor`` 0, as the shipped tiny policies were built) to ``total_steps``.

    Not ``transformers.get_scheduler`` (checked against 5.23), which has none of the three
    exactly: its warm-ups are step / warmup_steps (the first batch trains at LR 0) except
    ``cosine_with_min_lr_schedule_with_warmup_lr_rate``, whose decay runs one step ahead;
    ``cosine_with_min_lr`` rises again past ``total_steps``; ``linear`` decays to 0, and
    the polynomial and WSD schedules that floor at 10 % warm up differently too."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        start = optim.warmup_steps if decay_start is None else decay_start
        progress = min(1.0, (step - start) / max(1, total_steps - start))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return factor


def make_optimizer(model: torch.nn.Module, optim: Schedule, total_steps: int, *, floor: float = 0.1,
                   decay_start: int | None = None) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``model``'s trainable parameters (with LoRA the adapters: the frozen base
    has no gradients and no optimizer state) and the one schedule over ``total_steps``."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    factor = lr_lambda(optim, total_steps, floor=floor, decay_start=decay_start)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def accumulate(parts: Iterable[Any], summed_loss: Callable[[Any], torch.Tensor], total: float) -> torch.Tensor:
    """Backward of each micro-batch's summed loss divided by the whole step's count
    ``total`` (tokens): any cut of the step into micro-batches accumulates the gradient of
    one forward over the whole step, up to float rounding. Returns the summed loss
    (detached, a device tensor: no sync here)."""
    loss_sum = torch.zeros(())
    for part in parts:
        loss = summed_loss(part)
        (loss / total).backward()
        loss_sum = loss_sum.to(loss.device) + loss.detach()
    return loss_sum


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                  losses: dict[str, torch.Tensor], *, step: int, hint: str, grad_norm_name: str = "grad_norm"
                  ) -> float:
    """Clip the accumulated gradients, check the ``losses`` (name → value) and the gradient
    norm for non-finite values, take the optimizer step. Returns the gradient norm (before
    clipping). A non-finite value raises ``NonFiniteError`` naming it, ``step`` and
    ``hint`` (what to check), before the step, so the weights stay the last good ones;
    sharded, the norm is global, so every rank stops together."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    full_norm = getattr(grad_norm, "full_tensor", None)  # sharded: a DTensor holding the global norm
    bad = first_nonfinite({**losses, grad_norm_name: full_norm() if full_norm is not None else grad_norm})
    if bad is not None:
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"non-finite {bad} at step {step}; the optimizer step was not taken. {hint}")
    optimizer.step()
    return Sharding.norm_value(grad_norm)


@dataclass
class TrainState:
    """A model in training with its optimizer and schedule, as ``checkpoint_io`` writes and
    reads it (its ``Checkpointed``): ``model`` runs the forward (with LoRA the Hugging Face
    model with the adapters injected), ``module`` saves (with LoRA the ``PeftModel``: its
    ``save_pretrained`` writes a PEFT adapter directory); ``version`` counts steps taken."""

    model: torch.nn.Module
    module: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    lora: LoraConfig | None = None
    version: int = 0
    sharding: Sharding | None = None
    is_main: bool = True

    @classmethod
    def build(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, optim: Schedule, total_steps: int, *,
              lora: LoraConfig | None = None, seed: int = 0) -> TrainState:
        """``model`` made trainable: with ``lora`` wrapped with fresh adapters (A drawn from
        ``seed``), and the optimizer and schedule over what trains."""
        module = add_adapters(model, lora, seed) if lora is not None else model
        forward = module.get_base_model() if lora is not None else model
        optimizer, scheduler = make_optimizer(forward, optim, total_steps)
        return cls(forward, module, tokenizer, optimizer, scheduler, lora)


@dataclass(frozen=True)
class Batch:
    """Supervised rows padded on the right to the longest. (B, T) each."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor  # the id where the model is trained to write it, IGNORE elsewhere


def collate(rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> Batch:
    """(ids, labels) rows, labels :data:`IGNORE` where nothing is trained, right-padded."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (row, lab) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        labels[i, :len(lab)] = torch.tensor(lab, dtype=torch.long)
        attention[i, :len(row)] = 1
    return Batch(ids, attention, labels)


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ -log p(label) over the labelled positions, each predicted from the one before it.
    logits (B, T, V), labels (B, T) -> a scalar, float32 whatever the logits' dtype."""
    predicted = logits[:, :-1].float()  # (B, T-1, V): position t predicts token t + 1
    target = labels[:, 1:]  # (B, T-1)
    return F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
