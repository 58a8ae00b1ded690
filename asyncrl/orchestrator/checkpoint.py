"""What a checkpoint holds beyond the learner's state, and how a run resumes from it.

A checkpoint ``checkpoints/step_N/`` is a Hugging Face model directory plus
``trainer_state.pt`` (optimizer, LR schedule, RNG, version: the learner's part) and
``run_state.json`` (this module: the orchestrator's part). The orchestrator's part is
what makes a resume one consistent history:

- the data cursor (epoch, index in the epoch's order) and the tasks that were handed
  out but whose groups had not finished: they are re-issued first after a resume, so
  every task is consumed once per epoch across the interruption, each with the epoch it
  was drawn in (its episodes' seeds) and its start order (its place in a batch);
- the groups generated but not yet trained (the buffer), saved whole: nothing
  generated before the checkpoint is lost;
- counters and the wall time so far, so metrics continue where they stopped.

Rows that ``metrics.jsonl``, ``samples.jsonl``, ``timeline.jsonl``, ``errors.jsonl`` and
``eval_samples.jsonl`` got after the checkpoint describe work the resumed run redoes; :func:`rollback_logs` removes
them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from asyncrl.config import ConfigError
from asyncrl.config.learner_kinds import LearnerKind
from asyncrl.jsonl import read_jsonl
from asyncrl.learner.checkpoint_io import OPTIMIZER_DIR
from asyncrl.orchestrator.buffer import ReadyGroup
from asyncrl.orchestrator.task_stream import Draw
from asyncrl.types import Group

RUN_STATE_FILE = "run_state.json"
IN_FLIGHT_FILE = "in_flight.jsonl"
"""The journals of the episodes under way at the checkpoint (``asyncrl/rollout/journal.py``): what
they had generated, continued on resume instead of generated again."""
LEARNER_STATE_FILE = "trainer_state.pt"
RUN_CHECKPOINT = (LEARNER_STATE_FILE, RUN_STATE_FILE)
"""The files a run's checkpoint is complete with (``asyncrl train``)."""
LEARNER_CHECKPOINT = (LEARNER_STATE_FILE,)
"""The files a learner's checkpoint alone is complete with (``asyncrl sft``: no rollouts, no run state)."""


@dataclass
class RunState:
    step: int
    elapsed_s: float
    started: int  # groups the gate admitted so far (start order of the next one)
    epoch: int
    index: int
    reissue: list[Draw]  # tasks handed out whose groups were not finished, each with its epoch and start order
    buffered: list[dict[str, Any]]  # {"start_order", "group"} of groups not yet trained
    counters: dict[str, int] = field(default_factory=dict)
    stale_dropped: int = 0
    interim: bool = False  # saved because save_every_minutes had passed: removed once a later checkpoint is written

    def to_json(self) -> str:
        """Each draw as ``{"index", "epoch", "order"}``."""
        return json.dumps({**asdict(self), "reissue": [d._asdict() for d in self.reissue]})

    @classmethod
    def from_json(cls, text: str) -> RunState:
        """Also reads the older shape, where ``reissue`` is a list of task indices with their
        epochs and start orders in two lists beside it (``reissue_epochs``, ``reissue_orders``),
        or, older still, without them: such an entry counts as drawn in the cursor's epoch and
        starts afresh (no start order)."""
        data = json.loads(text)
        epochs, orders = data.pop("reissue_epochs", []), data.pop("reissue_orders", [])
        data["reissue"] = [
            Draw(**d) if isinstance(d, dict)
            else Draw(d, epochs[i] if i < len(epochs) else data["epoch"], orders[i] if i < len(orders) else None)
            for i, d in enumerate(data["reissue"])]
        return cls(**data)

    @staticmethod
    def encode_groups(groups: list[ReadyGroup]) -> list[dict[str, Any]]:
        return [{"start_order": g.start_order, "group": g.group.to_dict()} for g in groups]

    def ready_groups(self) -> list[ReadyGroup]:
        return [ReadyGroup(Group.from_dict(g["group"]), g["start_order"]) for g in self.buffered]


def encode_in_flight(journals: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(j) + "\n" for j in journals)


def read_in_flight(checkpoint: Path) -> list[dict[str, Any]]:
    """The checkpoint's in-flight journals; none for a checkpoint written before they were kept."""
    path = checkpoint / IN_FLIGHT_FILE
    return read_jsonl(path) if path.is_file() else []


def resume_point(output_dir: Path, resume: bool, learner: LearnerKind | None = None
                 ) -> tuple[Path | None, RunState | None, list[dict[str, Any]]]:
    """The checkpoint a run continues from (:func:`starting_point`), its run state and its
    in-flight journals; ``(None, None, [])`` for a fresh start. The checkpoint must have been
    written by a learner whose optimizer state lives where ``learner``'s does (its row's
    ``optimizer_state``: in the checkpoint, or on a learner's server, the checkpoint then
    holding its path there): ConfigError otherwise, before any model loads."""
    checkpoint = starting_point(output_dir, resume)
    if checkpoint is None:
        return None, None, []
    saved_url = torch.load(checkpoint / LEARNER_STATE_FILE, map_location="cpu", weights_only=False).get("learner_url")
    on_server = (learner.optimizer_state if learner is not None else "checkpoint") == "server"
    if (saved_url is not None) != on_server:
        raise ConfigError(f"{checkpoint} was saved by a learner "
                          + (f"by URL (learner.url={saved_url}): its optimizer state is on that server; resume with "
                             "that learner.url" if saved_url else "in process (its weights are in the checkpoint): "
                             "resume without learner.url")
                          + ", or start afresh in a new output_dir")
    return checkpoint, RunState.from_json((checkpoint / RUN_STATE_FILE).read_text()), read_in_flight(checkpoint)


def checkpoint_steps(ckpt_dir: Path, complete: tuple[str, ...] = RUN_CHECKPOINT) -> list[tuple[int, Path]]:
    """Complete checkpoints (each holding the files ``complete`` names), oldest first. A
    ``.tmp`` directory (a crash mid-write) never counts."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(p.name[5:]), p) for p in ckpt_dir.glob("step_*") if p.name[5:].isdigit()]
    return sorted((s, p) for s, p in found if all((p / name).is_file() for name in complete))


def latest_checkpoint(ckpt_dir: Path, complete: tuple[str, ...] = RUN_CHECKPOINT) -> Path | None:
    steps = checkpoint_steps(ckpt_dir, complete)
    return steps[-1][1] if steps else None


def starting_point(output_dir: Path, resume: bool) -> Path | None:
    """The checkpoint a run continues from, or None for a fresh start. A fresh start needs
    an empty (or new) ``output_dir``: a fresh run would otherwise truncate an earlier
    run's logs and mix its checkpoints with the old ones. Nothing already produced is
    ever overwritten, so both refusals are config errors (exit 2) that say what to do."""
    found = sorted(p.name for p in output_dir.iterdir()) if output_dir.is_dir() else []
    if resume:
        for note in clear_unfinished(output_dir / "checkpoints"):
            print(f"asyncrl: {note}", file=sys.stderr)
    checkpoint = latest_checkpoint(output_dir / "checkpoints")
    if resume and checkpoint is not None:
        return sound_checkpoint(output_dir / "checkpoints")
    if found:
        shown = ", ".join(found[:6]) + (", …" if len(found) > 6 else "")
        if resume:
            raise ConfigError(f"output_dir {str(output_dir)!r} holds {shown} but no complete checkpoint to resume "
                              "from; choose a new output_dir (nothing is overwritten)")
        raise ConfigError(f"output_dir {str(output_dir)!r} is not empty ({shown}); continue that run with "
                          "resume=true, or choose a new output_dir (nothing is overwritten)")
    return None


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a complete-looking checkpoint (a file truncated or overwritten
    after it was renamed into place: a disk that filled, a copy cut short), or None. Reads
    every file's header or whole small file, not the weights: seconds, not minutes."""
    from safetensors import safe_open

    try:
        RunState.from_json((checkpoint / RUN_STATE_FILE).read_text())
        if (checkpoint / IN_FLIGHT_FILE).is_file():
            read_jsonl(checkpoint / IN_FLIGHT_FILE, torn_tail="raise")
        torch.load(checkpoint / LEARNER_STATE_FILE, map_location="cpu", weights_only=False)
        weights = sorted(checkpoint.glob("*.safetensors"))
        if not weights:
            return "no *.safetensors weights"
        for path in weights:
            with safe_open(path, "pt") as f:
                f.keys()
        if (checkpoint / OPTIMIZER_DIR).is_dir() and not (checkpoint / OPTIMIZER_DIR / ".metadata").is_file():
            return f"{OPTIMIZER_DIR}/.metadata is missing"
    except Exception as exc:  # any reader's failure is the answer
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def sound_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint that reads back whole; a damaged newer one is left
    where it is (nothing is deleted) and named, with the one resumed from instead."""
    for _, path in reversed(checkpoint_steps(ckpt_dir)):
        problem = damage(path)
        if problem is None:
            return path
        print(f"asyncrl: checkpoint {path} is damaged ({problem}); not resuming from it", file=sys.stderr)
    raise ConfigError(f"no checkpoint in {str(ckpt_dir)!r} reads back whole (each is named above); nothing to "
                      "resume from")


def clear_unfinished(ckpt_dir: Path) -> list[str]:
    """Tidy what a crash in the middle of a save leaves: ``step_N.tmp`` (never complete,
    never resumed from: removed) and ``step_N.old`` (a same-step checkpoint set aside while
    its replacement was renamed in: put back where ``step_N`` is missing, else removed).
    Returns what was done, to say."""
    if not ckpt_dir.is_dir():
        return []
    done = []
    for path in sorted(ckpt_dir.glob("step_*.old")):
        final = path.with_name(path.name.removesuffix(".old"))
        if final.exists():
            shutil.rmtree(path)
            done.append(f"removed {path}, set aside by a save that completed")
        else:
            os.replace(path, final)
            done.append(f"restored {final} from {path.name}, set aside by a save that did not complete")
    for path in sorted(ckpt_dir.glob("step_*.tmp")):
        shutil.rmtree(path)
        done.append(f"removed {path}, left by a save that did not complete")
    return done


SaveKind = Literal["kept", "interim"]


def save_due(step: int, total_steps: int, save_every: int, save_every_minutes: float,
             seconds_since_save: float) -> SaveKind | None:
    """Whether a periodic checkpoint is due after ``step``, and of which kind: ``kept``
    every ``save_every`` steps; else ``interim`` once ``save_every_minutes`` of wall time
    have passed since the last save (or the run's start); either 0 is off. None at
    ``total_steps``, whose checkpoint the run's end takes. Pure."""
    if step >= total_steps:
        return None
    if save_every and step % save_every == 0:
        return "kept"
    if save_every_minutes > 0 and seconds_since_save >= 60.0 * save_every_minutes:
        return "interim"
    return None


def is_interim(checkpoint: Path) -> bool:
    """A checkpoint saved by time only (:attr:`RunState.interim`); a damaged one's state
    counts as kept (rotation then treats it as any other)."""
    try:
        return json.loads((checkpoint / RUN_STATE_FILE).read_text()).get("interim", False) is True
    except (OSError, ValueError, AttributeError):
        return False


def mark_kept(checkpoint: Path) -> None:
    """An interim checkpoint made a kept one (the run's end, or a hook's ``run.save()``, at
    its step): its ``run_state.json`` rewritten without the mark, atomically."""
    path = checkpoint / RUN_STATE_FILE
    state = RunState.from_json(path.read_text())
    if state.interim:
        state.interim = False
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(state.to_json())
        os.replace(tmp, path)


def rotate(ckpt_dir: Path, keep_last: int, newest: Path, complete_with: tuple[str, ...] = RUN_CHECKPOINT) -> None:
    """Keep the ``keep_last`` latest checkpoints saved by steps, at a run's end or on request,
    and always ``newest``, the one just written. An interim checkpoint (saved by time) is
    there for a crash only: it is removed once a later one is written, so it never pushes
    a kept one out, and the disk holds at most ``keep_last`` + 1. ``complete_with``: the
    files a checkpoint of this kind is complete with (:data:`LEARNER_CHECKPOINT` for SFT's)."""
    complete = [path for _, path in checkpoint_steps(ckpt_dir, complete_with)]
    interim = [path for path in complete if is_interim(path)]
    kept = [path for path in complete if path not in interim]
    for old in [*interim, *kept[:-keep_last]]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def _rewrite_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Keep the rows ``keep`` accepts; atomic, so a crash here leaves the old file. A torn
    last line (the process was killed mid-write) is dropped. Returns rows removed."""
    if not path.exists():
        return 0
    rows = read_jsonl(path, torn_tail="drop")
    kept = [row for row in rows if keep(row)]
    lines = sum(1 for line in path.read_text().split("\n") if line.strip())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    os.replace(tmp, path)
    return lines - len(kept)


def rollback_logs(output_dir: Path, state: RunState) -> dict[str, int]:
    """Remove what the logs got after the checkpoint; returns rows removed per file."""
    return {
        "metrics.jsonl": _rewrite_jsonl(output_dir / "metrics.jsonl", lambda r: r.get("step", 0) <= state.step),
        "samples.jsonl": _rewrite_jsonl(output_dir / "samples.jsonl", lambda r: r.get("step", 0) <= state.step),
        "timeline.jsonl": _rewrite_jsonl(output_dir / "timeline.jsonl",
                                         lambda r: r.get("end", 0.0) <= state.elapsed_s),
        "errors.jsonl": _rewrite_jsonl(output_dir / "errors.jsonl", lambda r: r.get("step", 0) <= state.step),
        "eval_samples.jsonl": _rewrite_jsonl(output_dir / "eval_samples.jsonl",
                                             lambda r: r.get("step", 0) <= state.step),
    }
