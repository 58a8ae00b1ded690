"""A ``vllm serve`` process on this machine, started from the environment and words
:func:`asyncrl.plan.fleet.vllm_serve` gives (the text ``asyncrl plan --server vllm`` prints):
the vLLM lane's tests and ``examples/fleet/eval_beside.py --server vllm`` start real servers
this way and must stop them whole, also on failure.

Invariants: the server runs in a process group of its own (the API server and the engine
process it forks are stopped together: SIGTERM, then SIGKILL after a minute); its output goes
to ``log`` alone; it is ready once ``GET /health`` answers 200, and one that exits or does not
answer by the deadline is an error that quotes the log's tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


class VllmServeProcess:
    """``words`` (``python -m vllm.entrypoints.openai.api_server ...`` on a CPU, ``vllm serve
    ...`` on a GPU) run by ``python``'s environment, ``extra`` after them, ``env`` over this
    process's environment."""

    def __init__(self, env: dict[str, str], words: list[str], *, python: str, port: int, log: Path,
                 extra: list[str] | tuple[str, ...] = ()) -> None:
        program = [python] if words[0] == "python" else [str(Path(python).with_name(words[0]))]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*program, *words[1:], *extra], stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env}, start_new_session=True)

    def wait_ready(self, deadline: float) -> str:
        """Its URL once ``/health`` answers, polling until ``deadline`` (``time.monotonic()``)."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve on {self.url} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return self.url
            except OSError:  # not listening yet (refused, reset while it starts): poll again until the deadline
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve on {self.url} did not answer /health in time (see {self.log}):\n"
                           f"{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL to the whole group: a server lost, as a crash loses it."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()
