"""Write ``examples/jsonl/data.jsonl``: 200 Countdown-style rows, the same seed every time.

    python examples/jsonl/make_data.py [--rows 200] [--seed 0] [--out examples/jsonl/data.jsonl]

Stands in for your own data. A task file is one JSON object per line: ``prompt`` (what the
model sees) is required, ``id`` is optional, and every other field reaches the reward
function as ``task.data`` (here ``numbers`` and ``target``). The prompts use the format
the shipped ``models/countdown-tiny`` was warmed up on ("3 5 7 -> 22"): it reads nothing
else. ``solution`` is the expression a target was built from, kept for a reader; the
reward accepts any expression that uses the numbers and hits the target.
"""

from __future__ import annotations

import argparse
import json
import operator
import random
from pathlib import Path
from typing import Any

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def make_row(rng: random.Random, index: int, seen: set[str]) -> dict[str, Any]:
    """A row whose prompt is not in ``seen``: a repeated prompt could land in both the
    train rows and the held-out tail, and validation would then score memory."""
    while True:
        numbers = [rng.randint(1, 9) for _ in range(3)]
        a, b, c = rng.sample(numbers, 3)  # a random order, so the prompt's order reveals nothing
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        if rng.random() < 0.5:
            solution, target = f"({a}{op1}{b}){op2}{c}", OPS[op2](OPS[op1](a, b), c)
        else:
            solution, target = f"{a}{op1}({b}{op2}{c})", OPS[op1](a, OPS[op2](b, c))
        prompt = f"{' '.join(map(str, numbers))} -> {target}"
        if target >= 0 and prompt not in seen:
            seen.add(prompt)
            return {"id": f"row-{index:03d}", "prompt": prompt, "numbers": numbers, "target": target,
                    "solution": solution}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("data.jsonl"))
    args = parser.parse_args()
    rng, seen = random.Random(args.seed), set()
    with args.out.open("w") as f:
        for index in range(args.rows):
            f.write(json.dumps(make_row(rng, index, seen)) + "\n")
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()
