"""The one training engine (:class:`TrainEngine`): every optimizer step in the house is taken
through it — RL's learner (``learner.py``), ``asyncrl sft`` (``asyncrl/sft/trainer.py``), the
tiny warm-ups (``asyncrl/tiny/``) and serve-tinker's training clients
(``asyncrl/tinker/training.py``). What differs between them is their data and their loss,
passed in; what they share is here, once: the one LR schedule (:func:`lr_lambda`), AdamW
over the trainable parameters (:func:`make_optimizer`: with LoRA, the adapters alone), the
policy made trainable (:func:`trainable`: LoRA adapters put on, or the sharded wrap), the
micro-batch cut (:func:`micro_batch_bounds`), the micro-batch loop (:class:`MicroBatchLoop`:
sharding's passes, autocast and the core budget live there only), and the step that clips,
refuses a non-finite loss or gradient norm before it touches the weights, and steps
(:func:`clip_and_step`). A :class:`TrainEngine` is also what the atomic checkpoint I/O
writes and reads (``checkpoint_io.py``), so a supervised run saves and resumes as
``asyncrl train`` does.

The supervised label convention lives here too: :data:`IGNORE` (the label of a position
the loss skips), :func:`collate` (rows padded on the right) and :func:`summed_loss`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.algorithms.finite import NonFiniteError, first_nonfinite
from asyncrl.config import ConfigError, LoraConfig
from asyncrl.core_budget import ThreadBudget
from asyncrl.learner.distributed import Sharding
from asyncrl.learner.lora import add_adapters
from asyncrl.seeding import derive_seed

IGNORE = -100
"""The label of a position the loss skips (``F.cross_entropy``'s ``ignore_index``)."""

P = TypeVar("P")  # a micro-batch, whatever the caller's loss reads
R = TypeVar("R")


class Schedule(Protocol):
    """The fields of an optimizer section the schedule and AdamW read (``optim`` of
    ``asyncrl train``, ``optim`` of ``asyncrl sft``)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int

    @property
    def schedule(self) -> str: ...  # read-only, so that a config's Literal of names is one


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
    betas = cast("tuple[float, float]", tuple(optim.betas))  # a pair (Schedule.betas), as a tuple whatever holds it
    optimizer = torch.optim.AdamW(trained, lr=optim.lr, betas=betas, weight_decay=optim.weight_decay)
    factor = lr_lambda(optim, total_steps, floor=floor, decay_start=decay_start)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def autocast_dtype(setting: str | None, device: torch.device) -> torch.dtype | None:
    """The dtype the passes autocast to (``learner.autocast``), or None for none. ``None``
    keeps what the learner always did: bf16 on CUDA, the weights' dtype on CPU. Only bf16:
    float16 would need loss scaling, which no loop here does."""
    if setting not in (None, "off", "bfloat16"):
        raise ConfigError(f"learner.autocast={setting!r}: use bfloat16, off, or null")
    if setting == "off" or (setting is None and device.type != "cuda"):
        return None
    return torch.bfloat16


def trainable(model: PreTrainedModel, *, lora: LoraConfig | None, seed: int, sharding: Sharding | None = None
              ) -> tuple[torch.nn.Module, PreTrainedModel]:
    """``model`` made trainable, the one place it is: ``(forward, module)``. With ``lora``,
    ``module`` is the ``PeftModel`` (its ``save_pretrained`` writes the adapters,
    ``disable_adapter`` gives the base back; A drawn from the run's ``seed`` alone) and
    ``forward`` the Hugging Face model with the adapters injected into its layers (the
    PeftModel's forward hides the KV-cache argument ``learner.share_prompts`` passes); only
    the adapters require gradients. Without, ``forward`` is ``model`` as this rank trains
    it (FSDP2/DDP with a ``sharding``) and ``module`` the Hugging Face model under it.
    ``model`` is changed in place either way. LoRA trains on one rank only."""
    if lora is not None:
        if sharding is not None:
            raise ConfigError("model.lora trains on one learner rank: set learner.world_size=1 (the adapters are "
                              "small; a sharded LoRA learner is not built yet)")
        module = add_adapters(model, lora, derive_seed(seed, "lora"))
        return module.get_base_model(), cast(PreTrainedModel, module)  # a PeftModel stands in for the model
    forward = sharding.wrap(model) if sharding is not None else model
    return forward, cast(PreTrainedModel, Sharding.unwrap(forward))  # model, unwrapped


class MicroBatchLoop:
    """The one micro-batch loop: forward and backward of each micro-batch of a step with
    the loss passed in (RL's objective, SFT's cross-entropy), as verl's
    ``train_batch(data, loss_function)`` and slime's one ``loss_function``. What every
    kind of training would otherwise repeat lives here only:

    - **sharding**: every rank makes as many passes as the rank with the most micro-batches
      (FSDP gathers parameters in each forward and reduce-scatters in each backward, DDP
      reduces in the last), the extra ones the caller's ``filler`` with nothing to train;
      DDP's gradients are reduced only on the last; the loss is multiplied by
      :attr:`Sharding.loss_scale`, as both wrappers average over ranks;
    - **autocast** (``learner.autocast``): each pass's forward and loss under
      ``torch.autocast`` to ``autocast``, the backward outside it; a loss reads its logits
      back as float32 first, so its own math (no matmul in any built-in loss) is float32;
    - **the core budget** (``rollout.thread_sharing``): ``thread_budget``, re-read before
      each pass's forward and before its backward, so a step takes every core while the
      engine is idle.

    The caller's ``loss_function(part)`` returns the micro-batch's loss already weighted by
    its share of the whole step (over all ranks): then any cut of the step into
    micro-batches, and over any number of ranks, accumulates the gradient of one forward
    over the whole step, up to float rounding. The optimizer step is the caller's
    (:func:`clip_and_step`): between steps the caller may pass a step in several calls."""

    def __init__(self, model: torch.nn.Module, *, sharding: Sharding | None = None,
                 autocast: torch.dtype | None = None) -> None:
        self.model = model  # as trained (wrapped when sharded): DDP's no_sync is asked of it
        self.sharding = sharding
        self.autocast = autocast
        self.thread_budget: ThreadBudget | None = None  # the cores shared with an engine, when they are

    def passes(self, count: int) -> int:
        """How many passes a call of ``count`` micro-batches makes here: the most over ranks
        (a collective when sharded)."""
        return self.sharding.count(count) if self.sharding is not None else count

    def backward(self, parts: Sequence[P], loss_function: Callable[[P], torch.Tensor],
                 filler: Callable[[], P] | None = None) -> None:
        """Forward and backward of each of ``parts`` (this rank's micro-batches), adding the
        gradient of ``loss_function(part)`` (the part's share-weighted loss) to the
        parameters'. Sharded, ``filler()`` makes the zero-weight parts of the passes this
        rank makes beyond its own."""
        every = self._padded(parts, filler)
        for i, part in enumerate(every):
            self._take_cores()
            with self.autocasting():
                loss = loss_function(part)
            self._take_cores()
            if self.sharding is None:
                loss.backward()
            else:
                with self.sharding.grad_sync(self.model, enabled=i == len(every) - 1):
                    (loss * self.sharding.loss_scale).backward()

    @torch.no_grad()
    def forward(self, parts: Sequence[P], fn: Callable[[P], R], filler: Callable[[], P] | None = None) -> list[R]:
        """``fn(part)`` of each of ``parts`` without gradients (a π_prox or reference
        recompute, a held-out loss), under the same autocast, core budget and passes as
        :meth:`backward`; the results of ``parts`` alone, in order."""
        results = []
        for part in self._padded(parts, filler):
            self._take_cores()
            with self.autocasting():
                results.append(fn(part))
        return results[:len(parts)]

    @contextlib.contextmanager
    def autocasting(self) -> Iterator[None]:
        """Under ``torch.autocast`` to :attr:`autocast` (nothing when it is None)."""
        device = self.sharding.device if self.sharding is not None else next(self.model.parameters()).device
        with torch.autocast(device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            yield

    def _padded(self, parts: Sequence[P], filler: Callable[[], P] | None) -> list[P]:
        extra = self.passes(len(parts)) - len(parts)
        if not extra:
            return [*parts]
        if filler is None:
            raise ValueError("a sharded micro-batch loop needs a filler for the passes beyond this rank's own")
        return [*parts, *(filler() for _ in range(extra))]

    def _take_cores(self) -> None:
        """A boundary where the step may change its torch threads (``thread_budget``)."""
        if self.thread_budget is not None:
            self.thread_budget.working("learner")


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


def micro_batch_bounds(lengths: list[int], *, max_rows: int, max_tokens: int | None) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch over rows of these ``lengths``, in order: at most
    ``max_rows`` rows and ``max_tokens`` padded positions (rows × their longest length;
    a row longer than that alone). Contiguous and unsorted, so a micro-batch's rows of any
    whole-batch tensor are a slice and the split never changes which rows train together
    in a mini-batch: only how many pass through the model at once."""
    bounds: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, length in enumerate(lengths):
        rows, widest = i - start + 1, max(longest, length)
        if rows > max_rows or (max_tokens is not None and rows > 1 and rows * widest > max_tokens):
            bounds.append((start, i))
            start, widest = i, length
        longest = widest
    if lengths:
        bounds.append((start, len(lengths)))
    return bounds


def mini_batch_rows(size: int, *, epochs: int, mini_batches: int, seed: int) -> list[torch.Tensor]:
    """The rows (sorted indices into a batch of ``size``) of each optimizer step: ``epochs``
    passes, each a fresh seeded permutation cut into ``mini_batches`` parts whose sizes
    differ by at most one; empty parts (fewer rows than parts) are left out. One part is
    the whole batch in order, unshuffled: the plain step. A pure function of its arguments,
    so every rank of a sharded learner cuts the batch the same way without talking."""
    if mini_batches == 1:
        return [torch.arange(size)] * epochs
    steps = []
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
        order = torch.randperm(size, generator=generator)
        steps += [part.sort().values for part in order.tensor_split(mini_batches) if len(part)]
    return steps


@dataclass
class TrainEngine:
    """The one training engine: every optimizer step in the house — RL's learner, ``asyncrl
    sft``, the tiny warm-ups, serve-tinker's clients — is taken through one of these. The
    shape is AReaL's ``TrainEngine`` and verl's ``train_batch(data, loss_fn)``, and Tinker's
    ``forward_backward`` / ``optim_step`` pair: callers hand it data and a loss, nothing else.

    - :meth:`accumulate` — forward and backward of micro-batches with the loss passed in,
      gradients added to those since the last step (the first call after a step starts
      from zero: the engine alone zeroes gradients);
    - :meth:`step` — clip, refuse a non-finite loss or gradient norm before the weights
      move, the optimizer step;
    - :meth:`advance` — the LR schedule and the version, once per version (RL takes several
      optimizer steps per version with sample reuse; a Tinker client sets its own LR);
    - :meth:`forward` — scoring without a gradient, under the same passes.

    Micro-batching's passes, autocast, the core budget and sharding are its
    :class:`MicroBatchLoop`'s. It is also what ``checkpoint_io`` writes and reads (its
    ``Checkpointed``): ``model`` runs the forward (with LoRA the Hugging Face model with the
    adapters injected; sharded, the FSDP2/DDP wrap), ``module`` saves (with LoRA the
    ``PeftModel``); ``version`` counts :meth:`advance` calls."""

    model: torch.nn.Module
    module: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    lora: LoraConfig | None = None
    version: int = 0
    sharding: Sharding | None = None
    is_main: bool = True
    grad_clip: float = math.inf
    autocast: torch.dtype | None = None
    loop: MicroBatchLoop = field(init=False)
    _accumulating: bool = field(init=False, default=False)  # gradients added since the last step

    def __post_init__(self) -> None:
        self.loop = MicroBatchLoop(self.model, sharding=self.sharding, autocast=self.autocast)

    @classmethod
    def build(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, optim: Schedule, total_steps: int, *,
              lora: LoraConfig | None = None, seed: int = 0, sharding: Sharding | None = None,
              autocast: str | None = None, grad_clip: float | None = None, version: int = 0,
              floor: float = 0.1, decay_start: int | None = None) -> TrainEngine:
        """``model`` made trainable (:func:`trainable`: with ``lora`` fresh adapters drawn
        from the run's ``seed``, sharded with a ``sharding``), AdamW and the one schedule over
        what trains (:func:`make_optimizer`), the passes autocast as ``autocast``
        (``learner.autocast``, :func:`autocast_dtype`), gradients clipped to ``grad_clip``
        (default ``optim.grad_clip``, or none)."""
        forward, module = trainable(model, lora=lora, seed=seed, sharding=sharding)
        optimizer, scheduler = make_optimizer(forward, optim, total_steps, floor=floor, decay_start=decay_start)
        device = sharding.device if sharding is not None else next(forward.parameters()).device
        clip = grad_clip if grad_clip is not None else getattr(optim, "grad_clip", math.inf)
        return cls(forward, module, tokenizer, optimizer, scheduler, lora, version=version, sharding=sharding,
                   is_main=sharding is None or sharding.rank == 0, grad_clip=clip,
                   autocast=autocast_dtype(autocast, device))

    @property
    def thread_budget(self) -> ThreadBudget | None:
        """The cores shared with an engine (``rollout.thread_sharing``), read by the loop."""
        return self.loop.thread_budget

    @thread_budget.setter
    def thread_budget(self, budget: ThreadBudget | None) -> None:
        self.loop.thread_budget = budget

    def accumulate(self, parts: Sequence[P], loss_function: Callable[[P], torch.Tensor],
                   filler: Callable[[], P] | None = None) -> None:
        """Forward and backward of each of ``parts`` (this rank's micro-batches), adding the
        gradient of ``loss_function(part)`` — the part's loss already weighted by its share of
        the step — to what was accumulated since the last :meth:`step`. Sharded, ``filler()``
        makes the zero-weight parts of the passes beyond this rank's own."""
        if not self._accumulating:
            self.optimizer.zero_grad(set_to_none=True)
            self._accumulating = True
        self.loop.backward(parts, loss_function, filler)

    def discard(self) -> None:
        """Drop what was accumulated since the last step (a step begun and abandoned)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._accumulating = False

    def step(self, losses: dict[str, torch.Tensor], *, hint: str, grad_norm_name: str = "grad_norm",
             grad_clip: float | None = None, divide_by: torch.Tensor | float | None = None) -> float:
        """The optimizer step on the accumulated gradients (first divided by ``divide_by``,
        where the losses were sums whose count was known only at the end), clipped to
        ``grad_clip`` (default the engine's). ``losses`` (name → value) and the gradient norm
        are checked first: a non-finite one raises ``NonFiniteError`` naming it, the step
        (``version`` + 1) and ``hint``, and the weights stay the last good ones. Returns the
        gradient norm before clipping. The gradients stay until the next :meth:`accumulate`."""
        if divide_by is not None:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(divide_by)
        self._accumulating = False
        return clip_and_step(self.model, self.optimizer, self.grad_clip if grad_clip is None else grad_clip, losses,
                             step=self.version + 1, hint=hint, grad_norm_name=grad_norm_name)

    def advance(self, *, schedule: bool = True) -> int:
        """A new version: the LR schedule's next step (unless ``schedule`` is false: the caller
        sets the LR itself, as a Tinker client does) and ``version`` + 1, returned."""
        if schedule:
            with warnings.catch_warnings():  # a version with no optimizer step (critic.warmup_steps) still counts
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.scheduler.step()
        self.version += 1
        return self.version

    def forward(self, parts: Sequence[P], fn: Callable[[P], R], filler: Callable[[], P] | None = None) -> list[R]:
        """``fn(part)`` of each of ``parts`` without gradients (a π_prox or reference
        recompute, a held-out loss, a Tinker ``forward``), under the same autocast, core
        budget and passes as :meth:`accumulate`; the results of ``parts`` alone, in order."""
        return self.loop.forward(parts, fn, filler)

    @property
    def lr(self) -> float:
        """The learning rate the next step takes."""
        return float(self.optimizer.param_groups[0]["lr"])


TrainState = TrainEngine  # an alias: code that imports it keeps working


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
