"""Write ``examples/from_verl/train.parquet`` and ``test.parquet`` in verl's schema, as
verl's ``examples/data_preprocess`` scripts write theirs.

    python examples/from_verl/make_data.py [--out examples/from_verl]

One row per problem: ``data_source`` (which ``compute_score`` a verl run dispatches to),
``prompt`` as chat messages, ``ability``, ``reward_model`` with the ``ground_truth``,
``extra_info`` with whatever else the reward needs (here the numbers). The problems are
``examples/jsonl/data.jsonl``'s Countdown rows, the prompts the shipped
``models/countdown-tiny`` reads ("4 9 3 -> 9").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datasets import Dataset, disable_progress_bars

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "jsonl" / "data.jsonl"
NUM_TEST = 32


def verl_row(row: dict, split: str, index: int) -> dict:
    return {"data_source": "countdown", "prompt": [{"role": "user", "content": row["prompt"]}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(row["target"])},
            "extra_info": {"split": split, "index": index, "numbers": row["numbers"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    out = parser.parse_args().out
    disable_progress_bars()
    lines = [json.loads(line) for line in SOURCE.read_text().splitlines() if line.strip()]
    for split, part in (("train", lines[:-NUM_TEST]), ("test", lines[-NUM_TEST:])):
        Dataset.from_list([verl_row(r, split, i) for i, r in enumerate(part)]).to_parquet(out / f"{split}.parquet")
        print(f"wrote {out / f'{split}.parquet'}: {len(part)} rows")


if __name__ == "__main__":
    main()
