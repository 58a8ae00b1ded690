"""A training run in a child process, and its peak resident memory.

A child rather than this process: ``ru_maxrss`` is a high-water mark over a process's
whole life, so run in one process every run after the first would report the largest
before it, and would start on whatever heap the earlier runs left. A fresh ``asyncrl
train`` is also what a user runs. The peak comes from the kernel (``wait4``), exact where
sampling RSS would miss a short spike; it covers the trainer and the children it reaped
(the search agent's retrieval service, ~75 MB, ends before the trainer), so it is the
largest single process of the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncrl.config import Config, save_config


def train_in_child(cfg: Config, config_path: Path) -> float:
    """Write ``cfg`` to ``config_path``, run ``asyncrl train`` on it in a child process and
    return the child's peak resident memory in MB. Raises if the run fails."""
    save_config(cfg, config_path)
    child = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", str(config_path)])
    try:
        _, status, usage = os.wait4(child.pid, 0)
    except KeyboardInterrupt:  # Ctrl-C reached the child too: it saves a checkpoint and stops
        child.wait()
        raise
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    if child.returncode:
        raise RuntimeError(f"asyncrl train {config_path} exited with {child.returncode}")
    return usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux
