"""A local stand-in for WikiText-103, so that ``rl_numerics_check`` runs unchanged offline.

    python make_counting_corpus.py TEXT_FILE OUT_DIR     # run with the cookbook's venv

The recipe's tool-use env (``tinker_cookbook.recipes.rl_numerics_check``: read a document one
page a turn with a ``read_page`` tool, then answer how often a word occurs) cuts its pages
from ``datasets.load_dataset("Salesforce/wikitext", "wikitext-103-raw-v1", split="train")``,
a hub download, and takes no other corpus on its command line. ``datasets`` resolves a name
that is a local directory before it asks the hub, so this writes
``OUT_DIR/Salesforce/wikitext/``: a ``README.md`` declaring the config
``wikitext-103-raw-v1`` (split ``train``) and one JSON-lines file with the ``text`` column the
recipe reads, one row a line of TEXT_FILE (WikiText's rows are lines too; the recipe drops
the empty ones). Run the recipe with OUT_DIR as its working directory and it reads TEXT_FILE
instead of WikiText — the recipe's code unchanged, its corpus swapped (say so beside any figure).

Invariant: the rows are TEXT_FILE's lines in order, right-stripped, nothing else added or
dropped, so the counts the env computes are counts in that text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONFIG = "wikitext-103-raw-v1"
CARD = f"""---
configs:
- config_name: {CONFIG}
  data_files:
  - split: train
    path: {CONFIG}/train.jsonl
---
A local stand-in for Salesforce/wikitext ({CONFIG}), written by make_counting_corpus.py.
"""


def write_corpus(text_file: Path, out_dir: Path) -> Path:
    """Write the stand-in under ``out_dir``; return its directory."""
    lines = text_file.read_text(encoding="utf-8").splitlines()
    root = out_dir / "Salesforce" / "wikitext"
    (root / CONFIG).mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text(CARD, encoding="utf-8")
    with open(root / CONFIG / "train.jsonl", "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps({"text": line.rstrip()}) + "\n")
    return root


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python make_counting_corpus.py TEXT_FILE OUT_DIR  (TEXT_FILE: English prose, UTF-8)")
    source = Path(sys.argv[1])
    if not source.is_file():
        sys.exit(f"make_counting_corpus.py: {source} is not a file; give a UTF-8 text file of English prose")
    print(write_corpus(source, Path(sys.argv[2])))
