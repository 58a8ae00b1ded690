"""``asyncrl sft``: full fine-tuning of a causal LM on conversations, loss on what the
model writes (``render.py``), so a later ``asyncrl train`` starts from a policy that
already writes the tool-call format its gateway parses.

Order of work, so a mistake costs seconds: the data is read and checked, the tokenizer
renders and masks every conversation (each error named ``file:line``), and only then
are the weights loaded. Weights and AdamW state stay float32; ``model.dtype: bfloat16``
runs forward and backward under autocast, so no update is lost to bfloat16's 8-bit
mantissa. With ``model.lora`` only LoRA adapters train and every save is a PEFT adapter
directory (``learner/lora.py``).

The optimizer step is the training core's (``asyncrl/learner/core.py``: the one LR
schedule, AdamW over what trains, the share-weighted backward, clip and finite check), and
a checkpoint is the learner's (``asyncrl/learner/checkpoint_io.py``: written under
``step_N.tmp`` and renamed, so a kill mid-save leaves no half-written ``step_N``).
Nothing is lost on a stop: a first Ctrl-C or SIGTERM finishes the step and saves
``checkpoints/step_N``; a failure says where the last saved model is; ``resume=true``
continues from the last complete checkpoint, its weights, AdamW state, schedule and RNG,
on the same order of conversations: the steps an uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import ConfigError
from asyncrl.learner.checkpoint_io import restore_checkpoint, write_checkpoint
from asyncrl.learner.core import TrainState, accumulate, clip_and_step, summed_loss
from asyncrl.orchestrator.announce import template_notes
from asyncrl.policy import check_policy, load_policy
from asyncrl.rollout.gateway.tool_calls import AUTO, resolve_format
from asyncrl.seeding import derive_seed
from asyncrl.sft.batches import collate, micro_batches, step_order, trained_tokens
from asyncrl.sft.config import SFTConfig, save_sft_config
from asyncrl.sft.data import Conversation, load_conversations
from asyncrl.sft.render import Example, build_examples

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"


class SFTRun:
    """One ``asyncrl sft`` run. After :meth:`run` (returned or raised): ``last_saved`` is the
    newest complete model directory written (None before the first), ``interrupted`` says
    a signal stopped it, ``step`` is the last optimizer step taken."""

    def __init__(self, cfg: SFTConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.last_saved: Path | None = None
        self.interrupted = False
        self.step = 0
        self._stop = threading.Event()

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
        tqdm.write("\n".join(f"asyncrl sft: {note}" for note in format_notes(tokenizer)), file=sys.stderr)
        train, held_out = self._examples(tokenizer, train_data), self._examples(tokenizer, eval_data)
        order = self._step_order(len(train))
        torch.manual_seed(derive_seed(cfg.seed, "sft-torch"))
        model, _ = load_policy(cfg.model.model_copy(update={"dtype": "float32"}))  # master weights: see the docstring
        state = TrainState.build(model, tokenizer, cfg.optim, len(order), lora=cfg.model.lora,
                                 seed=derive_seed(cfg.seed, "lora"))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.out.mkdir(parents=True, exist_ok=True)
        if resume_from is not None:
            restore_checkpoint(state, resume_from)
            self.step = state.version
            self.last_saved = resume_from
            _keep_rows(self.out / METRICS_FILE, through=self.step)
            tqdm.write(f"asyncrl sft: resuming from {resume_from} (step {self.step} of {len(order)})", file=sys.stderr)
        else:
            save_sft_config(cfg, self.out / "config.yaml")
        with _metrics(self.out / METRICS_FILE, append=resume_from is not None) as log, self._signals():
            if held_out and resume_from is None:
                log({"step": 0, "eval_loss": self._eval_loss(state.model, held_out, pad_id)})
            done = self.step
            bar = tqdm(order[done:], desc="asyncrl sft", unit="step", file=sys.stderr, dynamic_ncols=True,
                       initial=done, total=len(order))
            for self.step, indices in enumerate(bar, done + 1):
                began, last = time.monotonic(), self.step == len(order)
                loss, tokens, grad_norm = self._train_step(state.model, state.optimizer, [train[i] for i in indices],
                                                           pad_id)
                row = {"step": self.step, "loss": loss, "tokens": tokens, "lr": state.scheduler.get_last_lr()[0],
                       "grad_norm": grad_norm, "time/step": round(time.monotonic() - began, 3)}
                state.scheduler.step()
                state.version = self.step
                if held_out and (last or (cfg.eval_every and self.step % cfg.eval_every == 0)):
                    row["eval_loss"] = self._eval_loss(state.model, held_out, pad_id)
                log(row)
                bar.set_postfix({k: f"{row[k]:.4f}" for k in ("loss", "eval_loss") if k in row}, refresh=False)
                if self._stop.is_set() and not last:
                    self.interrupted = True
                    return self._checkpoint(state)
                if cfg.save_every and self.step % cfg.save_every == 0 and not last:
                    self._checkpoint(state)
            bar.close()
        return self._save(state, self.out)

    def _resume_point(self) -> Path | None:
        """With ``resume=true``, the newest complete ``checkpoints/step_N`` (a ``step_N.tmp``
        a kill left mid-save is not one); None without ``resume`` or before any save."""
        if not self.cfg.resume:
            return None
        root = self.out / CHECKPOINTS_DIR
        steps = sorted((int(m.group(1)), p) for p in root.glob("step_*")
                       if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / "trainer_state.pt").is_file())
        if not steps:
            tqdm.write(f"asyncrl sft: resume=true, but {root} holds no complete checkpoint: starting at step 0",
                       file=sys.stderr)
            (self.out / METRICS_FILE).unlink(missing_ok=True)
            return None
        return steps[-1][1]

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
        data = self.cfg.data
        train = load_conversations(data.train)
        held_out = load_conversations(data.eval) if data.eval else []
        if data.eval_fraction:
            if len(train) < 2:
                raise ConfigError(f"data.eval_fraction={data.eval_fraction}: {len(train)} conversation cannot be "
                                  "split; give data.eval files or more conversations")
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(
                derive_seed(self.cfg.seed, "sft-eval-split"))).tolist()
            n = min(len(train) - 1, max(1, round(len(train) * data.eval_fraction)))
            held_out, train = [train[i] for i in sorted(order[:n])], [train[i] for i in sorted(order[n:])]
        return train, held_out

    def _examples(self, tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation]) -> list[Example]:
        """Rendered and masked; truncation said, and conversations left with nothing to
        train dropped (said too). Raises ``DataError`` when no train example is left."""
        max_length = self.cfg.data.max_length
        built = build_examples(tokenizer, conversations, max_length)
        kept = [e for e in built if trained_tokens([e])]
        cut = sum(e.truncated for e in built)
        if not conversations:
            return kept
        lengths = sorted(len(e.ids) for e in built)
        tqdm.write(f"asyncrl sft: {len(kept)} conversations from {_sources(conversations)}, "
                   f"{sum(trained_tokens([e]) for e in kept)} assistant tokens of {sum(lengths)}, "
                   f"length median {lengths[len(lengths) // 2]} max {lengths[-1]}"
                   + (f"; {cut} cut at data.max_length={max_length}" if cut else "")
                   + (f", {len(built) - len(kept)} dropped with no assistant token left" if len(kept) < len(built)
                      else ""), file=sys.stderr)
        if not kept:
            raise ConfigError(f"no conversation of {_sources(conversations)} has an assistant token within "
                              f"data.max_length={max_length}: raise it")
        return kept

    # -- a step ---------------------------------------------------------------
    def _train_step(self, model: PreTrainedModel, optimizer: torch.optim.Optimizer, examples: list[Example],
                    pad_id: int) -> tuple[float, int, float]:
        """One optimizer step on ``examples`` through the training core: (mean loss per
        assistant token, tokens, grad norm)."""
        model.train()
        total = trained_tokens(examples)
        parts = micro_batches(examples, max_rows=self.cfg.optim.micro_batch_size,
                              max_tokens=self.cfg.optim.micro_batch_tokens)
        loss_sum = accumulate(parts, lambda part: self._summed_loss(model, part, pad_id), total)
        sources = ", ".join(e.source for e in examples[:4])
        norm = clip_and_step(model, optimizer, self.cfg.optim.grad_clip, {"loss": loss_sum / total}, step=self.step,
                             hint=f"Conversations {sources}; a lower optim.lr, or model.dtype=float32, may help")
        optimizer.zero_grad(set_to_none=True)
        return (loss_sum / total).item(), total, norm  # the step's one device sync (with the norm)

    def _summed_loss(self, model: PreTrainedModel, examples: list[Example], pad_id: int) -> torch.Tensor:
        batch = collate(examples, pad_id)
        device = model.device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.cfg.model.dtype == "bfloat16"):
            logits = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                           use_cache=False).logits
        return summed_loss(logits, batch.labels.to(device))

    @torch.no_grad()
    def _eval_loss(self, model: PreTrainedModel, examples: list[Example], pad_id: int) -> float:
        """Mean loss per assistant token over the held-out conversations."""
        model.eval()
        total = sum(self._summed_loss(model, part, pad_id).cpu() for part in micro_batches(
            examples, max_rows=self.cfg.optim.micro_batch_size, max_tokens=self.cfg.optim.micro_batch_tokens))
        return round(float(total) / trained_tokens(examples), 6)

    # -- saving ---------------------------------------------------------------
    def _save(self, state: TrainState, path: Path) -> Path:
        """The final model in ``output_dir``: a Hugging Face directory (``model.path`` of
        ``asyncrl train`` takes it), or with ``model.lora`` a PEFT adapter directory."""
        path.mkdir(parents=True, exist_ok=True)
        state.module.save_pretrained(path)
        state.tokenizer.save_pretrained(path)
        self.last_saved = path
        return path

    def _checkpoint(self, state: TrainState) -> Path:
        """``checkpoints/step_N`` through the learner's checkpoint I/O (``.tmp`` then renamed:
        complete or absent), the older ones past ``keep_last`` deleted after it."""
        root = self.out / CHECKPOINTS_DIR
        root.mkdir(parents=True, exist_ok=True)
        self.last_saved = write_checkpoint(state, root / f"step_{self.step}")
        saved = sorted((p for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name)),
                       key=lambda p: int(p.name.removeprefix("step_")))
        for old in saved[: -self.cfg.keep_last]:
            shutil.rmtree(old)
        return self.last_saved

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """A first SIGINT/SIGTERM finishes the step and saves; a second stops at once
        (``KeyboardInterrupt``). Main thread only: Python gives signals to no other."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: object) -> None:
            if self._stop.is_set():
                raise KeyboardInterrupt
            self._stop.set()
            tqdm.write("asyncrl sft: stopping: finishing the step and saving the model; a second Ctrl-C or "
                       "SIGTERM stops at once, without saving", file=sys.stderr)

        before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in before.items():
                signal.signal(sig, old)


@contextlib.contextmanager
def _metrics(path: Path, *, append: bool = False) -> Iterator[Callable[[dict[str, float | int]], None]]:
    """``metrics.jsonl``: one JSON row a line, flushed as written (a crash loses no row),
    each with ``time/elapsed`` since the file was opened; ``append``: after a resume."""
    start = time.monotonic()
    with path.open("a" if append else "w") as f:
        def log(row: dict[str, float | int]) -> None:
            f.write(json.dumps({**row, "time/elapsed": round(time.monotonic() - start, 3)}) + "\n")
            f.flush()

        yield log


def format_notes(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The lines ``train`` and ``serve`` print (``template_notes``), for the traces: what
    asyncrl renders in place of the chat template, and the tool-call format the calls are
    rendered in, which ``gateway.tool_parser=auto`` reads back in RL."""
    try:
        tool_format = resolve_format(AUTO, tokenizer)
    except ConfigError as exc:  # the template's own format, which no built-in parser reads
        return [*template_notes(tokenizer, templated=True, tool_format=None), f"tool calls: {exc}"]
    return template_notes(tokenizer, templated=True, tool_format=tool_format)


def _keep_rows(path: Path, *, through: int) -> None:
    """``metrics.jsonl`` cut back to the rows of steps ``through`` and before: the steps a
    resumed run takes again are logged again, once."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= through]
    path.write_text("".join(row + "\n" for row in rows))


def _sources(conversations: list[Conversation]) -> str:
    files = sorted({c.source.rsplit(":", 1)[0] for c in conversations})
    return ", ".join(files)
