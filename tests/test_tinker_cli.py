"""``asyncrl serve-tinker CONFIG`` as a user runs it: a process that prints the URL it serves
(``tinker.port=0``: a free port), which Tinker's SDK then reaches, and that stops on SIGTERM;
and the refusal of a bind other machines could reach with no key, before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from asyncrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "models" / "addition-tiny"


def _config(tmp_path: Path) -> str:
    path = tmp_path / "tinker.yaml"
    path.write_text(f"model:\n  path: {POLICY}\n  device: cpu\noutput_dir: {tmp_path / 'out'}\n"
                    "tinker:\n  base_model: addition-tiny\n")
    return str(path)


def test_a_reachable_bind_without_a_key_exits_2_naming_the_key(tmp_path, capsys):
    pytest.importorskip("tinker")  # without it the command says to install it, also exit 2
    assert main(["serve-tinker", _config(tmp_path), "tinker.host=0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "tinker.host='0.0.0.0' is reachable from other machines" in err and "tinker.api_key" in err


@pytest.mark.slow
def test_serve_tinker_prints_its_url_serves_the_sdk_and_stops_on_sigterm(tmp_path):
    tinker = pytest.importorskip("tinker")
    pytest.importorskip("peft")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve-tinker", _config(tmp_path), "tinker.port=0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        lines: list[str] = []
        printed = threading.Event()

        def read() -> None:  # drained for the process's life
            for line in proc.stdout:
                lines.append(line.strip())
                printed.set()
            printed.set()

        threading.Thread(target=read, daemon=True).start()
        assert printed.wait(300) and lines, "serve-tinker printed no URL"
        url = lines[0]
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        caps = tinker.RestClient(base_url=url, api_key="tml-any").get_server_capabilities().result()
        assert [m.model_name for m in caps.supported_models] == ["addition-tiny"]
    finally:
        proc.terminate()
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0
