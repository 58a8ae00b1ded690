"""``asyncrl bench SUITE``: benchmarks reported as ratios measured side by side in one run.

Each suite prints a line as each phase starts and ends (``progress.phase``: its figure and
duration, a bar where it has countable units), then a table, and writes ``bench.json``
(keys in INTERFACE.md) to ``--out``.
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


def write_result(result: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def run_bench(suite: str, overrides: list[str], out: str | None) -> dict[str, Any]:
    out_dir = Path(out or f"bench/{suite}-{time.strftime('%Y%m%d-%H%M%S')}")
    if suite == "engine":
        from asyncrl.bench.engine import run_engine_bench

        result = run_engine_bench(overrides)
    elif suite == "modes":
        from asyncrl.bench.modes import run_modes_bench

        result = run_modes_bench(overrides, out_dir)
    elif suite == "gateway":
        from asyncrl.bench.gateway import run_gateway_bench

        result = run_gateway_bench(overrides)
    elif suite == "learner":
        from asyncrl.bench.learner import run_learner_bench

        result = run_learner_bench(overrides)
    elif suite == "sync":
        from asyncrl.bench.sync import run_sync_bench

        result = run_sync_bench(overrides)
    elif suite == "staleness":
        from asyncrl.bench.staleness import run_staleness_bench

        result = run_staleness_bench(overrides, out_dir)
    elif suite == "precision":
        from asyncrl.bench.precision import run_precision_bench

        result = run_precision_bench(overrides)
    elif suite == "retokenize":
        from asyncrl.bench.retokenize import run_retokenize_bench

        result = run_retokenize_bench(overrides)
    elif suite == "tinker":
        from asyncrl.bench.tinker import run_tinker_bench

        result = run_tinker_bench(overrides)
    elif suite == "trl":
        try:
            from asyncrl.bench.trl import run_trl_bench
        except ImportError as exc:
            raise ConfigError(f"bench trl needs TRL: pip install -e '.[bench]' ({exc})") from None
        result = run_trl_bench(overrides, out_dir)
    else:
        raise ConfigError(f"unknown bench suite {suite!r}; valid: engine, modes, gateway, learner, sync, trl, "
                          "staleness, retokenize, precision, tinker")
    result["machine"] = machine()
    write_result(result, out_dir)
    return result
