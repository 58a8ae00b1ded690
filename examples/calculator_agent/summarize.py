"""What the agent did in an ``asyncrl eval`` run: pass@1, how often it called the tool, turns.

    python examples/calculator_agent/summarize.py OUTPUT_DIR [OUTPUT_DIR ...]

Reads ``eval_samples.jsonl`` (every episode's trajectories, token for token) and the
run's ``config.yaml`` (for the tokenizer), decodes what the model sampled (loss mask 1)
and counts the hermes ``<tool_call>`` blocks the gateway's parser reads as calls. Prints
one JSON line per directory:

- ``pass@1``: share of episodes with reward 1;
- ``tool_call_rate``: share of episodes with at least one parsed tool call;
- ``tool_calls_mean``, ``turns_mean``: parsed calls and model calls per episode;
- ``multi_turn_fraction``: share of episodes of two or more model calls;
- ``pass@1_with_tool`` / ``pass@1_without_tool``: pass@1 among episodes that did / did not call it;
- ``errors``: episodes that failed (an agent exception, a timeout).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from transformers import AutoTokenizer

from asyncrl.policy import resolve_model_path
from asyncrl.rollout.gateway.tool_calls import hermes


def model_texts(trajectory: dict, tokenizer, *, sampled: bool = True) -> list[str]:
    """The text of each run of sampled tokens (mask 1): one per model call; ``sampled=False``:
    each run of the environment's tokens (mask 0: template and tool results) instead."""
    runs, current = [], []
    for token, mask in zip(trajectory["response_ids"], trajectory["loss_mask"]):
        if bool(mask) == sampled:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in runs]


def summarize(output_dir: Path) -> dict:
    config = yaml.safe_load((output_dir / "config.yaml").read_text())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config["model"]["path"]))
    episodes = [json.loads(line) for line in (output_dir / "eval_samples.jsonl").read_text().splitlines()]
    rows = []
    for episode in episodes:
        trajectories = episode["trajectories"]
        turns = sum(len(t["steps"]) for t in trajectories)
        calls = sum(len(hermes(text).tool_calls) for t in trajectories for text in model_texts(t, tokenizer))
        rows.append((episode["reward"] >= 1.0, calls, turns, episode["status"] != "ok"))
    n = max(len(rows), 1)
    used = [r for r in rows if r[1] > 0]
    unused = [r for r in rows if r[1] == 0]
    return {
        "dir": str(output_dir), "episodes": len(rows),
        "pass@1": round(sum(r[0] for r in rows) / n, 4),
        "tool_call_rate": round(len(used) / n, 4),
        "tool_calls_mean": round(sum(r[1] for r in rows) / n, 3),
        "turns_mean": round(sum(r[2] for r in rows) / n, 3),
        "multi_turn_fraction": round(sum(r[2] >= 2 for r in rows) / n, 4),
        "pass@1_with_tool": round(sum(r[0] for r in used) / len(used), 4) if used else None,
        "pass@1_without_tool": round(sum(r[0] for r in unused) / len(unused), 4) if unused else None,
        "errors": sum(r[3] for r in rows),
    }


def main(argv: list[str] | None = None, *, summary=None, description: str = __doc__.splitlines()[0]) -> None:
    """One JSON line per directory of ``summary`` (default: this file's ``summarize``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("output_dirs", type=Path, nargs="+", help="directories `asyncrl eval` wrote")
    for output_dir in parser.parse_args(argv).output_dirs:
        print(json.dumps((summary or summarize)(output_dir)))


if __name__ == "__main__":
    main()
