"""What the DeepResearch agent did in an ``asyncrl eval`` run: the calculator's summary
(pass@1, tool calls and model calls per episode, ``examples/calculator_agent/summarize.py``)
plus what the environment told it: duplicate searches and refine calls per episode.

    python examples/deepresearch/summarize.py OUTPUT_DIR [OUTPUT_DIR ...]

The environment's text is each trajectory's unsampled tokens (loss mask 0 after the
prompt): the tool results, decoded. A duplicate search is a result that starts with the
guard's ``duplicate search:`` note (``asyncrl/tools/retrieval/duplicates.py``); a refine
failure one that starts ``refine failed:`` (``asyncrl/tools/retrieval/refine.py``).
Prints one JSON line per directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from transformers import AutoTokenizer

from asyncrl.plugins import load_named
from asyncrl.policy import resolve_model_path

calculator = sys.modules[load_named(
    f"{Path(__file__).parents[1] / 'calculator_agent' / 'summarize.py'}:summarize", key="deepresearch").__module__]


def summarize(output_dir: Path) -> dict:
    summary = calculator.summarize(output_dir)
    config = yaml.safe_load((output_dir / "config.yaml").read_text())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config["model"]["path"]))
    episodes = [json.loads(line) for line in (output_dir / "eval_samples.jsonl").read_text().splitlines()]
    duplicates = refine_failures = repeating = 0
    for episode in episodes:
        texts = [text for t in episode["trajectories"] for text in calculator.model_texts(t, tokenizer, sampled=False)]
        found = sum(text.count("duplicate search:") for text in texts)
        duplicates += found
        repeating += found > 0
        refine_failures += sum(text.count("refine failed:") for text in texts)
    n = max(len(episodes), 1)
    return {**summary, "duplicate_searches_mean": round(duplicates / n, 3),
            "episodes_with_duplicate_fraction": round(repeating / n, 4), "refine_failures": refine_failures}


if __name__ == "__main__":
    calculator.main(summary=summarize, description=__doc__.splitlines()[0])
