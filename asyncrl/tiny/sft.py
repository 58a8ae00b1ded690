"""Supervised warm-up that turns a random tiny Qwen2 into an unsure Countdown solver.

RL from a random init never sees a reward on Countdown, and RL from a model that samples
its best answer every time has nothing to sharpen. So the shipped base policy is made
here, by the project's own code, the way the addition and search policies are: from
**noisy** targets. Each training prompt appears ``copies`` times; each copy's target is
the task's canonical solution (``solve_countdown``) or, with probability
``label_noise``, a plausible wrong one: the same numbers in another order and other
operators, well-formed but missing the target (it scores the format bonus). The policy
learns the right answer as its single most likely one where it can, but samples it far
less often than greedy decoding finds it, as a pretrained model that half-knows a task
does; RL gains by concentrating on it. The scores it records come from the project's
evaluation (``asyncrl.tiny.scoring``).

    python -m asyncrl.tiny.sft --out models/countdown-tiny
"""

from __future__ import annotations

import argparse
import json
import platform
from types import SimpleNamespace
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from itertools import permutations
from typing import Any

import torch
from tqdm.auto import tqdm

from asyncrl.learner import core

from asyncrl.tasks import Task, load_tasks
from asyncrl.tasks.countdown import _expressions, solve_countdown
from asyncrl.tiny.model import build_tiny_model, save_tiny_policy
from asyncrl.tiny.scoring import greedy_accuracy, mean_reward
from asyncrl.tiny.tokenizer import build_char_tokenizer, chat_prompt_ids

IGNORE_INDEX = core.IGNORE  # the training core's: one constant for every supervised loop
NUM_THREADS = 2
# Defaults chosen (see base_policy.json of the shipped model) so a run on a 2-core CPU
# stops with greedy validation accuracy in the 25-45 % band; the step count is the
# reproducible stopping rule, the minutes only a cap for a slow, shared machine.
DEFAULT_MODEL: dict[str, int] = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                                 "intermediate_size": 384, "max_position_embeddings": 128}
DEFAULT_STEPS = 1000
DEFAULT_MINUTES = 60.0
# A small slice of the ~8.6k train-split prompts: RL then mostly meets prompts the warm-up
# never saw, so what it learns must generalise (the validation split is unseen by both).
DEFAULT_NUM_TRAIN = 4_000
DEFAULT_NUM_VALIDATION = 256
DEFAULT_LABEL_NOISE = 0.5
DEFAULT_COPIES = 16
DEFAULT_LR = 3e-3


# ----------------------------------------------------------------------------- examples


def wrong_expressions(task: Task, ops: str = "+-*") -> list[str]:
    """Every expression over ``task``'s numbers (any order, ``ops``, both shapes, only the
    parentheses precedence needs) whose value is not the target, sorted: the noisy
    teacher's wrong answers. Each scores ``FORMAT_REWARD``, never 1."""
    numbers = [int(n) for n in task.data["numbers"]]
    target = Fraction(int(task.data["target"]))
    return sorted({text for order in dict.fromkeys(permutations(numbers))
                   for text, _, value, _ in _expressions(order, ops) if value != target})


def sft_examples(tokenizer: Any, tasks: Sequence[Task], *, label_noise: float = 0.0, copies: int = 1,
                 seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels): ``copies`` per task, chat prompt + target + eos, loss only on
    the target. A copy's target is the canonical solution, or with probability
    ``label_noise`` (a seeded draw per copy) one of ``wrong_expressions(task)`` at random.

    The prompt is rendered exactly as rollouts render it (``chat_prompt_ids``), so the
    warm-up teaches the very continuation the RL engine will sample.
    """
    if not 0 <= label_noise < 1:
        raise ValueError(f"label_noise must be in [0, 1), got {label_noise}")
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    rng = random.Random(f"countdown-label-noise-{seed}")
    eos = tokenizer.eos_token_id
    examples = []
    for task in tasks:
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": task.prompt}])
        solution, wrong = solve_countdown(task), None
        for _ in range(copies):
            text = solution
            if label_noise and rng.random() < label_noise:
                wrong = wrong if wrong is not None else wrong_expressions(task)
                text = rng.choice(wrong) if wrong else solution  # a task with no wrong answer keeps its own
            answer = list(tokenizer.encode(text, add_special_tokens=False)) + [eos]
            examples.append((prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
    return examples


def collate(
    examples: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest row: (input_ids, attention_mask, labels), the training
    core's collate (``asyncrl.learner.core.collate``)."""
    batch = core.collate(examples, pad_id)
    return batch.input_ids, batch.attention_mask, batch.labels


def batch_loss(model: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (answer) positions: the core's
    summed loss over their count."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    return core.summed_loss(logits, labels) / (labels[:, 1:] != IGNORE_INDEX).sum().clamp(min=1)


# ----------------------------------------------------------------------------- training


def supervised_warmup(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    *,
    steps: int,
    time_budget_s: float | None = None,
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup_steps: int = 50,
    seed: int = 0,
    log_every: int = 50,
    eval_fn: Callable[[Any], float] | None = None,
    label_noise: float = 0.0,
    copies: int = 1,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place on ``tasks``' solutions, noisy as ``sft_examples`` says.

    Stops at ``steps`` or ``time_budget_s``, whichever comes first. The cosine horizon
    is ``steps`` (so a run is reproducible: data order comes from ``seed``); the time
    budget only caps it.
    ``eval_fn(model)`` runs every ``log_every`` steps (e.g. a quick greedy accuracy).
    Returns ``{"steps", "final_loss", "initial_loss", "wall_time_s", "stopped_by", "log"}``.
    """
    if steps is None:
        raise ValueError("supervised_warmup needs `steps` (the learning rate's horizon); time_budget_s only caps it")
    if not tasks:
        raise ValueError("supervised_warmup needs at least one task")
    examples = sft_examples(tokenizer, tasks, label_noise=label_noise, copies=copies, seed=seed)
    return train_examples(model, examples, tokenizer.pad_token_id, steps=steps,
                          time_budget_s=time_budget_s, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps,
                          seed=seed, log_every=log_every, eval_fn=eval_fn)


def train_examples(
    model: Any,
    examples: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    *,
    steps: int,
    time_budget_s: float | None,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    seed: int,
    log_every: int,
    eval_fn: Callable[[Any], float] | None = None,
    desc: str = "sft",
    length_buckets: bool = False,
) -> dict[str, Any]:
    """The supervised loop over ready (ids, labels) examples, its steps the training core's
    (``asyncrl.learner.core``: AdamW, the one LR schedule — warm-up, then cosine from step 0
    to 0 at ``steps`` — gradient clip 1.0 and the finite check); seeded epochs. Shared by the
    Countdown, addition and search warm-ups.

    ``length_buckets``: batch examples of similar length (sorted within windows of 32
    batches of a shuffled epoch, the batches then shuffled), so a batch pads little; for
    traces whose lengths vary 3x this halves the cost of a step."""
    rng = random.Random(seed)
    order: list[int] = []
    schedule = SimpleNamespace(lr=lr, betas=(0.9, 0.95), weight_decay=0.01, warmup_steps=max(1, warmup_steps),
                               schedule="cosine")
    engine = core.TrainEngine.build(model, None, schedule, steps, autocast="off", grad_clip=1.0, floor=0.0,
                                    decay_start=0)
    passed: list[torch.Tensor] = []  # the loss of the last pass, for the clip's check and the log

    def mean_loss(part: tuple[torch.Tensor, ...]) -> torch.Tensor:  # the loss the core's loop is passed
        passed[:] = [batch_loss(model, *part)]
        return passed[0]

    was_training = model.training
    model.train()

    log: list[dict[str, float]] = []
    initial_loss = final_loss = float("nan")
    ema: float | None = None
    step, stopped_by = 0, "steps"
    start = time.perf_counter()
    bar = tqdm(total=steps, desc=desc, unit="step", dynamic_ncols=True, mininterval=1.0)
    try:
        while step < steps:
            if time_budget_s is not None and time.perf_counter() - start >= time_budget_s:
                stopped_by = "time"
                break
            if len(order) < batch_size:  # reshuffle per epoch; a seeded RNG fixes the order
                epoch = list(range(len(examples)))
                rng.shuffle(epoch)
                if length_buckets:
                    epoch = _bucketed(epoch, [len(ids) for ids, _ in examples], batch_size, rng)
                order.extend(epoch)
            batch = [examples[i] for i in order[:batch_size]]
            del order[:batch_size]

            engine.accumulate([collate(batch, pad_id)], mean_loss)  # one pass: the step's whole batch
            loss = passed[-1]
            engine.step({"loss": loss}, hint="lower the warm-up's learning rate")
            step = engine.advance()

            final_loss = loss.item()
            if step == 1:
                initial_loss = final_loss
            ema = final_loss if ema is None else 0.95 * ema + 0.05 * final_loss
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{engine.lr:.1e}", refresh=False)
            if log_every and step % log_every == 0:
                entry = {"step": step, "loss": round(ema, 4), "time_s": round(time.perf_counter() - start, 1)}
                if eval_fn is not None:
                    model.eval()
                    entry["eval"] = eval_fn(model)
                    model.train()
                log.append(entry)
                bar.write(json.dumps(entry))
    finally:
        bar.close()
        model.train(was_training)
    return {
        "steps": step,
        "initial_loss": initial_loss,
        "final_loss": final_loss,
        "final_loss_ema": ema,
        "wall_time_s": time.perf_counter() - start,
        "stopped_by": stopped_by,
        "log": log,
    }


# ----------------------------------------------------------------------------- CLI


def _bucketed(epoch: list[int], lengths: list[int], batch_size: int, rng: random.Random) -> list[int]:
    """``epoch`` reordered so consecutive ``batch_size`` runs hold similar lengths."""
    window = 32 * batch_size
    batches = []
    for start in range(0, len(epoch), window):
        chunk = sorted(epoch[start:start + window], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return [i for batch in batches for i in batch]


def add_model_flags(p: argparse.ArgumentParser, defaults: dict[str, int]) -> None:
    """The tiny model's shape as flags; short CLI names, ``dest`` the build_tiny_model keyword."""
    for flag, key in (("--hidden-size", "hidden_size"), ("--layers", "num_layers"), ("--heads", "num_heads"),
                      ("--kv-heads", "num_kv_heads"), ("--intermediate-size", "intermediate_size"),
                      ("--max-positions", "max_position_embeddings")):
        p.add_argument(flag, dest=key, type=int, default=defaults[key])


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m asyncrl.tiny.sft",
        description="Make the tiny Countdown base policy by a short supervised warm-up.",
    )
    p.add_argument("--out", required=True, help="directory to write model + tokenizer + base_policy.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps (the stopping rule)")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="wall-clock cap on training")
    p.add_argument("--num-train", type=int, default=DEFAULT_NUM_TRAIN)
    p.add_argument("--num-validation", type=int, default=DEFAULT_NUM_VALIDATION)
    p.add_argument("--label-noise", type=float, default=DEFAULT_LABEL_NOISE,
                   help="share of targets replaced by a wrong expression over the same numbers")
    p.add_argument("--copies", type=int, default=DEFAULT_COPIES,
                   help="copies of each prompt, each with its own noise draw")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; one (the default) is fastest on a shared 2-core machine, and the weights "
                        "depend on it")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every-log", action="store_true", help="greedy accuracy on 64 val tasks at each log")
    add_model_flags(p, DEFAULT_MODEL)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Build, train, evaluate and save the base policy; returns what base_policy.json holds."""
    import transformers

    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m asyncrl.tiny.sft " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    model_kwargs = {key: getattr(args, key) for key in DEFAULT_MODEL}
    tokenizer = build_char_tokenizer()
    model, tokenizer = build_tiny_model(tokenizer, args.seed, **model_kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    splits = load_tasks(
        "countdown", seed=args.seed, num_train=args.num_train, num_validation=args.num_validation
    )
    print(f"model: {n_params:,} params {model_kwargs}; train {len(splits.train)}, val {len(splits.validation)}")

    eval_fn = None
    if args.eval_every_log:
        quick = splits.validation[:64]
        eval_fn = lambda m: greedy_accuracy(m, tokenizer, quick)
    history = supervised_warmup(
        model, tokenizer, splits.train, steps=args.steps,
        time_budget_s=args.minutes * 60 if args.minutes else None, batch_size=args.batch_size, lr=args.lr,
        warmup_steps=args.warmup_steps, seed=args.seed, log_every=args.log_every, eval_fn=eval_fn,
        label_noise=args.label_noise, copies=args.copies,
    )
    model.eval()
    acc = greedy_accuracy(model, tokenizer, splits.validation)
    sampled = mean_reward(model, tokenizer, splits.validation, temperature=1.0, seed=args.seed)
    out = save_tiny_policy(model, tokenizer, args.out)
    record = {
        "command": command,
        "seed": args.seed,
        "task": "countdown",
        "num_train": args.num_train,
        "num_validation": args.num_validation,
        "params": n_params,
        "model": model_kwargs,
        "label_noise": args.label_noise,
        "copies_per_prompt": args.copies,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "steps_requested": args.steps,
        "time_cap_s": args.minutes * 60 if args.minutes else None,
        "steps": history["steps"],
        "stopped_by": history["stopped_by"],
        "wall_time_s": round(history["wall_time_s"], 1),
        "final_loss": round(history["final_loss"], 4),
        "final_loss_ema": round(history["final_loss_ema"], 4),
        "greedy_val_accuracy": acc,
        "sampled_val_mean_reward": round(sampled, 4),
        "sampled_temperature": 1.0,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "num_threads": args.threads,
    }
    (out / "base_policy.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in (
        "params", "steps", "stopped_by", "wall_time_s", "final_loss", "greedy_val_accuracy",
        "sampled_val_mean_reward")}))
    print(f"saved to {out}")
    return record


if __name__ == "__main__":
    main()
