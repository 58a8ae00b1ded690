"""``logging.wandb``: a run logs every metrics row to Weights & Biases, here in wandb's
offline mode (no network, no account): the run's ``.wandb`` file is read back with
wandb's own record type and its history compared with ``metrics.jsonl``, row by row.

The ``.wandb`` file is wandb's transaction log: a header (``:W&B``, magic 0xBEE1, version
0), then LevelDB's log framing (32 KiB blocks of chunks, each with a CRC-32 of its type
and bytes, its length and its type: whole, first, middle or last of a record), each
record a ``wandb_internal_pb2.Record``. wandb ships no Python reader for it any more, so
the framing is read here, and any change to it fails loudly (header, CRCs)."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import pytest

from asyncrl.cli import main

BLOCK, HEADER = 32768, 7
WHOLE, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file, each checked against its CRC."""
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:HEADER]) == (b":W&B", 0xBEE1, 0), "not a .wandb log of the known format"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # zero padding written before the file was closed
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: a chunk at byte {pos} fails its CRC"
        if kind == WHOLE:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    return out


def history(path: Path) -> list[dict]:
    """The rows ``wandb.log`` wrote, as dicts of their keys' values."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or ".".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and (math.isclose(a, b, rel_tol=1e-9) or math.isnan(a) and math.isnan(b))
    return a == b


def test_an_offline_wandb_run_holds_every_metrics_row(tmp_path, policy_dir, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install -e '.[wandb]'")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written to the home directory
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "logging.wandb=true", "logging.wandb_project=asyncrl-test", "total_steps=4", "eval_every=2",
                 "batch_size=2", "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=2", "task.num_train=64",
                 "task.num_validation=4", "task.reward_fn=test_reproducible:parity"]) == 0

    (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged = {row["_step"]: row for row in history(log)}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(logged) == [row["step"] for row in metrics] == [0, 1, 2, 3, 4]
    for row in metrics:  # every key of every row, with its value (a NaN written as null in metrics.jsonl)
        got = logged[row["step"]]
        differ = {k: (v, got.get(k)) for k, v in row.items() if not (v is None and k in got or same(v, got.get(k)))}
        assert not differ, f"step {row['step']}: {differ}"
    assert "eval/reward_mean" in logged[2] and "eval/reward_mean" not in logged[1]


def test_without_the_extra_it_says_how_to_install_it_before_writing_anything(tmp_path, monkeypatch):
    import sys

    from asyncrl.config import ConfigError, load_config
    from asyncrl.orchestrator.runlog import RunLog

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    with pytest.raises(ConfigError) as info:
        RunLog(load_config(None, ["logging.wandb=true"]), tmp_path)
    assert "logging.wandb=true needs the 'wandb' extra" in str(info.value)
    assert "pip install -e '.[wandb]', or set logging.wandb=false" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no log file opened, none truncated
