"""Writes the cookbook's arithmetic problems as files ``asyncrl train`` reads (task ``hf``):

    python examples/tinker/cookbook/make_arithmetic_data.py [--steps 40] [--groups 8]

``arithmetic_train.jsonl``: the problems tinker-cookbook's ``math_rl`` arithmetic env draws for
its first ``--steps`` batches of ``--groups`` (``ArithmeticDataset.get_batch(i)`` seeds numpy's
``RandomState`` with ``i`` and draws x then y in 0..100 for each group), in that order.
``arithmetic_heldout.jsonl``: the batch of seed 1000 (``--heldout`` problems), which
``evaluate.py arithmetic`` scores the cookbook's run on. Each prompt is the env's chat:
its few-shot turn ("What is 4 + 5?" / "9") then "What is x + y?". numpy only, no cookbook.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

FEWSHOT = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]


def batch(seed: int, size: int) -> list[tuple[int, int]]:
    rng = np.random.RandomState(None)
    rng.seed(seed)
    return [(int(rng.randint(0, 101)), int(rng.randint(0, 101))) for _ in range(size)]


def rows(pairs: list[tuple[int, int]], tag: str) -> str:
    out = []
    for i, (x, y) in enumerate(pairs):
        prompt = [*FEWSHOT, {"role": "user", "content": f"What is {x} + {y}?"}]
        out.append(json.dumps({"id": f"{tag}-{i}-{x}+{y}", "prompt": prompt, "answer": x + y}))
    return "".join(line + "\n" for line in out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--heldout", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path(__file__).parent)
    a = p.parse_args()
    train = [pair for step in range(a.steps) for pair in batch(step, a.groups)]
    (a.out / "arithmetic_train.jsonl").write_text(rows(train, "train"))
    (a.out / "arithmetic_heldout.jsonl").write_text(rows(batch(1000, a.heldout), "heldout"))
    print(f"wrote {len(train)} train problems, {a.heldout} held out, under {a.out}")


if __name__ == "__main__":
    main()
