"""The learner: recomputes proximal logprobs, takes optimizer steps, exports weights.
Its checkpoints are written and read back by ``checkpoint_io.py``.

One ``train_step`` trains on one batch and makes one new policy version. By default that
is one optimizer step; with sample reuse (``optim.ppo_epochs`` passes over the batch, each
in ``optim.mini_batches`` shuffled mini-batches) it is several, all measured against the
π_prox of the weights at the start of the batch, so from the second optimizer step on the
ratio leaves 1 and the PPO clip bounds how far the batch can move the policy. The version
still advances once per batch: a version is what the rollout engines are sent, and the
staleness bound, the gate's quota and every token's recorded version count batches, so
none of them changes meaning with reuse. The learning-rate schedule also counts batches.

Every optimizer step is the one training engine's (``core.TrainEngine``, which owns zeroing
the gradients, sharding's passes, autocast, the core budget, the clip and the finite check):
the loss passed to it is this learner's objective, each micro-batch's weighted by its share
of the mini-batch's tokens (or sequences), so any micro-batch size gives the same step as
one big mini-batch.

A batch can also come in parts, as its groups finish (``learner.streaming``):
``accumulate`` runs forward and backward on each part, ``finish_step`` takes the one
optimizer step. Each micro-batch's loss is then weighted by its own count, and the summed
gradients are divided by the whole batch's count at the step, before clipping: the same
step as ``train_step`` on the whole batch, up to float rounding (docs/design.md,
"Streaming the learner").

With a :class:`~asyncrl.learner.distributed.Sharding` the same learner is one rank of a
data-parallel group (``learner.world_size`` > 1): it trains on its rows of the batch, the
shares are of the whole batch's counts (summed over ranks), and metrics are summed over
ranks too, so N ranks take the step one would. ``distributed.py`` says how.

With ``model.lora`` (``lora.py``) the policy is the base wrapped with LoRA adapters: the
optimizer holds only the adapters, the KL reference is the same model with the adapters
off (no second copy of the weights), and the engines are sent the adapters alone, or the
targeted layers merged where an engine cannot take adapters (``export.py`` chooses once).
Everything above (micro-batches, sample reuse, streaming) is unchanged:
it only sees a model whose trainable parameters are fewer.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.algorithms import aggregate, entropy_from_logits, get_policy_loss, kl_k3, token_logprobs
from asyncrl.algorithms.finite import NonFiniteError, count_nonfinite, nonfinite_parameters
from asyncrl.algorithms.mismatch import MAX_LAG, add_sums, mismatch_metrics, mismatch_sums
from asyncrl.config import AlgorithmConfig, LoraConfig, OptimConfig
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.checkpoint_io import restore_checkpoint, write_checkpoint
from asyncrl.learner.critic import Critic
from asyncrl.learner.core import (  # noqa: F401 (what the tests and callers import from here too)
    MicroBatchLoop,
    TrainEngine,
    autocast_dtype,
    lr_lambda,
    micro_batch_bounds,
    mini_batch_rows,
)
from asyncrl.learner.distributed import Sharding
from asyncrl.weight_updates import FullWeights, WeightUpdate
from asyncrl.learner.export import UpdateKind, engine_start, engine_update, update_kind
from asyncrl.learner.lora import peft_model
from asyncrl.learner.shared_prompts import prompt_index, response_logits
from asyncrl.seeding import derive_seed
from asyncrl.core_budget import ThreadBudget


class Learner:
    """Trains one policy: each ``train_step`` takes one batch to one new version, however
    many optimizer steps sample reuse makes of it (``optim.ppo_epochs`` × ``optim.mini_batches``).
    Per batch rather than per optimizer step because a version is what the engines are
    sent and what every token, the gate and the staleness bound count."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, algorithm: AlgorithmConfig,
                 optim: OptimConfig, total_steps: int, temperature: float, version: int = 0,
                 sharding: Sharding | None = None, seed: int = 0, share_prompts: bool = True,
                 lora: LoraConfig | None = None, update: UpdateKind | None = None,
                 autocast: str | None = None, critic: Critic | None = None) -> None:
        """``sharding``: this learner is one rank of a sharded learner; ``model`` is this
        rank's policy, wrapped here — already its own shards when it was loaded that way
        (``learner/sharded_load.py``), else a whole copy (the KL reference, if any, stays a
        full frozen copy on every rank: it only runs forward passes). ``seed``: the run's,
        from which each batch's mini-batch shuffle derives (with the version, so a resumed
        run shuffles as the uninterrupted one would). ``lora``: train LoRA adapters on
        ``model`` (wrapped in place) instead of its weights; one rank only. ``update``:
        what the engines are sent (``export.update_kind``; default: what ``lora`` says for
        the built-in engine). ``autocast``:
        ``learner.autocast`` (:func:`autocast_dtype`). ``critic``: trained beside it (``critic.py``)."""
        self.sharding = sharding
        self.share_prompts = share_prompts  # learner.share_prompts (one rank only)
        self.seed = seed
        self.lora = lora
        self.update_kind = update or update_kind(lora)
        if (self.update_kind == "full") != (lora is None):
            raise ValueError(f"update={self.update_kind!r} does not fit model.lora={lora}")
        # the KL reference: with LoRA this model with its adapters off (reference_logprobs), else a frozen copy
        self.reference = (copy.deepcopy(model).eval().requires_grad_(False)
                          if algorithm.kl_coef > 0 and lora is None else None)
        self.tokenizer = tokenizer
        self.algorithm = algorithm
        self.optim = optim
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts report raw logits
        # the one training engine (core.py): the model made trainable, AdamW over what trains
        # (with LoRA the adapters only), the micro-batch loop, the clip and the schedule
        self.engine = TrainEngine.build(model, tokenizer, optim, total_steps, lora=lora, seed=seed,
                                        sharding=sharding, autocast=autocast, version=version)
        self.device = sharding.device if sharding is not None else next(self.model.parameters()).device
        self.critic = critic
        self.policy_loss = get_policy_loss(algorithm.policy_loss)
        self.pad_id = tokenizer.pad_token_id or 0
        self._stream: _Stream | None = None  # a streamed step's parts so far (accumulate → finish_step)
        # the batch's engine–learner mismatch sums by lag (algorithms/mismatch.py), added while
        # the weights are still the batch's starting ones (None: not measuring now)
        self._mismatch: torch.Tensor | None = None

    # the engine's parts, read by checkpoint_io (its ``Checkpointed``), the workers and the tests
    @property
    def model(self) -> torch.nn.Module:
        """The policy as trained (the forward model; wrapped when sharded)."""
        return self.engine.model

    @property
    def module(self) -> PreTrainedModel:
        """The Hugging Face model under it (with LoRA the ``PeftModel``): names, config, saving."""
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.engine.scheduler

    @property
    def loop(self) -> MicroBatchLoop:
        return self.engine.loop

    @property
    def version(self) -> int:
        """The policy's version: batches trained (the engine's :meth:`~TrainEngine.advance` calls)."""
        return self.engine.version

    @version.setter
    def version(self, version: int) -> None:
        self.engine.version = version

    @property
    def thread_budget(self) -> ThreadBudget | None:
        """The cores shared with an engine (``rollout.thread_sharing: colocated``), read by the loop."""
        return self.engine.thread_budget

    @thread_budget.setter
    def thread_budget(self, budget: ThreadBudget | None) -> None:
        self.engine.thread_budget = budget

    # ------------------------------------------------------------------ math
    def token_logprobs(self, model: torch.nn.Module, batch: TrainBatch, *, with_entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log π(target) under ``model`` at the rollout temperature. Returns (B, L-1) tensors.
        Called in the engine's passes (``self.engine``), which autocast the forward
        (``learner.autocast``); logits are read back as float32 before the softmax."""
        shared = prompt_index(batch) if self.share_prompts and self.sharding is None else None
        if shared is not None:  # each distinct prompt once (shared_prompts.py)
            responses = response_logits(cast(PreTrainedModel, model), batch, *shared)  # unsharded: no wrapper
            logits, targets = responses.logits.float() / self.temperature, responses.targets  # (B, R, V)
        else:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            logits, targets = logits[:, :-1].float() / self.temperature, batch.input_ids[:, 1:]  # (B, L-1, V)
        logprobs = token_logprobs(logits, targets)
        entropy = entropy_from_logits(logits.detach()) if with_entropy else None
        if shared is not None:
            logprobs = responses.to_target_axis(logprobs)
            entropy = None if entropy is None else responses.to_target_axis(entropy)
        return logprobs, entropy

    def micro_batches(self, batch: TrainBatch) -> list[tuple[int | None, TrainBatch]]:
        """(first row, rows) of each micro-batch of this rank's ``batch``
        (``micro_batch_bounds``). Sharded, the loop adds :meth:`_filler` passes up to the
        rank with the most."""
        lengths = batch.attention_mask.sum(-1).tolist()  # a CPU-GPU sync point, once per call
        bounds = micro_batch_bounds(lengths, max_rows=self.optim.micro_batch_size,
                                    max_tokens=self.optim.micro_batch_tokens)
        return [(start, batch.slice(start, stop)) for start, stop in bounds]

    def _filler(self) -> tuple[int | None, TrainBatch]:
        """A pass that trains nothing (first row ``None``, no token in its loss mask)."""
        return None, TrainBatch.filler(self.pad_id, self.device)

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        """(B, L-1) logprobs of the whole batch, computed micro-batch by micro-batch."""
        out = torch.zeros_like(batch.behavior_logprobs)
        parts = self.micro_batches(batch)
        for (start, part), (lp, _) in zip(parts, self.engine.forward(
                parts, lambda p: self.token_logprobs(model, p[1]), self._filler)):
            if start is None:  # only the loop's own filler passes have none, and they are not zipped here
                raise RuntimeError("a micro-batch of the batch has no first row")
            out[start:start + part.size, :lp.shape[1]] = lp
        return out

    @torch.no_grad()
    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """(B, L-1) logprobs under the KL reference (None without ``algorithm.kl_coef``): the
        initial policy's frozen copy, or with LoRA the base itself, its adapters disabled
        (in eval mode, as the copy is, so the base's own dropout does not enter)."""
        if self.algorithm.kl_coef <= 0:
            return None
        if self.lora is None:
            if self.reference is None:
                raise RuntimeError("no KL reference copy: the learner was built with algorithm.kl_coef=0")
            return self.logprobs(self.reference, batch)
        training = self.model.training
        self.model.eval()
        try:
            with peft_model(self.module).disable_adapter():
                return self.logprobs(self.model, batch)
        finally:
            self.model.train(training)

    def train_step(self, batch: TrainBatch, *, on_policy: bool = False) -> dict[str, float]:
        """Train on ``batch``: ``optim.ppo_epochs`` × ``optim.mini_batches`` optimizer steps
        (one by default) against one π_prox; the learner's version becomes version + 1.

        ``on_policy``: every token was sampled by the current weights, so π_prox = μ and
        the recompute (a full extra forward pass) is skipped; the step is then exactly
        the bypass form. Metrics are means over the batch's tokens (or sequences) and over
        its epochs; ``actor/grad_norm`` is the mean over optimizer steps (before clipping)."""
        if self._stream is not None:  # a streamed step left unfinished (a stop) is dropped
            self._stream = None
            self.engine.discard()
        steps = mini_batch_rows(batch.size, epochs=self.optim.ppo_epochs, mini_batches=self.optim.mini_batches,
                                seed=derive_seed(self.seed, "mini_batches", self.version))
        first, last = self.sharding.rows(batch.size) if self.sharding is not None else (0, batch.size)
        mine = batch.rows(first, last).to(self.device)  # this rank's rows; every count below is the whole batch's
        self.model.train()
        targets = self.critic.targets(mine, self.micro_batches, self._filler, self.algorithm) if self.critic else None
        if self.critic is not None and targets is not None:  # per-token advantages from its values now (critic.py)
            mine = mine.with_advantages(targets.advantages)
            steps = steps if self.version >= self.critic.config.warmup_steps else []  # critic.warmup_steps
        # π_prox: the weights at the start of this batch (decoupled PPO), or μ itself (bypass).
        # With one optimizer step per batch those are the weights of that step's own forward
        # pass, so its logprobs, detached, are π_prox's: no extra pass (a third of the step).
        recompute = not (self.algorithm.bypass or on_policy)
        from_forward = recompute and len(steps) == 1
        proximal = self.logprobs(self.model, mine) if recompute and not from_forward and steps else None
        reference = self.reference_logprobs(mine) if steps else None
        batch_counts = _counts(batch.loss_mask).to(self.device)
        sums: dict[str, torch.Tensor] = {}
        norms = []
        mismatch = self._mismatch = self._no_mismatch()
        for step in steps:
            local = step[(step >= first) & (step < last)] - first  # this rank's rows of the mini-batch
            counts = _counts(batch.loss_mask[step]).to(self.device)
            # this step's share of the batch's (token, sequence) means over the epochs: what its metrics weigh
            weight = counts / batch_counts.clamp(min=1) / self.optim.ppo_epochs
            norms.append(self._optimizer_step(
                mine.select(local), counts, weight,
                proximal=None if proximal is None else proximal[local], proximal_from_forward=from_forward,
                reference=None if reference is None else reference[local], sums=sums))
            if proximal is None:  # the weights moved: only a recomputed π_prox is still the start's policy
                self._mismatch = None
        self._mismatch = None
        out = self._end_batch(sums, norms, batch_counts[0], mismatch)
        if self.critic is not None and targets is not None:
            critic_steps = [(rows[(rows >= first) & (rows < last)] - first,  # this rank's rows of each
                             _counts(batch.loss_mask[rows]).to(self.device))
                            for rows in self.critic.mini_batches(batch.size, self.version, self.seed)]
            out.update(self.critic.train(mine, self.micro_batches, self._filler, targets, critic_steps, batch_counts,
                                         self.algorithm))
        return out

    def _no_mismatch(self) -> torch.Tensor:
        """Empty :func:`~asyncrl.algorithms.mismatch.mismatch_sums`, to add a batch's micro-batches to."""
        return torch.zeros(MAX_LAG + 1, 4, device=self.device)

    def _end_batch(self, sums: dict[str, torch.Tensor], norms: list[float], tokens: torch.Tensor,
                   mismatch: torch.Tensor) -> dict[str, float]:
        """After a batch's optimizer steps (their gradient ``norms``): the LR schedule, the
        weights' finite check, the new version, and the metrics from ``sums`` (each already
        the batch's mean over its ``tokens``, or sequences) and ``mismatch``'s sums by lag."""
        self.engine.advance()  # the LR schedule and the new version
        self.model.eval()
        sums["nonfinite_weights"] = self._local_nonfinite()  # summed over ranks and read with the metrics
        if self.sharding is not None:  # each rank summed its shares of the whole batch: add the ranks up
            keys = sorted(sums)
            sums = dict(zip(keys, self.sharding.sum(torch.stack([torch.as_tensor(sums[k]) for k in keys]))))
            mismatch = torch.cat([self.sharding.sum(mismatch[:, :3]), self.sharding.max(mismatch[:, 3:])], dim=1)
        out = {f"actor/{k}": float(v) for k, v in sums.items()}  # one device sync per step
        if out.pop("actor/nonfinite_weights"):
            names = nonfinite_parameters(self._local_parameters())
            raise NonFiniteError(f"non-finite weights after step {self.version} (first {names[:3]}) although the "
                                 "loss and gradient norm were finite; lower optim.lr. No checkpoint of these weights "
                                 "is written")
        if "actor/is_raw_weight_sq_mean" in out:  # Kish's effective sample size, as a fraction of the tokens
            out["actor/is_ess"] = out["actor/is_raw_weight_mean"] ** 2 / max(out["actor/is_raw_weight_sq_mean"], 1e-12)
        out.update({"actor/grad_norm": sum(norms) / max(len(norms), 1), "actor/tokens": float(tokens),
                    "actor/lr": float(self.scheduler.get_last_lr()[0]), "actor/optimizer_steps": float(len(norms))})
        out.update(mismatch_metrics(mismatch))
        return out

    # ------------------------------------------------------------ streamed step
    def accumulate(self, batch: TrainBatch, *, on_policy: bool = False) -> None:
        """Forward and backward on ``batch``, one part of a batch whose other parts come
        later (``learner.streaming``); :meth:`finish_step` takes the batch's one optimizer
        step. Until then the gradients and metric sums hold each micro-batch's loss times its
        own token (or sequence) count — sums, not means, because the whole batch's counts
        are known only once its last part is in — and the weights do not move, so π_prox is
        each pass's own forward, detached (μ for an ``on_policy`` part, or in bypass), as in
        a one-step :meth:`train_step`. One rank and one optimizer step per batch only."""
        if self.critic or self.sharding is not None or self.optim.ppo_epochs != 1 or self.optim.mini_batches != 1:
            raise ValueError("a streamed step is one optimizer step on one rank: it needs learner.world_size=1, "
                             "optim.ppo_epochs=1 and optim.mini_batches=1, and no critic")
        if self._stream is None:  # the engine starts the step's gradients from zero
            self._stream = _Stream(torch.zeros(2, device=self.device), self._no_mismatch())
        stream, batch = self._stream, batch.to(self.device)
        self._mismatch = stream.mismatch  # the weights stay the batch's starting ones until finish_step
        self.model.train()
        reference = self.reference_logprobs(batch)
        stream.counts += _counts(batch.loss_mask)
        ones = torch.ones(2, device=self.device)  # shares of 1 per token (or sequence): sums, divided at the step
        self._backward(batch, ones, ones, proximal=None, reference=reference, sums=stream.token_sums,
                       own_sums=stream.own_sums, losses=stream.losses,
                       proximal_from_forward=not (self.algorithm.bypass or on_policy))

    def finish_step(self) -> dict[str, float]:
        """The optimizer step of the batch given part by part to :meth:`accumulate`: the
        summed gradients and metrics divided by the whole batch's token (or sequence) count,
        then a batched step's clip, checks, AdamW step and metrics; version becomes version + 1."""
        stream, self._stream = self._stream, None
        if stream is None:
            raise RuntimeError("finish_step without a part accumulated since the last step")
        tokens, sequences = stream.counts.clamp(min=1)
        per = tokens if self.algorithm.aggregation == "token_mean" else sequences
        sums = {k: v / tokens for k, v in stream.token_sums.items()} | {k: v / per for k, v in stream.own_sums.items()}
        self._mismatch = None
        return self._end_batch(sums, [self._step(stream.losses, divide_by=per)], stream.counts[0], stream.mismatch)

    def _optimizer_step(self, batch: TrainBatch, counts: torch.Tensor, weight: torch.Tensor, *,
                        proximal: torch.Tensor | None, reference: torch.Tensor | None,
                        sums: dict[str, torch.Tensor], proximal_from_forward: bool = False) -> float:
        """One optimizer step on ``batch`` (this rank's rows of one mini-batch, whose whole
        token and sequence ``counts`` weigh each micro-batch's loss); adds its metrics,
        weighted by ``weight`` (token, sequence), to ``sums``. Returns the gradient norm."""
        losses: list[torch.Tensor] = []
        self._backward(batch, counts, weight, proximal=proximal, reference=reference, sums=sums, losses=losses,
                       proximal_from_forward=proximal_from_forward)
        return self._step(losses)

    def _backward(self, batch: TrainBatch, counts: torch.Tensor, weight: torch.Tensor, *,
                  proximal: torch.Tensor | None, reference: torch.Tensor | None, sums: dict[str, torch.Tensor],
                  losses: list[torch.Tensor], proximal_from_forward: bool = False,
                  own_sums: dict[str, torch.Tensor] | None = None) -> None:
        """Forward and backward of each micro-batch of ``batch``, adding to the gradients its
        loss times its share of ``counts``; its metrics go to ``sums`` weighted as
        :meth:`_optimizer_step` says (the policy loss's by tokens; entropy, KL and loss, the
        learner's own, by the aggregation's count, into ``own_sums`` if given) and its loss
        to ``losses``."""
        own_sums = sums if own_sums is None else own_sums
        tokens, sequences = counts.clamp(min=1)

        def objective(item: tuple[int | None, TrainBatch]) -> torch.Tensor:  # the loss the loop is passed
            start, part = item
            width = part.loss_mask.shape[1]

            def rows(full: torch.Tensor) -> torch.Tensor:  # this micro-batch's rows of a whole-batch tensor
                return full[start:start + part.size, :width] if start is not None else torch.zeros_like(part.loss_mask)

            logprobs, entropy = self.token_logprobs(self.model, part, with_entropy=True)
            if entropy is None:
                raise RuntimeError("token_logprobs(with_entropy=True) returned no entropy")
            if self._mismatch is not None and part.versions is not None and start is not None:
                # π at the version being trained: π_prox where recomputed, else this forward (the
                # weights have not moved yet); at lag 0 its distance to μ is the mismatch itself
                start_policy = rows(proximal) if proximal is not None else logprobs.detach()
                add_sums(self._mismatch, mismatch_sums(part.behavior_logprobs, start_policy, part.loss_mask,
                                                       self.version - part.versions))
            loss, metrics = self.policy_loss(
                logprobs, part.behavior_logprobs, part.advantages, part.loss_mask,
                proximal_logprobs=(logprobs.detach() if proximal_from_forward
                                   else None if proximal is None else rows(proximal)),
                config=self.algorithm)
            ours = {"entropy": aggregate(entropy, part.loss_mask, self.algorithm.aggregation)}
            if reference is not None:
                kl = aggregate(kl_k3(logprobs, rows(reference)), part.loss_mask, self.algorithm.aggregation)
                loss = loss + self.algorithm.kl_coef * kl
                ours["kl_ref"] = kl.detach()
            # this micro-batch's share of the mini-batch's mean (its tokens', or its sequences')
            token_share = part.loss_mask.sum() / tokens
            share = (token_share if self.algorithm.aggregation == "token_mean"
                     else (part.loss_mask.sum(-1) > 0).sum() / sequences)
            ours["loss"] = loss.detach()
            losses.append(ours["loss"])
            step_weight = weight[0] if self.algorithm.aggregation == "token_mean" else weight[1]
            # the policy loss's own metrics are token means whatever the aggregation
            for w, values, into in ((token_share * weight[0], metrics, sums), (share * step_weight, ours, own_sums)):
                for key, value in values.items():
                    into[key] = into.get(key, 0.0) + value.detach() * w
            return loss * share

        self.engine.accumulate(self.micro_batches(batch), objective, self._filler)

    def _step(self, losses: list[torch.Tensor], divide_by: torch.Tensor | None = None) -> float:
        """The engine's optimizer step (:meth:`TrainEngine.step`): clip, refuse a non-finite
        loss or gradient norm before the weights move, step. Returns the gradient norm (before
        clipping); the gradients are the whole mini-batch's on every rank, so the norm is
        global and a NaN on any rank stops every rank."""
        return self.engine.step({"actor/loss": torch.stack(losses).sum()}, divide_by=divide_by,
                                grad_norm_name="actor/grad_norm", hint="Check the rewards and advantages of this "
                                "batch (samples.jsonl) and the learning rate")

    # --------------------------------------------------------- weights, state
    def _local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's pieces of the parameters (a sharded parameter's own shard)."""
        for name, p in self.model.named_parameters():
            yield name, p.to_local() if hasattr(p, "to_local") else p

    def _local_nonfinite(self) -> torch.Tensor:
        """This rank's weight tensors holding NaN or infinity (a device tensor, not read here)."""
        return count_nonfinite(t for _, t in self._local_parameters())

    def _count_nonfinite_weights(self) -> int:
        """Weight tensors holding NaN or infinity, over all ranks (a collective when sharded)."""
        bad = self._local_nonfinite().reshape(1)
        return int(self.sharding.sum(bad)[0]) if self.sharding is not None else int(bad[0])

    @property
    def is_main(self) -> bool:
        """The rank that writes files and hands out weights (the only one unsharded)."""
        return self.sharding is None or self.sharding.rank == 0

    def engine_weights(self) -> WeightUpdate:
        """What the engines load (``export.engine_update``: the run's one kind of update),
        without a copy where there is one to read (one rank, full fine-tuning: the
        parameters themselves; sharded, each parameter's DTensor, global shapes)."""
        return engine_update(self.module, self.update_kind)

    def policy_copy(self) -> PreTrainedModel:
        """A plain model for an engine in this process (``export.engine_start``): the
        policy, or the base alone when the engines are sent adapters (they merge them)."""
        return engine_start(self.module, self.update_kind)

    def export_weights(self) -> WeightUpdate:
        """A snapshot the engines can load while the learner goes on training
        (:meth:`engine_weights`, copied). Sharded, a collective: rank 0 gets the full
        (gathered) weights on CPU, the other ranks an empty ``FullWeights``."""
        if self.update_kind != "full":
            return self.engine_weights()  # new tensors already
        if self.sharding is None:
            return FullWeights({name: p.detach().clone() for name, p in self.model.named_parameters()})
        full = self.sharding.full_state_dict(self.model)
        # the engines take parameters only (a tied LM head is the embedding, not a second tensor)
        return FullWeights({name: full[name] for name, _ in self.module.named_parameters()} if full else {})

    def save_checkpoint(self, path: Path, extra: dict[str, Any] | None = None,
                        files: dict[str, str] | None = None) -> Path:
        """Write a checkpoint of this learner to ``path`` (what it holds:
        ``checkpoint_io.write_checkpoint``), refused while any weight is NaN or infinite, so
        the last checkpoint written stays the last good one. Sharded, every rank calls it."""
        bad = self._count_nonfinite_weights()  # every rank, so all refuse together
        if bad:
            raise NonFiniteError(f"refusing to write {path}: {bad} weight tensors hold NaN or infinity; the last "
                                 "checkpoint written is the last good one")
        return write_checkpoint(self, path, extra, files, parts=self.critic.parts() if self.critic else None)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Continue from the checkpoint at ``path`` (``checkpoint_io.restore_checkpoint``);
        returns its trainer state (the critic's first: the policy's RNG streams are the ones the
        run goes on with). Sharded, every rank calls it."""
        if self.critic is not None:
            self.critic.load_checkpoint(path)
        return restore_checkpoint(self, path)


@dataclass
class _Stream:
    """A streamed step's parts so far (:meth:`Learner.accumulate`): their (token, sequence)
    counts, metric sums (the policy loss's by tokens, the learner's own by the aggregation's
    count) and micro-batch losses."""

    counts: torch.Tensor
    mismatch: torch.Tensor  # the engine–learner mismatch sums by lag (algorithms/mismatch.py)
    token_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    own_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)


def _counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """(model tokens, sequences with any) of a (B, T) loss mask, as floats."""
    return torch.stack([loss_mask.sum(), (loss_mask.sum(-1) > 0).sum().float()])
