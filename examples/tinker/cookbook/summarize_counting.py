"""Per-step figures of an ``rl_numerics_check`` run, from the recipe's own logs (README.md here).

    python summarize_counting.py LOG_PATH RUN_NAME >> runs_<date>.jsonl

One JSON line a training step, from ``LOG_PATH/iteration_*/train_rollout_summaries.jsonl`` (every
episode's turns, tool calls and end metrics, as the cookbook writes them) and
``LOG_PATH/metrics.jsonl`` (the step's sampler-vs-trainer logprob gap ``kl_sample_train_v1``,
what the recipe exists to check; gradient norm, entropy, times). An episode's last turn says how it ended:
``stop/completed`` (a reply without a tool call: the env grades its ``Answer:``) or
``stop/max_tokens`` (the reply ran past ``max_tokens`` and did not parse: −0.1) or ``stop/parse_error``
(a ``<tool_call>`` block that does not parse, e.g. one never closed: −0.1). Invariant: every
count is over all the step's episodes, so the fractions here add up where the recipe's own
``env/all/*`` means (each over the episodes that report that metric) do not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def step_figures(episodes: list[dict]) -> dict[str, float | int]:
    """The step's counts over all its episodes (``total_reward`` and ``steps`` as the cookbook logs them)."""
    ends = [e["steps"][-1]["metrics"] for e in episodes]
    calls = sum(1 for e in episodes for s in e["steps"] for key in s["logs"] if key.startswith("tool_call_"))
    return {"episodes": len(episodes),
            "reward_mean": round(sum(e["total_reward"] for e in episodes) / len(episodes), 4),
            "turns": sum(len(e["steps"]) for e in episodes),
            "read_page_calls": calls,
            "cut_at_max_tokens": sum(1 for m in ends if m.get("stop/max_tokens")),
            "unparsed_tool_call": sum(1 for m in ends if m.get("stop/parse_error")),
            "answered": sum(1 for m in ends if m.get("answer_parsed")),
            "read_all_pages": sum(1 for m in ends if m.get("read_all_pages")),
            "exact": sum(1 for m in ends if m.get("exact_match")),
            "reward_positive": sum(1 for e in episodes if e["total_reward"] > 0)}


def main(log_path: Path, run: str) -> None:
    metrics = {m["step"]: m for m in map(json.loads, (log_path / "metrics.jsonl").read_text().splitlines())}
    for folder in sorted(log_path.glob("iteration_*")):
        step = int(folder.name.split("_")[1])
        episodes = [json.loads(line) for line in (folder / "train_rollout_summaries.jsonl").read_text().splitlines()]
        row = {"run": run, "step": step, **step_figures(episodes)}
        m = metrics.get(step, {})
        for key, name, digits in (("optim/kl_sample_train_v1", "kl_sample_train_v1", 10),
                                  ("grad_norm:mean", "grad_norm", 3), ("optim/entropy", "entropy", 4),
                                  ("time/sampling", "time_sampling_s", 1), ("time/train_step", "time_train_step_s", 1),
                                  ("time/total", "time_step_s", 1)):
            if key in m:
                row[name] = round(m[key], digits)
        print(json.dumps(row))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python summarize_counting.py LOG_PATH RUN_NAME  (LOG_PATH: the recipe's log_path=)")
    if not (Path(sys.argv[1]) / "metrics.jsonl").is_file():
        sys.exit(f"summarize_counting.py: no metrics.jsonl in {sys.argv[1]}; give the recipe's log_path")
    main(Path(sys.argv[1]), sys.argv[2])
