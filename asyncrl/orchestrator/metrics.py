"""The rows a run writes, as pure functions of what a step saw: ``metrics.jsonl`` (one
per optimizer step), ``samples.jsonl`` (one per trained trajectory) and the ``eval/*``
keys. Key names are a promise to users' scripts (see the README's output table)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.evaluation import EvalResult
from asyncrl.orchestrator.buffer import ReadyGroup
from asyncrl.orchestrator.staleness import trajectory_staleness
from asyncrl.types import Trajectory


@dataclass(frozen=True)
class StepTimes:
    wall_s: float  # the step, from asking for data to the end of the weight sync
    waited_s: float  # of which the learner waited for data
    rollout_busy_s: float  # engine seconds spent generating during the step
    elapsed_s: float  # since the run started


def step_row(step: int, version: int, trained_version: int, groups: list[ReadyGroup],
             trajectories: list[Trajectory], actor: Mapping[str, float], times: StepTimes,
             finished_rewards: list[float], counters: Mapping[str, int], buffer: Mapping[str, int]) -> dict[str, Any]:
    """``finished_rewards``: every episode finished since the last step, filtered groups
    included (the unbiased view of how the policy does); ``reward/mean`` is over what
    was trained."""
    staleness = [trajectory_staleness(trained_version, t.behavior_version_min) for t in trajectories]
    rewards = [e.reward for g in groups for e in g.group.episodes]
    tokens = sum(t.num_model_tokens for t in trajectories)
    n, wall = len(trajectories), times.wall_s
    return {
        "step": step, "version": version,
        "reward/mean": sum(rewards) / len(rewards),
        "rollout/reward_mean": sum(finished_rewards) / len(finished_rewards) if finished_rewards else float("nan"),
        "rollout/episodes": len(finished_rewards),
        "staleness/mean": sum(staleness) / n, "staleness/max": max(staleness),
        "time/step": wall, "time/elapsed": times.elapsed_s,
        "trainer/idle_ratio": times.waited_s / wall,
        "rollout/idle_ratio": max(0.0, 1 - times.rollout_busy_s / wall),
        "throughput/samples_per_s": n / wall, "throughput/tokens_per_s": tokens / wall,
        "rollout/resumed_fraction": sum(t.resumed for t in trajectories) / n,
        "rollout/response_tokens_mean": tokens / n,
        **{f"buffer/{k}": v for k, v in buffer.items()},
        **{f"rollout/{k}_total": v for k, v in counters.items()},
        **actor,
    }


def sample_rows(step: int, trained_version: int, groups: list[ReadyGroup],
                decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """One row per trained trajectory. ``response`` is the decoded ``response_ids``: in a
    multi-turn episode that mixes the model's replies with the environment's turns, so
    ``response_segments`` splits it where ``loss_mask`` changes, in order:
    ``{"role": "model" | "environment", "text", "tokens"}``; their texts joined are
    ``response``."""
    rows = []
    for g in groups:
        for index, (episode, advantage) in enumerate(zip(g.group.episodes, g.group.advantages or [])):
            for t in episode.trajectories:
                response, segments = _segments(t.response_ids, t.loss_mask, decode)
                rows.append({
                    "step": step, "task_id": g.group.task_id, "group": g.start_order, "episode": index,
                    "reward": t.reward, "advantage": advantage,
                    "behavior_version_min": t.behavior_version_min,
                    "behavior_version_max": t.behavior_version_max, "trained_version": trained_version,
                    "response_tokens": t.num_model_tokens, "finish_reason": t.finish_reason,
                    "resumed": t.resumed, "num_resumes": t.num_resumes, "response": response,
                    "response_segments": segments,
                })
    return rows


def _segments(ids: list[int], loss_mask: list[int],
              decode: Callable[[list[int]], str]) -> tuple[str, list[dict[str, Any]]]:
    """``(decode(ids), segments)``: one segment per run of equal mask values.

    A segment's text is what its run adds to the decoded prefix rather than the run
    decoded alone, which can differ at its start (SentencePiece drops a leading space),
    so the texts join to exactly ``decode(ids)``. A single-turn response is one run:
    no decode beyond the one it always had.
    """
    segments: list[dict[str, Any]] = []
    text, start = "", 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and loss_mask[end] == loss_mask[start]:
            continue
        prefix = decode(ids[:end])
        # a prefix that does not extend the last one (a byte-level tokenizer whose
        # character is split between two runs): this segment is its run decoded alone,
        # and only there may the joined texts differ from `response`
        piece = prefix[len(text):] if prefix.startswith(text) else decode(ids[start:end])
        segments.append({"role": "model" if loss_mask[start] else "environment", "text": piece,
                         "tokens": end - start})
        text, start = prefix, end
    return text, segments


def eval_metrics(result: EvalResult, version: int, seconds: float) -> dict[str, float | int]:
    """``eval/version`` is the policy version scored: with evaluation in the background
    the row of step N is written when its evaluation ends, steps later."""
    return {"eval/reward_mean": result.mean_reward, **{f"eval/pass@{k}": v for k, v in result.pass_at.items()},
            "eval/num_errors": result.num_errors, "eval/version": version, "time/eval": seconds}
