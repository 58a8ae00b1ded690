"""``VllmServeProcess`` without vLLM (the lane starts real ``vllm serve`` with it): a stand-in
server that answers ``/health`` the way vLLM's does, and forks a child as vLLM's API server
forks its engine, so stopping the process group is seen to stop both."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from asyncrl.plan.vllm_process import VllmServeProcess

STAND_IN = """
import http.server, os, sys, time
child = os.fork()
if child == 0:  # the engine process vLLM's API server forks: stays until its group is stopped
    print("child", os.getpid(), flush=True)
    while True:
        time.sleep(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
print("serving", sys.argv[2:], flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ready_at_health_and_stopped_with_the_process_it_forked(tmp_path):
    port = free_port()
    server = VllmServeProcess({"STAND_IN": "1"}, ["python", "-c", STAND_IN, str(port)], python=sys.executable,
                              port=port, log=tmp_path / "server.log", extra=["--enforce-eager"])
    try:
        assert server.wait_ready(time.monotonic() + 60) == f"http://127.0.0.1:{port}"
        log = server.tail()
        assert "serving ['--enforce-eager']" in log  # the extra words after the command's
        child = int(next(line.split()[1] for line in log.splitlines() if line.startswith("child")))
    finally:
        server.stop()
    assert server.proc.returncode is not None
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the forked child outlived its group's stop"
        time.sleep(0.05)


def test_a_server_that_exits_before_it_is_ready_is_named_with_its_log(tmp_path):
    port = free_port()
    server = VllmServeProcess({}, ["python", "-c", "import sys; print('no such model'); sys.exit(3)"],
                              python=sys.executable, port=port, log=tmp_path / "server.log")
    try:
        with pytest.raises(RuntimeError, match=rf"vllm serve on http://127.0.0.1:{port} exited \(3\):\nno such model"):
            server.wait_ready(time.monotonic() + 60)
    finally:
        server.stop()
