"""The critic: a value model trained beside the policy, in the same learner process and
through a second :class:`~asyncrl.learner.core.TrainEngine` (``critic``,
``algorithm.advantage: gae``; docs/critic.md).

Where it runs, and why there: beside the policy on the learner's own rank(s), so it is
placed and sharded exactly as the policy is (the same ``Sharding``, the same rows of each
batch, the same micro-batches), its values never cross a transport, and a step's batch
reaches it with no second copy. The price is memory: a second model and its AdamW state on
the learner's device.

When it runs: at the learner's ``train_step``, on the batch being trained, as verl does.
Its values V_old are those of the critic's current weights, so under ``one_step_off`` and
``async`` only the behaviour logprobs μ of a batch are stale; the values and the
advantages made from them are as fresh as the critic. Per batch:

1. :meth:`Critic.targets` — V_old on every model token (no gradient), GAE's advantages and
   returns from the batch's token rewards (``algorithms/gae.py``), the advantages whitened
   over the whole batch (over all ranks) where ``algorithm.whiten_advantages`` says;
2. the policy's optimizer steps on those per-token advantages (``learner.py``);
3. :meth:`Critic.train` — the critic's optimizer steps (``critic.ppo_epochs`` ×
   ``critic.mini_batches``, one by default) of the clipped value loss against V_old and
   the returns, on the policy's micro-batches, each weighted by its share of its mini-batch
   (as the policy's loss is), refused before the weights move if the loss or its gradient
   norm is not finite; then the critic's LR schedule and version advance with the policy's.
   The value clip binds from the second step on (the first is at V = V_old).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.algorithms.correction import clean
from asyncrl.algorithms.finite import NonFiniteError
from asyncrl.algorithms.gae import gae, value_loss, whiten
from asyncrl.config import AlgorithmConfig, Config, ConfigError, CriticConfig
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.checkpoint_io import restore_checkpoint
from asyncrl.learner.core import TrainEngine, mini_batch_rows
from asyncrl.learner.distributed import Sharding
from asyncrl.learner.value_model import load_value_model, token_values
from asyncrl.policy import resolve_device, weights_dtype
from asyncrl.seeding import derive_seed

CRITIC_DIR = "critic"
"""A learner checkpoint's sub-directory holding the critic: a Hugging Face value model
(``value_model.py``: ``critic.model.path`` can start a run from it), its trainer state and
optimizer state, as ``checkpoint_io`` writes a learner's."""
Part = tuple[int | None, TrainBatch]  # (first row in the batch, the micro-batch): the learner's cut


@dataclass(frozen=True)
class Targets:
    """What the critic's values made of one batch: (B, L-1) each, 0 off the model tokens."""

    old_values: torch.Tensor  # V_old: the critic's values when the batch began to train
    returns: torch.Tensor  # GAE's R = A + V_old, the value loss's target
    advantages: torch.Tensor  # GAE's A, whitened where the config says: what the policy trains on


class Critic:
    """The value model and its own training engine (the policy's sharding and autocast, its
    own AdamW and LR schedule: ``critic.optim``)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: CriticConfig, *,
                 total_steps: int, seed: int = 0, sharding: Sharding | None = None, autocast: str | None = None,
                 version: int = 0) -> None:
        """``model``: a value model (``value_model.load_value_model``), made trainable here
        (``critic.lora``'s adapters from the run's ``seed``, or the sharded wrap)."""
        self.config = config
        self.sharding = sharding
        self.engine = TrainEngine.build(model, tokenizer, config.optim, total_steps, lora=config.lora,
                                        seed=derive_seed(seed, "critic"), sharding=sharding, autocast=autocast,
                                        version=version)

    @torch.no_grad()
    def values(self, batch: TrainBatch, parts: Sequence[Part], filler: Callable[[], Part]) -> torch.Tensor:
        """V of the state before each target token, (B, L-1) float32, micro-batch by micro-batch."""
        out = torch.zeros_like(batch.loss_mask, dtype=torch.float32)
        for (start, part), v in zip(parts, self.engine.forward(parts, lambda p: self._values(p[1]), filler)):
            if start is None:  # only the loop's own filler passes have none, and they are not zipped here
                raise RuntimeError("a micro-batch of the batch has no first row")
            out[start:start + part.size, :v.shape[1]] = v
        return out

    def targets(self, batch: TrainBatch, cut: Callable[[TrainBatch], Sequence[Part]], filler: Callable[[], Part],
                algorithm: AlgorithmConfig) -> Targets:
        """V_old, GAE's returns and advantages of ``batch`` (this rank's rows, its ``rewards``
        set, micro-batched by ``cut``). A non-finite value on a model token stops the step
        before anything moves."""
        if batch.rewards is None:
            raise ValueError("a batch for a critic needs per-token rewards (pack_batch(..., outcomes=True))")
        self.engine.model.train()  # the mode it trains in: V and V_old one function of the weights
        old = self.values(batch, cut(batch), filler)
        bad = (~torch.isfinite(old) & batch.loss_mask.bool()).sum().reshape(1)
        if int(self.sharding.sum(bad)[0] if self.sharding is not None else bad[0]):  # a sync, once a batch
            raise NonFiniteError(f"non-finite critic values at step {self.engine.version + 1}; no optimizer step "
                                 "was taken. Lower critic.optim.lr, or check the rewards (samples.jsonl)")
        advantages, returns = gae(batch.rewards, old, batch.loss_mask, gamma=algorithm.gamma, lam=algorithm.lam)
        if algorithm.whiten_advantages is not False:
            advantages = self._whiten(advantages, batch.loss_mask)
        return Targets(clean(old, batch.loss_mask.bool()), returns, advantages)

    def train(self, batch: TrainBatch, cut: Callable[[TrainBatch], Sequence[Part]], filler: Callable[[], Part],
              targets: Targets, steps: Sequence[tuple[torch.Tensor, torch.Tensor]], counts: torch.Tensor,
              algorithm: AlgorithmConfig) -> dict[str, float]:
        """The critic's optimizer steps on ``batch`` (this rank's rows): one per entry of
        ``steps`` — (this rank's rows of the mini-batch, the whole mini-batch's (token,
        sequence) counts), from :meth:`mini_batches` — each of the clipped value loss against
        the fixed V_old and returns, cut into micro-batches by ``cut``, each weighted by its
        share of the mini-batch under ``algorithm.aggregation``; then the LR schedule and
        version advance once. ``counts``: the whole batch's. From the second step on V has
        moved from V_old, so ``critic.value_clip`` can bind (one step alone is at V = V_old).
        Returns the ``critic/*`` metrics, over the whole batch and its epochs (summed over ranks)."""
        aggregation, epochs = algorithm.aggregation, self.config.ppo_epochs
        batch_tokens = counts[0].clamp(min=1)
        sums: dict[str, torch.Tensor] = {}
        norms: list[float] = []
        self.engine.model.train()
        for local, step_counts in steps:
            tokens, sequences = step_counts.clamp(min=1)
            rows_of = local.to(targets.old_values.device)
            old_values, returns = targets.old_values.index_select(0, rows_of), targets.returns.index_select(0, rows_of)
            losses: list[torch.Tensor] = []

            def loss_of(item: Part) -> torch.Tensor:
                start, part = item
                width = part.loss_mask.shape[1]

                def rows(full: torch.Tensor) -> torch.Tensor:
                    return full[start:start + part.size, :width] if start is not None else torch.zeros_like(
                        part.loss_mask)

                loss, metrics = value_loss(self._values(part), rows(old_values), rows(returns), part.loss_mask,
                                           clip=self.config.value_clip, aggregation=aggregation)
                share = (part.loss_mask.sum() / tokens if aggregation == "token_mean"
                         else (part.loss_mask.sum(-1) > 0).sum() / sequences)
                weight = part.loss_mask.sum() / batch_tokens / epochs  # its tokens' share of the batch's epochs
                for key, value in metrics.items():  # token means of the part: weighted into the batch's
                    sums[key] = sums.get(key, 0.0) + value * weight
                losses.append(loss.detach() * share)
                return loss * share

            self.engine.accumulate(cut(batch.select(local)), loss_of, filler)
            norms.append(self.engine.step({"critic/value_loss": torch.stack(losses).sum()},
                                          grad_norm_name="critic/grad_norm",
                                          hint="Lower critic.optim.lr, or check the rewards of this batch "
                                               "(samples.jsonl)"))
        self.engine.advance()
        self.engine.model.eval()
        stats = torch.stack([sums.get(k, torch.zeros((), device=counts.device)).float().reshape(())
                             for k in ("value_loss", "value_clip_frac", "returns_mean")]
                            + list(_variance_sums(targets.old_values, targets.returns, batch.loss_mask)))
        if self.sharding is not None:
            stats = self.sharding.sum(stats)
        loss, clip_frac, returns_mean, n, r, r2, d, d2 = stats.tolist()  # one sync a step
        return {"critic/value_loss": loss, "critic/value_clip_frac": clip_frac, "critic/returns_mean": returns_mean,
                "critic/explained_variance": _explained(n, r, r2, d, d2),
                "critic/grad_norm": sum(norms) / max(len(norms), 1), "critic/optimizer_steps": float(len(norms)),
                "critic/lr": self.engine.lr}

    def mini_batches(self, size: int, version: int, seed: int) -> list[torch.Tensor]:
        """The rows of each of the critic's optimizer steps on a batch of ``size``:
        ``critic.ppo_epochs`` passes of ``critic.mini_batches`` parts, cut as the policy's are
        (``core.mini_batch_rows``) but from a seed of the critic's own."""
        c = self.config
        return mini_batch_rows(size, epochs=c.ppo_epochs, mini_batches=c.mini_batches,
                               seed=derive_seed(seed, "critic_mini_batches", version))

    def parts(self) -> dict[str, TrainEngine]:
        """What a learner checkpoint holds of the critic (``checkpoint_io.write_checkpoint``'s ``parts``)."""
        return {CRITIC_DIR: self.engine}

    def load_checkpoint(self, path: Path) -> None:
        """The critic of the learner checkpoint at ``path``: weights, optimizer, schedule,
        version; a checkpoint without one (a run without a critic) is refused."""
        if not (path / CRITIC_DIR).is_dir():
            raise ConfigError(f"{path} holds no critic ({CRITIC_DIR}/): it was written by a run without one; "
                              "resume with the run's own critic and algorithm.advantage settings")
        restore_checkpoint(self.engine, path / CRITIC_DIR)

    def _values(self, part: TrainBatch) -> torch.Tensor:
        """V on ``part``'s target axis, (b, l-1): the value after token j is the state in
        which token j + 1 is chosen (``value_model.py``)."""
        return token_values(self.engine.model, part.input_ids, part.attention_mask)[:, :-1]

    def _whiten(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Advantages standardised over the whole batch's model tokens: ``gae.whiten`` on one
        rank; over several, the mean and (Bessel-corrected) std of the sums over ranks."""
        if self.sharding is None:
            return whiten(advantages, mask)
        action = mask.bool()
        advantages = clean(advantages, action)
        n, total, squares = self.sharding.sum(torch.stack([action.sum().float(), advantages.sum(),
                                                           advantages.square().sum()]))
        mean = total / n.clamp(min=1)
        std = ((squares - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
        return clean((advantages - mean) / (std + 1e-8), action)


def build_critic(cfg: Config, tokenizer: PreTrainedTokenizerBase, sharding: Sharding | None = None) -> Critic | None:
    """A run's critic (None without ``critic``): the value model at ``critic.model.path``
    (default ``model.path``: the policy's backbone with a new head) in the policy's dtype, on
    this rank's device. A new head is drawn from the run's seed alone, not from whatever the
    global RNG holds, so every placement of the learner (its thread, its own process, a
    rank) starts from the same critic."""
    if cfg.critic is None:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "value_head"))
        model = load_value_model(cfg.critic.model.path or cfg.model.path, weights_dtype(cfg.model.dtype))
    torch.nn.Module.to(model, sharding.device if sharding is not None else resolve_device(cfg.model.device))
    return Critic(model, tokenizer, cfg.critic, total_steps=cfg.total_steps, seed=cfg.seed,
                  sharding=sharding, autocast=cfg.learner.autocast)


def _variance_sums(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(n, ΣR, ΣR², Σd, Σd²) over the model tokens, d = R − V: what explained variance needs,
    summable over ranks."""
    action = mask.bool()
    returns, diff = clean(returns, action), clean(returns - values, action)
    return action.sum().float(), returns.sum(), returns.square().sum(), diff.sum(), diff.square().sum()


def _explained(n: float, r: float, r2: float, d: float, d2: float) -> float:
    """``1 − Var[R − V] / Var[R]`` from :func:`_variance_sums` (population variances, as
    ``gae.explained_variance``); 0 where the returns do not vary."""
    n = max(n, 1.0)
    var_returns = r2 / n - (r / n) ** 2
    return 1.0 - (d2 / n - (d / n) ** 2) / var_returns if var_returns > 1e-12 else 0.0
