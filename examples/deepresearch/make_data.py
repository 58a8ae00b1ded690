"""Write the DeepResearch example's data: ``data/corpus.jsonl`` (the retrieval service's
documents), ``data/train.jsonl`` and ``data/heldout.jsonl`` (BrowseComp-Plus-shaped queries;
held-out ones over towns, companies and people no train question names).

    python examples/deepresearch/make_data.py [--out DIR] [--seed 0] [--num-people 400]

Deterministic in its arguments (asyncrl/tasks/research.py); the shipped ``data/`` is the defaults'.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asyncrl.tasks.research import write_research


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("data")))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-people", type=int, default=400)
    parser.add_argument("--num-train", type=int, default=500)
    parser.add_argument("--num-heldout", type=int, default=100)
    args = parser.parse_args()
    paths = write_research(args.out, seed=args.seed, num_people=args.num_people, num_train=args.num_train,
                           num_heldout=args.num_heldout)
    for name, path in paths.items():
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")


if __name__ == "__main__":
    main()
