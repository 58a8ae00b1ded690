"""``asyncrl bench SUITE``: benchmarks reported as ratios measured side by side in one run.

Each suite prints a table and writes ``bench.json`` (keys in INTERFACE.md) to ``--out``.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import ConfigError


def machine() -> dict[str, Any]:
    import os

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def write_result(suite: str, result: dict[str, Any], out: str | None) -> Path:
    out_dir = Path(out or f"bench/{suite}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def run_bench(suite: str, overrides: list[str], out: str | None) -> dict[str, Any]:
    if suite == "engine":
        from asyncrl.bench.engine import run_engine_bench

        result = run_engine_bench(overrides)
    else:
        raise ConfigError(f"unknown bench suite {suite!r}; valid: engine")
    write_result(suite, result, out)
    return result
