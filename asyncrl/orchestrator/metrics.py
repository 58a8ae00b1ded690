"""The rows a run writes, as pure functions of what a step saw: ``metrics.jsonl`` (one
per optimizer step), ``samples.jsonl`` (one per trained trajectory) and the ``eval/*``
keys. Key names are a promise to users' scripts (docs/usage.md lists them)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from asyncrl.rollout.eval_scoring import EVAL_SAMPLE, EvalResult
from asyncrl.rollout.gateway.tool_calls import ToolParser
from asyncrl.jsonl import read_jsonl
from asyncrl.modes import trajectory_staleness
from asyncrl.orchestrator.buffer import ReadyGroup
from asyncrl.types import AgentDiagnostics, Episode, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class StepTimes:
    wall_s: float  # the step, from asking for data to the end of the weight sync
    waited_s: float  # of which the learner waited for data
    rollout_busy_s: float  # engine seconds spent generating during the step
    elapsed_s: float  # since the run started


def step_row(step: int, version: int, trained_version: int, groups: list[ReadyGroup],
             trajectories: list[Trajectory], actor: Mapping[str, float], times: StepTimes,
             finished_rewards: list[float], counters: Mapping[str, int], buffer: Mapping[str, int],
             filtered_fraction_window: float | None = None) -> dict[str, Any]:
    """``finished_rewards``: every episode finished since the last step, filtered groups
    included (the unbiased view of how the policy does); ``reward/mean`` is over what
    was trained. ``filtered_fraction_window``: of the last ``watchdog.starvation_window``
    groups, the fraction filtered (what the starvation guard judges)."""
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
        "rollout/resumes": sum(t.num_resumes for t in trajectories),  # aborts resumed in what this step trains
        "rollout/response_tokens_mean": tokens / n,
        # chat turns whose template rewrote earlier turns, so they began a new trajectory (asyncrl/rollout/client.py)
        "rollout/template_rewrites": sum(e.metadata.get("template_rewrites", 0)
                                         for g in groups for e in g.group.episodes),
        # trained groups of two or more whose samples all scored the same: advantage 0, nothing learned
        # (none when algorithm.filter_zero_variance drops them; a constant reward makes it 1)
        "rollout/same_score_fraction": sum(len(g.group.episodes) > 1 and len({e.reward for e in g.group.episodes}) == 1
                                           for g in groups) / len(groups),
        # finished episodes none of whose trajectories holds a model token: nothing of them trained
        # (buffer.trainable); an error episode's are counted in rollout/episodes_error_total
        "rollout/untrainable_episodes": sum(e.status == "ok" and not any(t.num_model_tokens for t in e.trajectories)
                                            for g in groups for e in g.group.episodes),
        **{f"buffer/{k}": v for k, v in buffer.items()},
        # since the run began: groups accepted / filtered / all_error, saturated / hopeless (all
        # samples scored the same, solved or not), stale_dropped_trajectories / _tokens (the
        # groups in buffer/stale_dropped_total), deadline_waits, sampler_skipped, episodes_error, …
        **{f"rollout/{k}_total": v for k, v in counters.items()},
        **({} if filtered_fraction_window is None else {"rollout/filtered_fraction_window": filtered_fraction_window}),
        **agent_metrics([e for g in groups for e in g.group.episodes]),
        **reward_part_means([e for g in groups for e in g.group.episodes]),
        **turn_reward_mean([e for g in groups for e in g.group.episodes]),
        **frozen_model_metrics([e for g in groups for e in g.group.episodes]),
        **sandbox_metrics([e for g in groups for e in g.group.episodes]),
        **distill_metrics(trajectories),
        **actor,
    }


def distill_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """``distill/reverse_kl``: the mean over trained model tokens of ``μ − τ`` (student's
    sampling logprob minus the teacher's), the sampled estimate of KL(student ‖ teacher)
    per token; absent without a teacher."""
    gaps = [mu - tau for t in trajectories if t.teacher_logprobs is not None
            for mu, tau, m in zip(t.logprobs, t.teacher_logprobs, t.loss_mask) if m]
    return {"distill/reverse_kl": sum(gaps) / len(gaps)} if gaps else {}


FROZEN_ROLES = ("judge", "teacher")  # asyncrl/frozen: each failure names "the <role> at <url>"


def frozen_model_metrics(episodes: list[Episode]) -> dict[str, float | int]:
    """``reward/seconds_mean`` (the reward's time per episode, a judge's calls included) and
    ``<role>/failures``: the failed attempts of these episodes that a judge or teacher caused
    (each retried; an episode that ran out of attempts is in ``rollout/episodes_error_total``)."""
    row: dict[str, float | int] = {}
    seconds = [e.timings["reward_s"] for e in episodes if "reward_s" in e.timings]
    if seconds:
        row["reward/seconds_mean"] = sum(seconds) / len(seconds)
    for role in FROZEN_ROLES:
        failures = sum(f"the {role} at " in error.exception for e in episodes for error in e.errors)
        if failures:
            row[f"{role}/failures"] = failures
    return row


def judge_calls(episode: Episode) -> tuple[int, int]:
    """``(calls, failures)`` of the judge by URL in ``episode``'s attempts, for a run whose
    reward names it: each failed attempt whose error names the judge is a failed call (one
    call of the client, its retries included, or a reply with no grade), and an episode that
    ended ``ok`` was graded by one call that answered. An attempt that failed before its
    reward ran (or at the reward's own deadline, whose error names no judge) is neither."""
    failures = sum("the judge at " in error.exception for error in episode.errors)
    return failures + (episode.status == "ok"), failures


def sandbox_metrics(episodes: list[Episode]) -> dict[str, float]:
    """``sandbox/seconds_mean``: the wall seconds of ``asyncrl.tools.sandbox`` runs per episode, over the
    episodes that ran any (``timings["sandbox_s"]``, the ``openai_agent`` workflow's); no key when none did."""
    seconds = [e.timings["sandbox_s"] for e in episodes if "sandbox_s" in e.timings]
    return {"sandbox/seconds_mean": sum(seconds) / len(seconds)} if seconds else {}


def reward_part_means(episodes: list[Episode]) -> dict[str, float]:
    """``reward/<name>/mean`` for each function of a weighted ``task.reward_fn`` list, over the
    episodes it scored (``None``: not applicable, left out, as TRL's ``nanmean``)."""
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for name, value in episode.rewards.items():
            values.setdefault(name, [])
            if value is not None:
                values[name].append(value)
    return {f"reward/{name}/mean": sum(v) / len(v) if v else float("nan") for name, v in values.items()}


def turn_reward_mean(episodes: list[Episode]) -> dict[str, float]:
    """``reward/turn_mean``: the trained episodes' per-turn rewards (``Step.reward``) summed
    per episode, averaged; absent where no episode has any (``reward/mean`` is the outcome's)."""
    sums = [e.total_reward - e.reward for e in episodes]
    return {"reward/turn_mean": sum(sums) / len(sums)} if any(sums) else {}


def agent_metrics(episodes: list[Episode]) -> dict[str, float | int]:
    """The ``agent/*`` keys: means over the episodes that carry ``metadata["agent"]``
    (multi-turn and agent workflows), none at all when no episode does (single-turn)."""
    records = [AgentDiagnostics.from_dict(e.metadata["agent"]) for e in episodes if "agent" in e.metadata]
    if not records:  # none repeated a search: the doctor's check then reads 0, not "not logged"
        return {"rollout/duplicate_searches": 0}
    n = len(records)
    return {
        "agent/turns_mean": sum(r.turns for r in records) / n,
        "agent/multi_turn_fraction": sum(r.turns >= 2 for r in records) / n,
        "agent/tool_calls_mean": sum(r.tool_calls for r in records) / n,
        "agent/tool_errors_total": sum(r.tool_errors for r in records),
        "agent/tool_latency_s_mean": sum(r.tool_latency_s for r in records) / n,
        "agent/tokens_per_turn_mean": sum(r.tokens_per_turn for r in records) / n,
        "agent/cut_by_turn_limit_fraction": sum(r.cut_by_turn_limit for r in records) / n,
        # searches answered with the duplicate guard's note (asyncrl/tools/retrieval/duplicates.py): the step's
        # total, and the fraction of episodes that repeated a search (asyncrl doctor warns past half)
        "rollout/duplicate_searches": sum(r.duplicate_searches for r in records),
        "agent/duplicate_search_fraction": sum(r.duplicate_searches > 0 for r in records) / n,
    }


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """A sample's text from its ids, special tokens left out (one sequence decodes to a str,
    which transformers types as a str or a list of them)."""
    return lambda ids: cast(str, tokenizer.decode(ids, skip_special_tokens=True))


def sample_rows(step: int, trained_version: int, groups: list[ReadyGroup],
                decode: Callable[[list[int]], str], parse: ToolParser | None = None) -> list[dict[str, Any]]:
    """One row per trained trajectory. ``response`` is the decoded ``response_ids``: in a
    multi-turn episode that mixes the model's replies with the environment's turns, so
    ``response_segments`` splits it where ``loss_mask`` changes, in order:
    ``{"role": "model" | "environment", "text", "tokens"}``; their texts joined are
    ``response``. Multi-turn and agent episodes (those with ``metadata["agent"]``) also
    get ``conversation``: the trajectory's messages, read as the agent saw them
    (:func:`conversation`). With ``parse`` (the gateway's tool-call format: a run whose
    agent calls tools through it), ``tool_calls``: the calls in the model's segments, read
    as the gateway read them (:func:`tool_calls_in`), beside the text they were written in."""
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
                    "response_tokens": t.num_model_tokens, "prompt_tokens": len(t.prompt_ids),
                    "finish_reason": t.finish_reason,
                    "resumed": t.resumed, "num_resumes": t.num_resumes, "response": response,
                    "response_segments": segments,
                    **({"rewards": episode.rewards} if episode.rewards else {}),
                    **({"turn_rewards": [s.reward for s in t.steps]} if any(s.reward for s in t.steps) else {}),
                    **({"reward_extras": episode.reward_extras} if episode.reward_extras else {}),
                })
                rows[-1].update(_read_calls(episode, t, segments, decode, parse))
    return rows


def eval_sample_row(episode: Episode, version: int, decode: Callable[[list[int]], str],
                    parse: ToolParser | None = None, step: int | None = None) -> dict[str, Any]:
    """One scored evaluation episode, as ``eval_samples.jsonl`` holds it: ``step`` (a
    training run's evaluation of that step; none for ``asyncrl eval``) and ``version`` (the
    policy scored), ``task_id``, ``sample`` (its index among the task's samples), ``reward``,
    ``status``, ``finish_reason``, ``response`` (the workflow's reply text, else the last
    trajectory's decoded response), ``error``; for multi-turn and agent episodes the
    ``conversation`` and, with ``parse``, ``tool_calls`` (as in :func:`sample_rows`, over the
    episode's trajectories); and ``trajectories``, token for token."""
    response = episode.metadata.get("response")
    if response is None and episode.trajectories:
        response = decode(episode.trajectories[-1].response_ids)
    row: dict[str, Any] = {**({} if step is None else {"step": step}), "version": version,
                           "task_id": episode.task_id, "sample": episode.metadata.get(EVAL_SAMPLE),
                           "reward": episode.reward, "status": episode.status, "finish_reason": episode.finish_reason,
                           "response": response}
    if episode.error:
        row["error"] = episode.error
    read = [_read_calls(episode, t, _segments(t.response_ids, t.loss_mask, decode)[1] if parse else [], decode, parse)
            for t in episode.trajectories]
    if read and "conversation" in read[-1]:
        row["conversation"] = read[-1]["conversation"]
    if parse is not None:
        row["tool_calls"] = [call for r in read for call in r["tool_calls"]]
    row["trajectories"] = [t.to_dict() for t in episode.trajectories]
    return row


def tool_calls_in(text: str, parse: ToolParser) -> list[dict[str, Any]]:
    """The tool calls ``parse`` reads in ``text``, in OpenAI's form without an id (``{"type":
    "function", "function": {"name", "arguments"}}``, ``arguments`` a JSON string): the same
    call gets the same row in every run."""
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parse(text).tool_calls]


def _read_calls(episode: Episode, t: Trajectory, segments: list[dict[str, Any]], decode: Callable[[list[int]], str],
                parse: ToolParser | None) -> dict[str, Any]:
    """``conversation`` (agent and multi-turn episodes) and, with ``parse``, ``tool_calls``
    (every call in ``t``'s model segments) of a row."""
    out: dict[str, Any] = {}
    if "agent" in episode.metadata:
        out["conversation"] = conversation(episode, t, decode, parse)
    if parse is not None:
        out["tool_calls"] = [c for s in segments if s["role"] == "model" for c in tool_calls_in(s["text"], parse)]
    return out


MAX_MESSAGE_CHARS = 2000
"""Longer message contents are cut in ``samples.jsonl`` (a retrieved page can be long);
the exact tokens are still in ``response``."""


def conversation(episode: Episode, t: Trajectory, decode: Callable[[list[int]], str],
                 parse: ToolParser | None = None) -> list[dict[str, Any]]:
    """The messages of ``t``: the workflow's own record where it kept one
    (``metadata["messages"]``, a multi-turn episode of one trajectory, the environment's
    last answer included), else the messages of its last model call and that call's reply,
    decoded. Each message keeps ``role``, ``content`` (cut at ``MAX_MESSAGE_CHARS``) and
    the tool fields it has; with ``parse``, an assistant message recorded as the text the
    model wrote (the gateway records replies so) also gets the ``tool_calls`` read in it."""
    messages = episode.metadata.get("messages")
    if not (isinstance(messages, list) and len(episode.trajectories) == 1):
        last = t.steps[-1] if t.steps else None
        if last is None or last.messages is None:
            return []
        reply = decode(t.response_ids[len(t.response_ids) - last.response_tokens:])
        messages = [*last.messages, {"role": "assistant", "content": reply}]
    return [_brief(m, parse) for m in messages]


def _brief(message: dict[str, Any], parse: ToolParser | None = None) -> dict[str, Any]:
    content = message.get("content")
    calls = (tool_calls_in(content, parse) if parse is not None and message.get("role") == "assistant"
             and not message.get("tool_calls") and isinstance(content, str) else [])
    if isinstance(content, str) and len(content) > MAX_MESSAGE_CHARS:
        content = content[:MAX_MESSAGE_CHARS] + f"… [{len(content) - MAX_MESSAGE_CHARS} characters cut]"
    out = {"role": message.get("role"), "content": content}
    out.update({k: message[k] for k in ("tool_calls", "tool_call_id", "name") if message.get(k)})
    if calls:
        out["tool_calls"] = calls
    return out


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


def training_seconds(step_rows: Sequence[Mapping[str, Any]]) -> float:
    """Wall time of the logged steps ``step_rows`` (in order; no step-0 evaluation row):
    from the start of the first step to the end of the last, as the benchmarks count it."""
    first, last = step_rows[0], step_rows[-1]
    return last["time/elapsed"] - first["time/elapsed"] + first["time/step"]


def run_figures(run_dir: Path) -> dict[str, Any]:
    """A finished run's throughput, idle fractions and staleness, from its files: what the
    benchmarks and ``asyncrl plan`` compare runs by."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time/step" in r]
    samples = read_jsonl(run_dir / "samples.jsonl")
    staleness = [trajectory_staleness(s["trained_version"], s["behavior_version_min"]) for s in samples]
    wall = training_seconds(rows)
    return {
        "wall_s": wall, "samples": len(samples), "samples_per_s": len(samples) / wall,
        "trainer_idle_ratio": statistics.mean(r["trainer/idle_ratio"] for r in rows),
        "rollout_idle_ratio": statistics.mean(r["rollout/idle_ratio"] for r in rows),
        "learner_idle_ratio": statistics.mean(r["trainer/learner_idle_ratio"] for r in rows),
        "staleness_max": max(staleness),
        "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
    }
