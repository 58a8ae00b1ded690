"""``asyncrl sft``: full fine-tuning of a causal LM on conversations, loss on what the
model writes (``render.py``), so a later ``asyncrl train`` starts from a policy that
already writes the tool-call format its gateway parses.

Order of work, so a mistake costs seconds: the data is read and checked, the tokenizer
renders and masks every conversation (each error named ``file:line``), and only then
are the weights loaded. Weights and AdamW state are float32 (``model.dtype``, as in
train); ``learner.autocast: bfloat16`` runs forward and backward in bf16 over them, so no
update is lost to bfloat16's 8-bit mantissa. With ``model.lora`` only LoRA adapters train
and every save is a PEFT adapter directory (``learner/lora.py``).

A step is the training core's (``asyncrl/learner/core.py``): the policy made trainable
(``trainable``), **the one micro-batch loop** RL's learner steps through too
(``MicroBatchLoop``, the loss passed in: here the cross-entropy over the assistant
tokens, each micro-batch's divided by the whole step's count), the one LR schedule, clip
and finite check. So the loop's sharding is SFT's too: with ``learner.world_size`` N,
each of N ranks (``ranks.py`` starts them) trains on its rows of every step, and they
take the step one rank takes. A checkpoint is the learner's
(``asyncrl/learner/checkpoint_io.py``: written under ``step_N.tmp`` and renamed, so a kill
mid-save leaves no half-written ``step_N``), found, tidied and rotated by the
orchestrator's own ``checkpoint.py``; a stop is the orchestrator's ``StopControl``. Nothing
is lost on a stop: a first Ctrl-C or SIGTERM finishes the step and saves
``checkpoints/step_N``; a failure says where the last saved model is; ``resume=true``
continues from the last complete checkpoint, its weights, AdamW state, schedule and RNG,
on the same order of conversations: the steps an uninterrupted run would have taken.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from asyncrl.config import ConfigError
from asyncrl.jsonl import keep_rows, row_log
from asyncrl.learner.checkpoint_io import restore_checkpoint, write_checkpoint
from asyncrl.learner.core import TrainEngine, summed_loss
from asyncrl.learner.distributed import Sharding, row_range
from asyncrl.orchestrator.announce import template_notes
from asyncrl.orchestrator.checkpoint import LEARNER_CHECKPOINT, clear_unfinished, latest_checkpoint, rotate
from asyncrl.orchestrator.stopping import StopControl
from asyncrl.policy import check_policy, load_policy
from asyncrl.rollout.gateway.tool_calls import AUTO, resolve_format
from asyncrl.seeding import derive_seed
from asyncrl.sft.batches import collate, micro_batches, step_order, trainable_examples, trained_tokens
from asyncrl.sft.config import SFTConfig, save_sft_config
from asyncrl.sft.data import Conversation, train_and_held_out
from asyncrl.sft.render import Example

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"


class SFTRun:
    """One ``asyncrl sft`` run, or one rank of it (``sharding``: the process group this
    process joined; rank 0 writes the logs and the saved model, every rank its part of a
    checkpoint). After :meth:`run` (returned or raised): ``last_saved`` is the newest
    complete model directory written (None before the first), ``interrupted`` says a
    signal stopped it, ``step`` is the last optimizer step taken, ``state`` the model in
    training (its gradients of the last step kept until the next)."""

    def __init__(self, cfg: SFTConfig, sharding: Sharding | None = None) -> None:
        self.cfg = cfg
        self.sharding = sharding
        self.is_main = sharding is None or sharding.rank == 0
        self.out = Path(cfg.output_dir)
        self.last_saved: Path | None = None
        self.interrupted = False
        self.step = 0
        self.state: TrainEngine | None = None
        self._stop = StopControl()

    def stop(self) -> None:
        """Finish the step, save ``checkpoints/step_N`` and return, as a first Ctrl-C does;
        safe from any thread."""
        self._stop.request()

    def run(self) -> Path:
        """Train; returns the saved model's directory (``output_dir``, or the checkpoint a
        stop wrote)."""
        cfg = self.cfg
        resume_from = self._resume_point()
        if resume_from is None and (self.out / METRICS_FILE).exists():
            raise ConfigError(f"output_dir {str(self.out)!r} holds an earlier run ({METRICS_FILE}); "
                              "choose another output_dir, remove that one, or continue it with resume=true")
        train_data, eval_data = self._conversations()
        tokenizer = check_policy(cfg.model)
        self._say("\n".join(f"asyncrl sft: {note}" for note in format_notes(tokenizer)))
        train, held_out = self._examples(tokenizer, train_data), self._examples(tokenizer, eval_data)
        order = self._step_order(len(train))
        torch.manual_seed(derive_seed(cfg.seed, "sft-torch"))
        model, _ = load_policy(cfg.model)
        self.state = state = TrainEngine.build(model, tokenizer, cfg.optim, len(order), lora=cfg.model.lora,
                                               seed=cfg.seed, sharding=self.sharding, autocast=cfg.learner.autocast)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._barrier()  # every rank has read output_dir before rank 0 writes into it
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        if resume_from is not None:
            restore_checkpoint(state, resume_from)
            self.step = state.version
            self.last_saved = resume_from
            if self.is_main:
                keep_rows(self.out / METRICS_FILE, through=self.step)
            self._say(f"asyncrl sft: resuming from {resume_from} (step {self.step} of {len(order)})")
        elif self.is_main:
            save_sft_config(cfg, self.out / "config.yaml")
        with row_log(self.out / METRICS_FILE, append=resume_from is not None, write=self.is_main) as log, \
                self._stop.signals("asyncrl sft"):
            if held_out and resume_from is None:
                log({"step": 0, "eval_loss": self._eval_loss(state, held_out, pad_id)})
            done = self.step
            bar = tqdm(order[done:], desc="asyncrl sft", unit="step", file=sys.stderr, dynamic_ncols=True,
                       initial=done, total=len(order), disable=not self.is_main)
            for self.step, indices in enumerate(bar, done + 1):
                began, last = time.monotonic(), self.step == len(order)
                loss, tokens, grad_norm = self._train_step(state, [train[i] for i in indices], pad_id)
                row = {"step": self.step, "loss": loss, "tokens": tokens, "lr": state.scheduler.get_last_lr()[0],
                       "grad_norm": grad_norm, "time/step": round(time.monotonic() - began, 3)}
                state.advance()  # the schedule's next step; the version is the step taken
                if held_out and (last or (cfg.eval_every and self.step % cfg.eval_every == 0)):
                    row["eval_loss"] = self._eval_loss(state, held_out, pad_id)
                log(row)
                bar.set_postfix({k: f"{row[k]:.4f}" for k in ("loss", "eval_loss") if k in row}, refresh=False)
                if self._stopping() and not last:
                    self.interrupted = True
                    return self._checkpoint(state)
                if cfg.save_every and self.step % cfg.save_every == 0 and not last:
                    self._checkpoint(state)
            bar.close()
        return self._save(state, self.out)

    def _resume_point(self) -> Path | None:
        """With ``resume=true``, the newest complete ``checkpoints/step_N`` (what a kill left
        mid-save is tidied first: the orchestrator's ``clear_unfinished``); None without
        ``resume`` or before any save."""
        if not self.cfg.resume:
            return None
        root = self.out / CHECKPOINTS_DIR
        if self.is_main:
            for note in clear_unfinished(root):
                self._say(f"asyncrl sft: {note}")
        self._barrier()
        found = latest_checkpoint(root, LEARNER_CHECKPOINT)
        if found is None:
            self._say(f"asyncrl sft: resume=true, but {root} holds no complete checkpoint: starting at step 0")
            self._barrier()  # every rank has looked before rank 0 removes the log ...
            if self.is_main:
                (self.out / METRICS_FILE).unlink(missing_ok=True)
            self._barrier()  # ... and none looks for it again before it is gone
        return found

    def _stopping(self) -> bool:
        """A stop was asked (sharded: on any rank, so every rank saves the same step)."""
        asked = self._stop.is_set()
        if self.sharding is None:
            return asked
        return bool(self.sharding.max(torch.tensor([float(asked)], device=self.sharding.device))[0])

    def _step_order(self, num_train: int) -> list[list[int]]:
        """Each step's train examples: ``epochs`` seeded passes, or as many passes as reach
        ``total_steps``, cut there."""
        cfg = self.cfg
        per_epoch = -(-num_train // cfg.batch_size)
        epochs = cfg.epochs if cfg.total_steps is None else -(-cfg.total_steps // per_epoch)
        return step_order(num_train, cfg.batch_size, epochs=epochs, seed=cfg.seed)[: cfg.total_steps]

    # -- data -----------------------------------------------------------------
    def _conversations(self) -> tuple[list[Conversation], list[Conversation]]:
        """Train and held-out conversations, all checked before anything else loads."""
        return train_and_held_out(self.cfg.data, self.cfg.seed)

    def _examples(self, tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation]) -> list[Example]:
        """Rendered and masked, what was cut or dropped said (``render.trainable_examples``)."""
        return trainable_examples(tokenizer, conversations, self.cfg.data.max_length, self._say)

    # -- a step ---------------------------------------------------------------
    def _train_step(self, state: TrainEngine, examples: list[Example], pad_id: int) -> tuple[float, int, float]:
        """One optimizer step on ``examples`` (the whole step's; sharded, this rank trains on
        its rows of them) through the training engine: (mean loss per assistant token,
        tokens, grad norm). The loss passed in is each micro-batch's summed cross-entropy
        divided by the whole step's token count, so any micro-batch split takes one step."""
        state.model.train()
        total = trained_tokens(examples)  # the whole step's, on every rank: each part's share is of it
        loss_sum = torch.zeros(())

        def loss_function(part: list[Example]) -> torch.Tensor:  # what the engine is passed
            nonlocal loss_sum
            loss = self._summed_loss(state.model, part, pad_id)
            loss_sum = loss_sum.to(loss.device) + loss.detach()
            return loss / total

        state.accumulate(self._micro_batches(self._mine(examples)), loss_function, self._filler)
        loss_sum = self._summed(loss_sum)
        sources = ", ".join(e.source for e in examples[:4])
        norm = state.step({"loss": loss_sum / total},
                          hint=f"Conversations {sources}; a lower optim.lr, or learner.autocast=off, may help")
        return (loss_sum / total).item(), total, norm  # the step's one device sync (with the norm)

    def _summed_loss(self, model: torch.nn.Module, examples: list[Example], pad_id: int) -> torch.Tensor:
        """Σ -log p over the assistant tokens of ``examples`` (one micro-batch), float32."""
        batch = collate(examples, pad_id)
        device = next(model.parameters()).device
        logits = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                       use_cache=False).logits
        return summed_loss(logits, batch.labels.to(device))

    def _eval_loss(self, state: TrainEngine, examples: list[Example], pad_id: int) -> float:
        """Mean loss per assistant token over the held-out conversations (sharded: each rank
        scores its rows, the sums added over ranks)."""
        state.model.eval()
        parts = self._micro_batches(self._mine(examples))
        total = sum((loss.cpu() for loss in state.forward(
            parts, lambda part: self._summed_loss(state.model, part, pad_id), self._filler)), torch.zeros(()))
        return round(float(self._summed(total)) / trained_tokens(examples), 6)

    def _micro_batches(self, examples: list[Example]) -> list[list[Example]]:
        optim = self.cfg.optim
        return micro_batches(examples, max_rows=optim.micro_batch_size, max_tokens=optim.micro_batch_tokens)

    def _mine(self, examples: list[Example]) -> list[Example]:
        """This rank's contiguous rows of ``examples`` (all of them on one rank)."""
        if self.sharding is None:
            return examples
        first, last = row_range(len(examples), self.sharding.rank, self.sharding.world_size)
        return examples[first:last]

    @staticmethod
    def _filler() -> list[Example]:
        """A pass with nothing to train (every label ignored): a rank's passes beyond its own."""
        return [Example("filler", [0, 0], [0, 0])]

    def _summed(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over ranks (itself on one rank)."""
        if self.sharding is None:
            return value
        return self.sharding.sum(value.to(self.sharding.device).reshape(1))[0]

    def _barrier(self) -> None:
        if self.sharding is not None:
            self.sharding.barrier()

    def _say(self, text: str) -> None:
        """A line on stderr, from rank 0 alone."""
        if self.is_main:
            tqdm.write(text, file=sys.stderr)

    # -- saving ---------------------------------------------------------------
    def _save(self, state: TrainEngine, path: Path) -> Path:
        """The final model in ``output_dir``: a Hugging Face directory (``model.path`` of
        ``asyncrl train`` takes it), or with ``model.lora`` a PEFT adapter directory.
        Sharded, every rank calls it (the weights are gathered to rank 0, which writes)."""
        weights = self.sharding.full_state_dict(state.model) if self.sharding is not None else None
        if self.is_main:
            path.mkdir(parents=True, exist_ok=True)
            state.module.save_pretrained(path, state_dict=weights)
            state.tokenizer.save_pretrained(path)
        self._barrier()
        self.last_saved = path
        return path

    def _checkpoint(self, state: TrainEngine) -> Path:
        """``checkpoints/step_N`` through the learner's checkpoint I/O (``.tmp`` then renamed:
        complete or absent; every rank writes its part), the older ones past ``keep_last``
        removed after it by the orchestrator's ``rotate``."""
        root = self.out / CHECKPOINTS_DIR
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
        self.last_saved = write_checkpoint(state, root / f"step_{self.step}")
        if self.is_main:
            rotate(root, self.cfg.keep_last, self.last_saved, LEARNER_CHECKPOINT)
        return self.last_saved


def format_notes(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The lines ``train`` and ``serve`` print (``template_notes``), for the traces: what
    asyncrl renders in place of the chat template, and the tool-call format the calls are
    rendered in, which ``gateway.tool_parser=auto`` reads back in RL."""
    try:
        tool_format = resolve_format(AUTO, tokenizer)
    except ConfigError as exc:  # the template's own format, which no built-in parser reads
        return [*template_notes(tokenizer, templated=True, tool_format=None), f"tool calls: {exc}"]
    return template_notes(tokenizer, templated=True, tool_format=tool_format)
