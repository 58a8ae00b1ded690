"""Writes ``data.jsonl``: the 400 additions of two numbers from 1 to 20, phrased for a chat model.

    python examples/smollm2/make_data.py [--out examples/smollm2/data.jsonl]

The held-out tail (the last 64 rows, ``task.num_validation``) asks pairs that no row
before it asks in the same order, so an evaluation scores questions the policy was not
trained on. Seeded: running it again gives the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NUM_VALIDATION = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("data.jsonl"))
    out = parser.parse_args().out
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    random.Random(0).shuffle(pairs)
    rows = [{"id": f"add-{a}-{b}", "prompt": f"What is {a} + {b}? Answer with just the number.", "answer": a + b}
            for a, b in pairs]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {out}: {len(rows) - NUM_VALIDATION} train rows, {NUM_VALIDATION} held out")


if __name__ == "__main__":
    main()
