"""A training run in a child process, and its peak resident memory.

A child rather than this process: a high-water mark covers a process's whole life, so
run in one process every run after the first would report the largest before it, and
would start on whatever heap the earlier runs left. A fresh ``asyncrl train`` is also
what a user runs.

The peak is the child's own ``VmHWM`` (Linux), read by the child as it ends, of the
address space ``exec`` gave it. Not ``ru_maxrss`` from ``wait4``: Python starts a child
with ``vfork``, so the child's ``exec`` leaves the parent's high-water mark in the
child's ``ru_maxrss``, so a parent that had loaded a model makes a small run read large
(docs/history.md). Elsewhere (no ``/proc``) ``ru_maxrss`` it is, with that caveat.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from asyncrl.config import Config, save_config

# Runs ``asyncrl train`` and writes this process's VmHWM (kB) to the file named last.
_LAUNCHER = """
import sys
from asyncrl.cli import main
try:
    code = main(sys.argv[1:-1])
finally:
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(sys.argv[-1], "w") as out:
        out.write(peak)
sys.exit(code)
"""


def train_in_child(cfg: Config, config_path: Path) -> float:
    """Write ``cfg`` to ``config_path``, run ``asyncrl train`` on it in a child process and
    return the child's peak resident memory in MB. Raises if the run fails."""
    save_config(cfg, config_path)
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "vmhwm"
        own_peak = Path("/proc/self/status").exists()
        argv = (["-c", _LAUNCHER, "train", str(config_path), str(peak_file)] if own_peak
                else ["-m", "asyncrl.cli", "train", str(config_path)])
        child = subprocess.Popen([sys.executable, *argv])
        try:
            _, status, usage = os.wait4(child.pid, 0)
        except KeyboardInterrupt:  # Ctrl-C reached the child too: it saves a checkpoint and stops
            child.wait()
            raise
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        if child.returncode:
            raise RuntimeError(f"asyncrl train {config_path} exited with {child.returncode}")
        if own_peak:
            return int(peak_file.read_text()) / 2**10  # kB
        return usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux
