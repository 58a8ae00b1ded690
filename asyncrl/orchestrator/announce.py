"""What a run says and records before its first step: the banner (what it is about to do),
the note of a resume with nothing left to train, and ``config.yaml`` (or, on a resume,
the settings changed since the run began, said and recorded beside it)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.config import CONFIG_FILE, Config, describe_changes, record_config_changes, save_config
from asyncrl.orchestrator.checkpoint import RunState
from asyncrl.rollout import chat_format
from asyncrl.rollout.gateway.tool_calls import ToolFormat, resolve_format
from asyncrl.tasks.base import TaskSplits


def _learner_line(cfg: Config) -> str:
    """Where the learner is, when it is not on this machine (its kind's row says): the URL."""
    kind = cfg.learner_kind
    return "" if kind.trains_here else f"; the learner: {kind.summary}, at {cfg.learner.url}"


def banner(cfg: Config, resumed: RunState | None, splits: TaskSplits, tokenizer: PreTrainedTokenizerBase) -> str:
    """What a run is about to do, said before it starts."""
    evals = f"every {cfg.eval_every} steps" if cfg.eval_every else "before the first and after the last step"
    tool_format = run_tool_format(cfg, tokenizer)
    return "\n".join([
        f"asyncrl train → {Path(cfg.output_dir)}" + (f" (resuming from step {resumed.step})" if resumed else ""),
        f"  mode {cfg.mode}, η = {cfg.effective_max_staleness}, partial rollouts: {cfg.effective_partial_rollout}; "
        f"runtime {cfg.runtime}, engine {cfg.engine}, weight sync {cfg.weight_sync.method}"
        + _learner_line(cfg),
        f"  model {cfg.model.path}; task {cfg.task.name} ({len(splits.train)} train, "
        f"{min(cfg.eval.num_tasks, len(splits.validation))} validation tasks scored)",
        f"  {cfg.total_steps} steps × {cfg.batch_size} groups × {cfg.group_size} samples; evaluation {evals}"
        + eval_placement(cfg),
        *(f"  {note}" for note in template_notes(tokenizer, templated=cfg.workflow.use_chat_template,
                                                  tool_format=tool_format)),
        "  Ctrl-C finishes the step, saves a checkpoint and stops (resume with resume=true)"])


def eval_placement(cfg: Config) -> str:
    """Where evaluations run, said once: beside training, or blocking it and why."""
    if cfg.background_eval:
        return " (beside training" + (f", on eval.urls: {', '.join(cfg.eval.urls)})" if cfg.eval.urls else ")")
    if cfg.mode == "sync" or cfg.eval.background is False:
        return ""
    if cfg.engine_kind.background_eval == "servers":
        return f" (blocking training: engine={cfg.engine} evaluates beside training on eval.urls' servers, none given)"
    sharing = cfg.rollout.thread_sharing
    return f" (blocking training: rollout.thread_sharing={sharing} gives every core to the two sides)"


def run_tool_format(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> ToolFormat | None:
    """The format the gateway reads tool calls in, for a run whose agent goes through one
    (``workflow.name=openai_agent``); None for a workflow that calls the engine itself."""
    return resolve_format(cfg.gateway.tool_parser, tokenizer) if cfg.workflow.name == "openai_agent" else None


def template_notes(tokenizer: PreTrainedTokenizerBase, *, templated: bool,
                   tool_format: ToolFormat | None) -> list[str]:
    """What asyncrl renders in place of the chat template (tools on a model whose template
    has none) where prompts go through it (``templated``), and the format tool calls are
    read in where a gateway reads them (``tool_format``): said before the first step or
    request, because a model writing calls the parser does not read only shows as a counter."""
    notes = []
    if templated and tokenizer.chat_template is not None:
        notes.append(chat_format.describe(chat_format.probe(tokenizer)))
    if tool_format is not None:
        notes.append(f"tool calls: {tool_format.name} ({tool_format.origin})")
    return [note for note in notes if note]


def finished_note(cfg: Config, step: int, changed: Mapping[str, Any]) -> str:
    """What a resume of a finished run says: its latest checkpoint (``step``) is at or past
    ``total_steps``, so there is nothing to train, and nothing was written."""
    total = cfg.total_steps
    lines = [f"asyncrl train: {Path(cfg.output_dir)} is finished: its latest checkpoint is step {step}"
             + (f" of total_steps={total}" if step == total else f", past total_steps={total}")
             + "; nothing to train, nothing written",
             f"  to train on from step {step}, add total_steps=N with N > {step} to resume=true"]
    if changed:
        lines.append("  not applied, as nothing trains: " + ", ".join(describe_changes(changed)))
    return "\n".join(lines)


def resume_note(checkpoint: Path, step: int, removed: Mapping[str, int], replay_note: str) -> str:
    """What a resume says as it starts: the checkpoint, the log rows rolled back to it (by
    file), and what the rollout side replays (``RolloutLoop.replay_note``)."""
    return (f"asyncrl: resuming from {checkpoint} (step {step}); rolled back rows written after it: {dict(removed)}\n"
            f"asyncrl: {replay_note}")


def failed_note(output_dir: Path, checkpoint: Path | None) -> str:
    """What a failed run says last: its newest checkpoint and how to continue from it; with
    none, that there is nothing to resume and what to run instead (a fresh start refuses a
    non-empty ``output_dir``, a resume one with no checkpoint)."""
    if checkpoint is not None:
        return (f"asyncrl train: the run failed; last good checkpoint: {checkpoint}; continue from it with the same "
                "command and resume=true")
    return (f"asyncrl train: the run failed; last good checkpoint: none yet, so there is nothing to resume: start the "
            f"run again with a new output_dir (or after removing {output_dir})")


def save_run_config(cfg: Config, resumed: RunState | None, changed: Mapping[str, Any]) -> None:
    """A new run writes ``config.yaml``. A resume leaves it as the run began: settings that
    differ from those the run last trained with are said and appended to
    ``config_changes.jsonl`` beside it."""
    output_dir = Path(cfg.output_dir)
    path = output_dir / CONFIG_FILE
    if resumed is None or not path.is_file():
        save_config(cfg, path)
    elif changed:
        record = record_config_changes(output_dir, resumed.step, changed)
        shown = "".join(f"\n  {line}" for line in describe_changes(changed))
        print(f"asyncrl: resuming with settings changed from the run's (recorded in {record}; "
              f"{CONFIG_FILE} keeps those it began with):{shown}", file=sys.stderr, flush=True)
