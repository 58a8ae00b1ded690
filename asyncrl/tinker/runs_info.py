"""What the SDK's ``RestClient.get_training_run`` / ``list_training_runs`` read about a training
run (``GET /api/v1/training_runs[/<id>]``, the SDK's ``types.TrainingRun``): its base model,
LoRA rank, the ``user_metadata`` its create sent, its last request, and its latest saved state
and sampler checkpoint. tinker-cookbook reads a checkpoint's renderer from its run's
``user_metadata``, often on a later server life than the one that trained it.

A run's record is written at its creation as ``run.json`` in the run's directory under
``tinker.checkpoint_dir`` (beside its saved states), atomically, and is never rewritten: so a
restarted server answers for every run any earlier life created there. What is not recorded
is derived: the latest saved state from this server's checkpoint table and, for states saved
before a restart, from the run's ``weights/`` directories (their modification time as their
time); the latest sampler checkpoint from the table only (sampler checkpoints live in the
server's memory, ``docs/tinker.md``); the last request from this life's calls, else the latest
of the run's creation and its saved states.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from asyncrl.tinker.futures import NotFound

NAME = re.compile(r"^(?!\.+$)[A-Za-z0-9._:-]+$")
"""A checkpoint's name or its client's id as a directory name: no separator, not ``.`` or ``..``."""
RUN_FILE = "run.json"
OWNER = "asyncrl serve-tinker"
"""``model_owner``: the hosted service names an account; this server has none."""


class Checkpoint(Protocol):
    """What is read here of the server's checkpoint table's entries (``service.Checkpoint``)."""

    path: str
    run_id: str
    kind: str
    created: datetime
    deleted: bool


@dataclass(frozen=True)
class RunRecord:
    """What a run's creation fixed: the record ``run.json`` holds."""

    run_id: str
    base: str
    rank: int
    user_metadata: dict[str, str] | None
    created: datetime


def checkpoint_entry(saved: Checkpoint) -> dict[str, Any]:
    """A checkpoint in the SDK's ``types.Checkpoint`` shape."""
    return _entry(saved.path, saved.kind, saved.created)


def _entry(path: str, kind: str, time: datetime) -> dict[str, Any]:
    return {"checkpoint_id": path.split("/", 3)[3], "checkpoint_type": kind, "time": time.isoformat(),
            "tinker_path": path}


class RunRecords:
    """The runs created under one checkpoint directory, across the server's lives (module docstring)."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.last_request: dict[str, datetime] = {}  # run id -> this life's latest call (not kept on disk)

    def directory(self, run_id: str) -> Path | None:
        """The run's directory (``:`` written ``_``); None for an id no directory can have."""
        return self.checkpoint_dir / run_id.replace(":", "_") if NAME.match(run_id) else None

    def record(self, run_id: str, base: str, rank: int, user_metadata: dict[str, str] | None) -> None:
        """The run's ``run.json``, written once, when it is created (a temporary file renamed
        over it: a crash leaves the whole record or none)."""
        directory = self.directory(run_id)
        assert directory is not None, f"{run_id!r}: a training client's id is a directory name"
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.now(timezone.utc)
        tmp = directory / f"{RUN_FILE}.tmp"
        tmp.write_text(json.dumps({"run_id": run_id, "base": base, "rank": rank, "user_metadata": user_metadata,
                                   "created": now.isoformat()}))
        os.replace(tmp, directory / RUN_FILE)
        self.last_request[run_id] = now

    def touch(self, run_id: str) -> None:
        self.last_request[run_id] = datetime.now(timezone.utc)

    def read(self, run_id: str) -> RunRecord | None:
        directory = self.directory(run_id)
        return None if directory is None or not (directory / RUN_FILE).is_file() else _load(directory / RUN_FILE)

    def saved_states(self, run_id: str) -> list[str]:
        """The ``tinker://`` paths of the states ``run_id`` saved on this server's disk, oldest first."""
        return [path for path, _ in self._states_on_disk(run_id)]

    def _states_on_disk(self, run_id: str) -> list[tuple[str, datetime]]:
        directory = self.directory(run_id)
        if directory is None:
            return []
        found = [(p, p.stat().st_mtime) for p in (directory / "weights").glob("*")
                 if p.is_dir() and not p.name.endswith(".tmp")]
        return [(f"tinker://{run_id}/weights/{p.name}", datetime.fromtimestamp(mtime, timezone.utc))
                for p, mtime in sorted(found, key=lambda found: found[1])]

    def training_run(self, run_id: str, checkpoints: Mapping[str, Checkpoint]) -> dict[str, Any]:
        """The run in the SDK's ``types.TrainingRun`` shape; ``checkpoints``: the server's table.
        An id no life of this server created here is :class:`NotFound`, naming it."""
        run = self.read(run_id)
        if run is None:
            raise NotFound(f"no training run {run_id!r} on this server: a training_run_id is the model_id of a "
                           "training client created on this server's tinker.checkpoint_dir "
                           "(list_training_runs lists them)")
        mine = [c for c in checkpoints.values() if c.run_id == run_id and not c.deleted]
        states = [checkpoint_entry(c) for c in mine if c.kind == "training"]
        known = {entry["tinker_path"] for entry in states}
        states += [_entry(path, "training", time) for path, time in self._states_on_disk(run_id) if path not in known]
        samplers = [checkpoint_entry(c) for c in mine if c.kind == "sampler"]
        latest = [max(entries, key=_time, default=None) for entries in (states, samplers)]
        last = self.last_request.get(run_id) or max([run.created, *map(_time, states)])
        return {"training_run_id": run_id, "base_model": run.base, "model_owner": OWNER, "is_lora": True,
                "corrupted": False, "lora_rank": run.rank, "last_request_time": last.isoformat(),
                "last_checkpoint": latest[0], "last_sampler_checkpoint": latest[1], "user_metadata": run.user_metadata}

    def training_runs(self, checkpoints: Mapping[str, Checkpoint], limit: int, offset: int) -> dict[str, Any]:
        """Every run recorded here, oldest first, ``limit`` of them from ``offset`` (the SDK's
        ``types.TrainingRunsResponse``)."""
        records = sorted((_load(path) for path in self.checkpoint_dir.glob(f"*/{RUN_FILE}")), key=lambda r: r.created)
        ids = [run.run_id for run in records]
        return {"training_runs": [self.training_run(run_id, checkpoints) for run_id in ids[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}


def _load(path: Path) -> RunRecord:
    saved = json.loads(path.read_text())
    return RunRecord(saved["run_id"], saved["base"], saved["rank"], saved["user_metadata"],
                     datetime.fromisoformat(saved["created"]))


def _time(entry: dict[str, Any]) -> datetime:
    """A checkpoint entry's time, to compare (its ISO text may lack the microseconds)."""
    return datetime.fromisoformat(entry["time"])
