"""The learner: recomputes proximal logprobs, takes optimizer steps, exports weights,
saves Hugging Face checkpoints.

One ``train_step`` is one optimizer step and one new policy version. Micro-batches
accumulate gradients; each micro-batch's loss is weighted by its share of the batch's
tokens (or sequences), so any micro-batch size gives the same step as one big batch.
"""

from __future__ import annotations

import copy
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.algorithms import aggregate, entropy_from_logits, get_policy_loss, kl_k3
from asyncrl.config import AlgorithmConfig, OptimConfig
from asyncrl.learner.batch import TrainBatch


def lr_lambda(optim: OptimConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return 0.1 + 0.9 * decay

    return factor


class Learner:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, algorithm: AlgorithmConfig,
                 optim: OptimConfig, total_steps: int, temperature: float, version: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.algorithm = algorithm
        self.optim = optim
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts report raw logits
        self.device = next(model.parameters()).device
        self.version = version
        self.policy_loss = get_policy_loss(algorithm.policy_loss)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_steps))
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if algorithm.kl_coef > 0 else None

    # ------------------------------------------------------------------ math
    def token_logprobs(self, model: PreTrainedModel, batch: TrainBatch, *, with_entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log π(target) under ``model`` at the rollout temperature. Returns (B, L-1) tensors."""
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = logits[:, :-1].float() / self.temperature  # (B, L-1, V)
        logprobs = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        entropy = entropy_from_logits(logits.detach()) if with_entropy else None
        return logprobs, entropy

    @torch.no_grad()
    def logprobs(self, model: PreTrainedModel, batch: TrainBatch) -> torch.Tensor:
        """(B, L-1) logprobs of the whole batch, computed micro-batch by micro-batch."""
        out = torch.zeros_like(batch.behavior_logprobs)
        for start in range(0, batch.size, self.optim.micro_batch_size):
            part = batch.slice(start, start + self.optim.micro_batch_size)
            lp, _ = self.token_logprobs(model, part)
            out[start:start + part.size, :lp.shape[1]] = lp
        return out

    def train_step(self, batch: TrainBatch, *, on_policy: bool = False) -> dict[str, float]:
        """One optimizer step on ``batch``; the learner's version becomes version + 1.

        ``on_policy``: every token was sampled by the current weights, so π_prox = μ and
        the recompute (a full extra forward pass) is skipped; the step is then exactly
        the bypass form."""
        batch = batch.to(self.device)
        self.model.train()
        # π_prox: the weights at the start of this step (decoupled PPO), or μ itself (bypass).
        recompute = not (self.algorithm.bypass or on_policy)
        proximal = self.logprobs(self.model, batch) if recompute else None
        reference = self.logprobs(self.reference, batch) if self.reference is not None else None
        tokens = batch.loss_mask.sum().clamp(min=1)
        sequences = (batch.loss_mask.sum(-1) > 0).sum().clamp(min=1)
        sums: dict[str, torch.Tensor] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, batch.size, self.optim.micro_batch_size):
            part = batch.slice(start, start + self.optim.micro_batch_size)
            rows, width = slice(start, start + part.size), part.loss_mask.shape[1]
            logprobs, entropy = self.token_logprobs(self.model, part, with_entropy=True)
            loss, metrics = self.policy_loss(
                logprobs, part.behavior_logprobs, part.advantages, part.loss_mask,
                proximal_logprobs=None if proximal is None else proximal[rows, :width],
                clip_low=self.algorithm.clip_low, clip_high=self.algorithm.clip_high,
                is_cap=self.algorithm.is_cap, aggregation=self.algorithm.aggregation)
            metrics["entropy"] = aggregate(entropy, part.loss_mask, self.algorithm.aggregation)
            if reference is not None:
                kl = aggregate(kl_k3(logprobs, reference[rows, :width]), part.loss_mask, self.algorithm.aggregation)
                loss = loss + self.algorithm.kl_coef * kl
                metrics["kl_ref"] = kl.detach()
            # this micro-batch's share of the whole batch's mean
            share = (part.loss_mask.sum() / tokens if self.algorithm.aggregation == "token_mean"
                     else (part.loss_mask.sum(-1) > 0).sum() / sequences)
            (loss * share).backward()
            metrics["loss"] = loss.detach()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value.detach() * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.model.eval()
        self.version += 1
        out = {f"actor/{k}": float(v) for k, v in sums.items()}  # one device sync per step
        out.update({"actor/grad_norm": float(grad_norm), "actor/lr": self.scheduler.get_last_lr()[0],
                    "actor/tokens": float(tokens)})
        return out

    # --------------------------------------------------------- weights, state
    def export_weights(self) -> dict[str, torch.Tensor]:
        """A snapshot the engines can load while the learner goes on training."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def save_checkpoint(self, path: Path, extra: dict[str, Any] | None = None,
                        files: dict[str, str] | None = None) -> Path:
        """``path`` becomes a Hugging Face model directory with ``trainer_state.pt`` (and the
        text ``files`` of other parts) beside the weights. Written to a temporary directory
        and renamed, so a crash mid-write never leaves a half checkpoint under the final name."""
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        torch.save({"version": self.version, "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "rng": rng_state(), **(extra or {})},
                   tmp / "trainer_state.pt")
        old = path.with_name(path.name + ".old")
        if path.exists():  # set aside, not deleted, until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        return path


    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Continue from ``path``: weights, optimizer, LR schedule, RNG streams, version.
        (The KL reference, if any, stays the initial policy.) Returns the trainer state."""
        state = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
        saved = AutoModelForCausalLM.from_pretrained(path, dtype=next(self.model.parameters()).dtype)
        self.model.load_state_dict(saved.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.version = state["version"]
        return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
