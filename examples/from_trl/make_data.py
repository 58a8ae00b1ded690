"""Write ``examples/from_trl/data/``: a Hugging Face dataset as a TRL user has one, saved
with ``save_to_disk`` (a ``DatasetDict``: ``train`` 168 rows, ``test`` 32).

    python examples/from_trl/make_data.py [--out examples/from_trl/data]

The rows are ``examples/jsonl/data.jsonl``'s Countdown problems, the prompts the shipped
``models/countdown-tiny`` reads ("4 9 3 -> 9"), in TRL's standard format: a ``prompt``
column of text, and the columns the reward reads (``numbers``, ``target``), which reach it
as keyword arguments. A conversational dataset (``prompt`` as a list of
``{"role", "content"}`` messages) works the same way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datasets import Dataset, DatasetDict, disable_progress_bars

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "jsonl" / "data.jsonl"
NUM_TEST = 32


def rows() -> list[dict]:
    lines = [json.loads(line) for line in SOURCE.read_text().splitlines() if line.strip()]
    return [{"prompt": r["prompt"], "numbers": r["numbers"], "target": r["target"]} for r in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "data")
    out = parser.parse_args().out
    disable_progress_bars()
    data = rows()
    DatasetDict(train=Dataset.from_list(data[:-NUM_TEST]), test=Dataset.from_list(data[-NUM_TEST:])).save_to_disk(out)
    print(f"wrote {out}: train {len(data) - NUM_TEST} rows, test {NUM_TEST}")


if __name__ == "__main__":
    main()
