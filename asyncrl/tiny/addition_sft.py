"""The addition policy: a tiny model that knows the answer but is unsure of it, so RL
has something to learn within seconds on a CPU.

A 91k-parameter Qwen2 is taught ``a+b=`` (a, b ≤ ``max_operand``) from labels of which
``label_noise`` are replaced by a random number in the answer range. It ends up sampling
the right answer about a third of the time at temperature 1 while that answer is its
single most likely one, the way a pretrained model that half-knows a task behaves. RL
(``examples/addition``) gains by concentrating on it; ``asyncrl bench staleness`` uses
the same recipe because its curves separate in minutes, not hours.

The warm-up sees every prompt (it plays the pretrained model); RL trains on the task's
train split and is scored on its validation prompts, which RL never sees.

    python -m asyncrl.tiny.addition_sft --out models/addition-tiny
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms import token_logprobs
from asyncrl.tasks import load_tasks
from asyncrl.tiny.model import build_tiny_model, save_tiny_policy
from asyncrl.tiny.sft import IGNORE_INDEX, collate, train_examples
from asyncrl.tiny.tokenizer import build_char_tokenizer

COPIES = 20  # each prompt this many times, each with its own draw of the noise
NUM_VALIDATION = 48  # of the 400 prompts a+b (a, b ≤ 19), the hash split holds out ~50


def noisy_addition_examples(tokenizer: Any, *, max_operand: int, label_noise: float,
                            seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) for ``a+b=`` → ``a+b`` or, with probability ``label_noise``, a random
    number in [0, 2·max_operand]; prompts rendered as the rollouts render them (no chat
    template, no special tokens), loss on the answer and its eos only."""
    # (the stream's name predates this module; kept so that the shipped policy and the
    # published ``bench staleness`` runs share one warm-up)
    rng = random.Random("asyncrl-bench-staleness" if seed == 0 else f"asyncrl-bench-staleness-{seed}")
    eos, top = tokenizer.eos_token_id, 2 * max_operand
    examples = []
    for _ in range(COPIES):
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                prompt = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
                label = a + b if rng.random() >= label_noise else rng.randint(0, top)
                answer = tokenizer.encode(str(label), add_special_tokens=False) + [eos]
                examples.append((prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
    return examples


@torch.no_grad()
def expected_reward(model: Any, tokenizer: Any, prompts: Sequence[tuple[int, int]]) -> float:
    """Mean over ``(a, b)`` of P(the policy writes exactly ``a+b`` then stops) at
    temperature 1: the held-out reward an evaluation would estimate, computed exactly."""
    eos = tokenizer.eos_token_id
    rows = []
    for a, b in prompts:
        prompt = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
        answer = tokenizer.encode(str(a + b), add_special_tokens=False) + [eos]
        rows.append((prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
    ids, mask, labels = collate(rows, tokenizer.pad_token_id)
    targets = labels[:, 1:]
    picked = token_logprobs(model(input_ids=ids, attention_mask=mask).logits[:, :-1], targets.clamp(min=0))
    return float((picked * (targets != IGNORE_INDEX)).sum(-1).exp().mean())


def make_addition_policy(out: str | Path, *, max_operand: int = 19, label_noise: float = 0.45, steps: int = 2500,
                         hidden_size: int = 64, seed: int = 0) -> dict[str, Any]:
    """Build, warm up and save the policy at ``out``; returns what ``base_policy.json`` holds."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, tokenizer = build_tiny_model(build_char_tokenizer(), seed=seed, hidden_size=hidden_size, num_layers=2,
                                            intermediate_size=2 * hidden_size, max_position_embeddings=32)
        examples = noisy_addition_examples(tokenizer, max_operand=max_operand, label_noise=label_noise, seed=seed)
        history = train_examples(model, examples, tokenizer.pad_token_id, steps=steps, time_budget_s=None,
                                 batch_size=64, lr=5e-3, warmup_steps=20, seed=seed, log_every=0,
                                 desc="addition warm-up")
    model.eval()
    options = {"low": 0, "high": max_operand}
    validation = load_tasks("arithmetic", seed=0, num_train=1, num_validation=NUM_VALIDATION,
                            options=options).validation
    pairs = [tuple(int(x) for x in t.prompt.rstrip("=").split("+")) for t in validation]
    save_tiny_policy(model, tokenizer, out)
    return {
        "task": "arithmetic", "options": options, "label_noise": label_noise, "copies_per_prompt": COPIES,
        "params": sum(p.numel() for p in model.parameters()), "hidden_size": hidden_size, "steps": history["steps"],
        "final_loss_ema": round(history["final_loss_ema"], 4), "wall_time_s": round(history["wall_time_s"], 1),
        "expected_val_reward": round(expected_reward(model, tokenizer, pairs), 4), "validation_prompts": len(pairs),
        "seed": seed, "torch_version": torch.__version__, "python_version": platform.python_version(),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m asyncrl.tiny.addition_sft",
                                description="Make the tiny addition base policy (noisy-label warm-up).")
    p.add_argument("--out", required=True, help="directory to write model + tokenizer + base_policy.json")
    p.add_argument("--max-operand", type=int, default=19)
    p.add_argument("--label-noise", type=float, default=0.45)
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one thread: the same weights on any machine of this kind
    record = make_addition_policy(args.out, max_operand=args.max_operand, label_noise=args.label_noise,
                                  steps=args.steps, hidden_size=args.hidden_size, seed=args.seed)
    record["command"] = ("python -m asyncrl.tiny.addition_sft "
                         + shlex.join(sys.argv[1:] if argv is None else list(argv)))
    (Path(args.out) / "base_policy.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
