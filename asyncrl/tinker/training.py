"""One Tinker training client: LoRA adapters on the served base model, trained through
asyncrl's one training engine (``asyncrl/learner/core.py``: :class:`TrainEngine`, AdamW over
the adapters, its micro-batch loop, clip and finite check), checkpointed by
``asyncrl/learner/checkpoint_io.py``.

Tinker's split of a step is not asyncrl's learner's: ``forward_backward`` runs the loss and
**adds** its gradient (the loss is a sum, nothing is divided), any number of times, and
``optim_step`` steps with the Adam parameters it is sent and clears the gradient. So this is a
loop over the core, as ``asyncrl sft`` is, not a second learner: the optimizer, the clip and the
finite check, the adapters and the checkpoints are the core's.

Several clients train at once on one base model (multi-tenant LoRA): each has its own copy
of the model *structure* whose frozen base tensors are the one base model's (shared, never
copied: :func:`tenant_model`), so a client costs its adapters and optimizer state only.

Tinker's positions: datum ``i`` of a call has input tokens x (T) and per-position loss inputs
(T) — ``target_tokens`` y among them — where position t's logits predict y_t (no shift here:
the client shifted). Every loss input must be as long as the input; a datum that is not is
refused naming it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
from dataclasses import asdict, dataclass
from typing import Any
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_layers import GradientCheckpointingLayer

from asyncrl.algorithms.finite import NonFiniteError
from asyncrl.heap import mapped_above, trim_heap
from asyncrl.config import ConfigError, LoraConfig
from asyncrl.weight_updates import AdapterUpdate
from asyncrl.learner.checkpoint_io import restore_checkpoint, write_checkpoint
from asyncrl.learner.core import TrainEngine, micro_batch_bounds
from asyncrl.learner.head import position_logprobs, splits_head
from asyncrl.learner.lora import adapter_update, linear_names, load_adapter_weights
from asyncrl.learner.tinker_api import ATTENTION, LORA_ALPHA, UNEMBED
from asyncrl.tinker.futures import UserError
from asyncrl.tinker.losses import LossInputError, TinkerLoss, as_floats, gradient_positions, tinker_loss
from asyncrl.tinker.wire import WireDatum

LORA_FILE = "tinker_lora.json"
"""A saved state's LoRA settings, beside its adapters: what a client created from it gets."""
BASE_KEY = "base_model"
"""The key in :data:`LORA_FILE` naming the base model the state adapts."""


MAX_LEARNING_RATE = 1.0
"""The largest Adam ``learning_rate`` served. Adam moves every parameter by about the learning
rate each step whatever the gradient's scale (the first step by exactly lr·sign(g)), and a LoRA
B starts at zero: one step at lr = 1 adds (α/r)·B·A to an adapted layer, entries of about
32/√(3·r·d_in) (A drawn uniform in ±1/√d_in) — 0.14 on SmolLM2-135M at rank 32, more than the
whole spread of its attention's value and output weights. Past this bound a step cannot be a
learning step (docs/tinker.md, "Refused at the door")."""


def check_adam(adam: dict[str, Any]) -> None:
    """A :class:`UserError` naming each ``AdamParams`` value no step should take: a learning rate
    outside [0, :data:`MAX_LEARNING_RATE`], betas outside [0, 1), eps not above 0, a negative
    decay or one that with the rate would zero or flip every weight (decoupled decay scales each
    by 1 − lr·decay), a negative clip norm; NaN and ±inf anywhere."""
    values = {k: adam[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}
    lr, decay = values["learning_rate"], values["weight_decay"]
    wrong = [f"{k}={v} is not a finite number" for k, v in values.items() if not math.isfinite(v)]
    if not wrong:
        wrong = [text for bad, text in (
            (not 0 <= lr <= MAX_LEARNING_RATE, f"learning_rate={lr} is outside [0, {MAX_LEARNING_RATE}]: Adam moves "
             "every weight by about the learning rate each step, and past 1 one step outweighs a layer's own weights"),
            (not 0 <= values["beta1"] < 1, f"beta1={values['beta1']} is outside [0, 1)"),
            (not 0 <= values["beta2"] < 1, f"beta2={values['beta2']} is outside [0, 1)"),
            (not values["eps"] > 0, f"eps={values['eps']} is not above 0"),
            (not 0 <= decay, f"weight_decay={decay} is negative"),
            (lr * decay >= 1, f"learning_rate × weight_decay = {lr * decay:g} >= 1: decoupled decay scales every "
             "weight by 1 − lr·weight_decay, which would zero or flip it"),
            (values["grad_clip_norm"] < 0, f"grad_clip_norm={values['grad_clip_norm']} is negative (0: no clip)"),
        ) if bad]
    if wrong:
        raise UserError("adam_params refused: " + "; ".join(wrong))


@dataclass(frozen=True)
class TinkerLora:
    """A training client's ``LoraConfig`` as the SDK sends it."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class _Adam:
    """The core's optimizer settings (``core.Schedule``); each ``optim_step`` sets its own."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"


def lora_targets(model: PreTrainedModel, lora: TinkerLora) -> list[str]:
    """The linear layers ``lora`` trains, by last name: attention projections, the MLP's (every
    other linear layer), the LM head. A model whose LM head is its embedding (tied) gets no
    head adapter: merged into the engine's tied weight it would move the embedding too."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    targets = []
    for name in linear_names(model):
        if name in UNEMBED:
            keep = lora.train_unembed and not tied
        elif name in ATTENTION:
            keep = lora.train_attn
        else:
            keep = lora.train_mlp
        if keep:
            targets.append(name)
    if not targets:
        raise UserError(f"lora_config trains no layer of this model (train_attn={lora.train_attn}, train_mlp="
                        f"{lora.train_mlp}, train_unembed={lora.train_unembed}; its LM head is tied: {tied})")
    return targets


def tenant_model(base: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``base`` whose parameters and buffers are ``base``'s own tensors: peft wraps
    the copy's layers without touching ``base``, and nothing is duplicated (the base is frozen
    by every client alike)."""
    memo = {id(t): t for t in itertools.chain(base.parameters(), base.buffers())}
    return copy.deepcopy(base, memo)


ACTIVATION_FACTOR = 18
"""Bytes a decoder layer keeps for the backward per padded position, in units of its hidden
state's (hidden × element size), when it is not recomputed. Counted with
``torch.autograd.graph.saved_tensors_hooks`` on SmolLM2-135M-Instruct (float32, sdpa attention,
LoRA rank 32 on every linear layer): 17.8 — the MLP's four intermediate-wide tensors (4 × 1536),
six hidden-wide ones, keys and values, the adapters' rank-wide inputs — against exactly 1 (the
layer's input) when it is recomputed. Linear in the positions (the same per position at 300
and 900)."""
MAPPED_ABOVE = 1 << 20
"""A training call's forward allocations (each micro-batch's forward, each recomputed layer's)
from this size on are mappings of their own (``asyncrl/heap.py``,
:func:`~asyncrl.heap.mapped_above`): with glibc's own threshold a 948-token micro-batch's
heap grew 1.5 GB past its live tensors; from 1 MiB on, 0.3 GB (4 MiB: 1.3 GB, the hidden-sized
activations are 1–4 MiB there). A micro-batch's backward too when its hidden state reaches
:data:`HEAP_BACKWARD_BELOW`; a smaller one's backward allocates from the heap."""
HEAP_BACKWARD_BELOW = 4 << 20
"""A micro-batch whose hidden state (padded positions × hidden × element size) is smaller
runs its backward from glibc's heap, whose chunks it reuses; a larger one's backward maps
its allocations as its forward does. Mapping costs page faults on every byte allocated:
with the backward mapped too, the bench's 1,016-position micro-batch on SmolLM2 (2.3 MiB a
hidden state) took 1.49× the learner's step in process, with it from the heap 1.23×; but
with every backward from the heap the recipe-sized batch's server (chunks of about 2,900
padded positions, 6.7 MiB) passed 3.1 GB (stopped there) against 2.5 GB mapped (``docs/tinker.md``, "Memory")."""


def _recompute_mapped() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``checkpoint``'s ``context_fn``: the first forward as it is (already within its
    micro-batch's :func:`~asyncrl.heap.mapped_above`), the recompute in the backward within
    one of its own, as a recomputed layer's activations pile up as the forward's did; no
    trim on leaving, as it is entered once a layer."""
    return contextlib.nullcontext(), mapped_above(MAPPED_ABOVE, trim=False)


def decoder_layers(model: torch.nn.Module) -> list[GradientCheckpointingLayer]:
    """``model``'s decoder layers (Hugging Face's ``GradientCheckpointingLayer``), in order."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def layers_to_recompute(positions: int, *, layers: int, hidden: int, element_size: int, budget: int) -> int:
    """How many of ``layers`` decoder layers a micro-batch of ``positions`` padded positions
    recomputes to keep its activations within ``budget`` bytes: the fewest k with
    positions·hidden·element_size·(k + (layers − k)·:data:`ACTIVATION_FACTOR`) ≤ budget, at
    most every layer (all of them is the least memory there is: the budget is then exceeded
    by the layers' inputs alone)."""
    unit = positions * hidden * element_size  # one hidden state a position
    if unit == 0 or layers * ACTIVATION_FACTOR * unit <= budget:
        return 0
    saved = (ACTIVATION_FACTOR - 1) * unit  # what recomputing one layer saves
    return min(layers, math.ceil((layers * ACTIVATION_FACTOR * unit - budget) / saved))


def recompute_layers(layers: list[GradientCheckpointingLayer], count: int) -> None:
    """The first ``count`` of ``layers`` keep only their input for the backward and compute the
    rest again there (activation checkpointing: one hidden state a layer a position instead
    of :data:`ACTIVATION_FACTOR`, for one more forward of those layers); the others keep every
    activation. Read when a layer runs forward, so set before each micro-batch. The layers'
    own ``training`` flag is what Hugging Face's checkpointing reads; their sub-modules stay
    in eval mode (no dropout)."""
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing, layer.training = i < count, i < count
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False, context_fn=_recompute_mapped)


@dataclass(frozen=True)
class Rows:
    """A call's data padded on the right: ids, targets, mask (B, T), loss inputs (B, T) each."""

    ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    inputs: dict[str, torch.Tensor]
    lengths: list[int]

    def part(self, start: int, stop: int) -> Rows:
        """Rows [start, stop), trimmed to their own longest."""
        width = max(self.lengths[start:stop])
        return Rows(self.ids[start:stop, :width], self.targets[start:stop, :width], self.mask[start:stop, :width],
                    {k: v[start:stop, :width] for k, v in self.inputs.items()}, self.lengths[start:stop])


def pack(data: list[WireDatum], vocab: int, max_positions: int) -> Rows:
    """The call's datums as :class:`Rows`; a datum whose loss inputs are not as long as its
    input, a token outside the vocabulary or a datum past the context is a :class:`UserError`."""
    if not data:
        raise UserError("forward_backward got no data")
    names = set(data[0].inputs)
    for i, datum in enumerate(data):
        length = len(datum.tokens)
        if length == 0 or length > max_positions:
            raise UserError(f"data[{i}] has {length} input tokens; this model takes 1 to {max_positions}")
        if "target_tokens" not in datum.inputs:
            raise UserError(f"data[{i}].loss_fn_inputs has no target_tokens")
        if set(datum.inputs) != names:
            raise UserError(f"data[{i}].loss_fn_inputs has {sorted(datum.inputs)}, data[0] {sorted(names)}")
        for name, array in datum.inputs.items():
            if array.ndim != 1 or array.shape[0] != length:
                raise UserError(f"data[{i}].loss_fn_inputs[{name!r}] has shape {list(array.shape)}; the datum's "
                                f"model_input has {length} tokens, and each loss input needs one value a position")
        bad = [t for t in itertools.chain(datum.tokens, datum.inputs["target_tokens"].tolist()) if not 0 <= t < vocab]
        if bad:
            raise UserError(f"data[{i}] has token {bad[0]}, outside this model's vocabulary of {vocab}")
    lengths = [len(d.tokens) for d in data]
    width = max(lengths)
    ids = torch.zeros((len(data), width), dtype=torch.long)
    mask = torch.zeros((len(data), width), dtype=torch.bool)
    inputs = {name: torch.zeros((len(data), width), dtype=torch.float32) for name in names - {"target_tokens"}}
    targets = torch.zeros((len(data), width), dtype=torch.long)
    for i, datum in enumerate(data):
        n = lengths[i]
        ids[i, :n] = torch.tensor(datum.tokens)
        targets[i, :n] = torch.from_numpy(datum.inputs["target_tokens"].astype(np.int64))
        mask[i, :n] = True
        for name in inputs:
            inputs[name][i, :n] = torch.from_numpy(datum.inputs[name].astype(np.float32))
    return Rows(ids, targets, mask, inputs, lengths)


class TrainingRun:
    """One client's adapters, optimizer and its request bookkeeping. Every method runs on the
    server's one training thread, in the order the requests arrived."""

    def __init__(self, model_id: str, base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, lora: TinkerLora,
                 *, max_rank: int, micro_rows: int = 64, micro_tokens: int | None = 4096,
                 recompute: bool | str = "auto", activation_budget: int = 768 << 20) -> None:
        if not 1 <= lora.rank <= max_rank:
            raise UserError(f"lora_config.rank={lora.rank} is refused: this server trains ranks 1 to {max_rank} "
                            "(tinker.max_lora_rank)")
        self.model_id, self.lora = model_id, lora
        config = LoraConfig(rank=lora.rank, alpha=LORA_ALPHA, target_modules=lora_targets(base, lora))
        self.state = TrainEngine.build(tenant_model(base), tokenizer, _Adam(), 1, lora=config, seed=lora.seed or 0)
        self.vocab = int(base.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(base.config, "max_position_embeddings", None) or 1 << 30)
        self.micro_rows, self.micro_tokens = micro_rows, micro_tokens  # optim.micro_batch_size / _tokens
        self.split = splits_head(self.state.model)  # logits a chunk at a time (learner/head.py)
        self.layers = decoder_layers(self.state.model)  # this client's copy of the layers, not the base's
        self.recompute, self.activation_budget = recompute, activation_budget  # tinker.recompute_layers, _budget_mib
        self.hidden = int(getattr(base.config, "hidden_size", 0) or 0)
        self.requests: dict[int, str] = {}
        """seq id → the request id it was answered with: a retried call gets the same future back."""

    def forward_backward(self, data: list[WireDatum], loss_fn: str, config: dict[str, float | str],
                         *, forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """The loss over ``data`` and, unless ``forward_only``, its gradient added to the
        adapters'. Returns each datum's target ``logprobs`` and the metrics (``loss:sum``).

        Micro-batched as the learner is (``optim.micro_batch_size`` / ``micro_batch_tokens``,
        ``micro_batch_bounds``): the loss is a sum, so each part's backward adds its share and
        any split takes the same gradient; the ``:mean`` metrics are weighted by each part's
        positions."""
        try:
            loss_of = tinker_loss(loss_fn)
        except LossInputError as exc:
            raise UserError(str(exc)) from None
        rows = pack(data, self.vocab, self.max_positions)
        numbers = {k: v for k, v in config.items() if isinstance(v, float)}
        sums: dict[str, torch.Tensor] = {}
        logprobs: list[torch.Tensor] = []

        def loss_function(part: Rows) -> torch.Tensor:  # what the training engine is passed
            with mapped_above(MAPPED_ABOVE):  # the forward's peak follows its live tensors (asyncrl/heap.py)
                loss, metrics = self._loss(part, loss_fn, loss_of, numbers, logprobs)
            if not forward_only and not loss.requires_grad:  # every weight 0 (a tied group): no graph at all
                loss = loss + zero_gradient(self.state.model)
            positions = sum(part.lengths)
            for key, value in metrics.items():  # loss:sum adds; a token mean is weighed by its positions
                sums[key] = sums.get(key, 0) + (value if key.endswith(":sum") else value * positions)
            return loss

        bounds = micro_batch_bounds(rows.lengths, max_rows=self.micro_rows, max_tokens=self.micro_tokens)
        parts = [rows.part(start, stop) for start, stop in bounds]
        unit = self.hidden * next(self.state.model.parameters()).element_size()
        large = any(part.ids.numel() * unit >= HEAP_BACKWARD_BELOW for part in parts)
        try:
            with mapped_above(MAPPED_ABOVE) if large and not forward_only else contextlib.nullcontext():
                if forward_only:
                    self.state.forward(parts, loss_function)
                else:
                    self.state.accumulate(parts, loss_function)
        finally:
            trim_heap()  # what the backward's heap kept goes back between calls
        total = sum(rows.lengths)
        metrics = {key: value if key.endswith(":sum") else value / total for key, value in sums.items()}
        outputs = [{"logprobs": lp.cpu().numpy()} for lp in logprobs]  # a CPU-GPU sync point per datum
        return outputs, as_floats(metrics)

    def _loss(self, rows: Rows, loss_fn: str, loss_of: TinkerLoss, config: dict[str, float],
              logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's summed loss and its metrics (``loss:sum`` among them, detached);
        each datum's target logprobs are added to ``logprobs``. The logits are made a chunk of
        positions at a time, with a graph only where the loss has a gradient
        (``gradient_positions``): memory is bounded by the micro-batch's hidden states and one
        chunk of logits, not by positions × vocabulary."""
        device = next(self.state.model.parameters()).device
        recompute_layers(self.layers, self.recomputed(rows.ids.numel()) if torch.is_grad_enabled() else 0)
        ids, mask, targets = rows.ids.to(device), rows.mask.to(device), rows.targets.to(device)
        inputs = {name: tensor.to(device) for name, tensor in rows.inputs.items()}
        token_lps = position_logprobs(self.state.model, ids, mask, targets, gradient_positions(loss_fn, inputs, mask),
                                      split=self.split)  # (B, T)
        try:
            loss, metrics = loss_of(token_lps, inputs, mask, config)
        except LossInputError as exc:
            raise UserError(str(exc)) from None
        detached = token_lps.detach()
        logprobs.extend(detached[i, :n] for i, n in enumerate(rows.lengths))
        return loss, {"loss:sum": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}

    def recomputed(self, positions: int) -> int:
        """How many decoder layers a micro-batch of ``positions`` padded positions recomputes in
        its backward: every one (``tinker.recompute_layers: true``), none (``false``), or with
        ``auto`` as many as keep its activations within ``tinker.activation_budget_mib``
        (:func:`layers_to_recompute`, at the element size of the weights)."""
        if self.recompute != "auto":
            return len(self.layers) if self.recompute else 0
        element = next(self.state.model.parameters()).element_size()
        return layers_to_recompute(positions, layers=len(self.layers), hidden=self.hidden, element_size=element,
                                   budget=self.activation_budget)

    def optim_step(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """AdamW (decoupled weight decay) on the gradient summed since the last step, with this
        step's parameters; ``grad_clip_norm`` 0 clips nothing. The next ``forward_backward``
        starts a new gradient."""
        if not (lr >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1 and eps > 0 and weight_decay >= 0):
            raise UserError(f"adam_params refused: learning_rate={lr}, beta1={beta1}, beta2={beta2}, eps={eps}, "
                            f"weight_decay={weight_decay} (need lr >= 0, betas in [0, 1), eps > 0, decay >= 0)")
        for group in self.state.optimizer.param_groups:
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        try:
            norm = self.state.step({}, grad_clip=grad_clip_norm if grad_clip_norm > 0 else math.inf,
                                   hint="check the data and learning rate of the last forward_backward calls")
        except NonFiniteError as exc:
            raise UserError(str(exc)) from None
        self.state.advance(schedule=False)  # the client set this step's LR: no schedule here
        return {"grad_norm:mean": norm}

    def adapters(self) -> AdapterUpdate:
        """The adapters now (new tensors: training goes on while a sampler holds them)."""
        return adapter_update(self.state.module)

    def save_state(self, path: Path, *, base: str) -> None:
        """Adapters, optimizer, step, this client's LoRA settings and its base model's name
        (``base``), atomically."""
        write_checkpoint(self.state, path, files={LORA_FILE: json.dumps({**asdict(self.lora), BASE_KEY: base})})

    def save_adapters(self, path: Path) -> None:
        """The adapters alone, as a PEFT directory (what a sampler checkpoint is on disk)."""
        self.state.module.save_pretrained(path)

    def load_state(self, path: Path, *, optimizer: bool) -> None:
        """A saved state's adapters into this client (and its optimizer and step with
        ``optimizer``); a state of another rank or other targets is refused."""
        saved, _ = read_lora(path)
        if (saved.rank, lora_targets_key(saved)) != (self.lora.rank, lora_targets_key(self.lora)):
            raise UserError(f"{path.name} holds rank-{saved.rank} adapters on other layers or of another rank than "
                            f"this client's rank {self.lora.rank}; create a client from it instead "
                            "(create_training_client_from_state)")
        try:
            if optimizer:
                restore_checkpoint(self.state, path)
            else:
                load_adapter_weights(self.state.module, path)
        except ConfigError as exc:
            raise UserError(str(exc)) from None


def zero_gradient(model: torch.nn.Module) -> torch.Tensor:
    """0, with a graph to every trained parameter: a micro-batch whose every loss weight is 0
    (a group of tied rewards, which tinker-cookbook keeps) has a loss with no graph, and its
    backward would fail. Its gradient is 0, and through this it is 0 rather than none, so the
    next ``optim_step`` is Adam's step on a zero gradient, as the hosted service's."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return sum((p.sum() * 0.0 for p in trained), torch.zeros((), device=trained[0].device if trained else None))


def lora_targets_key(lora: TinkerLora) -> tuple[bool, bool, bool]:
    return lora.train_attn, lora.train_mlp, lora.train_unembed


def read_lora(path: Path) -> tuple[TinkerLora, str | None]:
    """The LoRA settings a saved state was trained with, and its base model's name (None in a
    state saved before states named it)."""
    try:
        saved = json.loads((path / LORA_FILE).read_text())
        base = saved.pop(BASE_KEY, None)
        return TinkerLora(**saved), base
    except FileNotFoundError:
        raise UserError(f"{path} is not a state saved by save_state (no {LORA_FILE})") from None
