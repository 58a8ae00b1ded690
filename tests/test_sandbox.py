"""The sandbox for model-written code: each test is an escape attempt that must be contained,
named (`stopped_by`) and leave the host untouched; without bubblewrap nothing runs at all."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from asyncrl.tools import sandbox
from asyncrl.tools.sandbox import SandboxUnavailable, passes_tests, python_tool, run_python



def run(code: str, **limits) -> sandbox.SandboxResult:
    limits = {"timeout_s": 20.0, "memory_mb": 256, **limits}
    return asyncio.run(run_python(code, **limits))


@pytest.mark.sandbox
def test_code_runs_as_nobody_in_its_private_directory_with_its_files():
    result = run("import os; print(os.getuid(), os.getcwd(), open('data.txt').read())", files={"data.txt": "42"})
    assert result.ok, result
    assert result.stdout.split() == ["65534", sandbox.SANDBOX_DIR, "42"]
    assert result.stopped_by is None


@pytest.mark.sandbox
def test_a_host_file_outside_the_sandbox_cannot_be_read(tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    project_file = Path(__file__).resolve()
    result = run(f"for p in [{str(secret)!r}, {str(project_file)!r}, '/root/.bash_history', '/etc/shadow']:\n"
                 "    try:\n        print(p, open(p).read()[:20])\n"
                 "    except OSError as e:\n        print(p, type(e).__name__)\n")
    assert "host secret" not in result.stdout
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines[str(secret)] == "FileNotFoundError"
    assert lines[str(project_file)] == "FileNotFoundError"
    assert lines["/etc/shadow"] == "FileNotFoundError"
    assert lines["/root/.bash_history"] == "FileNotFoundError"


@pytest.mark.sandbox
def test_nothing_outside_the_private_directory_can_be_written(tmp_path: Path):
    marker = f"asyncrl-escape-{uuid.uuid4().hex}"
    targets = [f"/usr/{marker}", f"/tmp/{marker}", str(tmp_path / marker), f"/{marker}",
               f"{os.path.realpath(sys.prefix)}/{marker}"]
    code = ("import sys\nfor p in sys.argv[1:] or %r:\n"
            "    try:\n        open(p, 'w').write('x'); print(p, 'written')\n"
            "    except OSError as e:\n        print(p, type(e).__name__)\n") % (targets,)
    result = run(code)
    for target in targets:
        assert not os.path.exists(target), f"the sandbox wrote {target} on the host"
    # /tmp inside is the sandbox's own tmpfs (writable, thrown away); the system and the interpreter are read-only
    assert f"/usr/{marker} OSError" in result.stdout
    assert f"{os.path.realpath(sys.prefix)}/{marker} OSError" in result.stdout


@pytest.mark.sandbox
def test_no_network():
    with socket.socket() as server:  # a host server on loopback the code must not reach either
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        result = run(f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
                     "    try:\n        socket.create_connection(addr, timeout=3); print(addr, 'connected')\n"
                     "    except OSError as e:\n        print(addr, 'refused', e.errno)\n")
    assert "connected" not in result.stdout
    assert result.stdout.count("refused") == 2


@pytest.mark.sandbox
def test_a_fork_bomb_is_stopped_at_the_process_limit():
    result = run("import os\nwhile True:\n    os.fork()", max_processes=8)
    assert result.stopped_by == "processes", result
    assert result.exit_code != 0


@pytest.mark.sandbox
def test_memory_past_the_limit_is_refused():
    result = run("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert result.stopped_by == "memory", result
    assert "allocated" not in result.stdout


@pytest.mark.sandbox
def test_an_endless_loop_is_stopped_by_time():
    result = run("while True:\n    pass", timeout_s=2.0)
    assert result.stopped_by == "time", result
    assert result.exit_code != 0


@pytest.mark.sandbox
def test_the_cpu_limit_stops_a_loop_before_the_wall_deadline():
    result = run("while True:\n    pass", timeout_s=60.0, cpu_s=1.0)
    assert result.stopped_by == "time", result
    assert result.wall_s < 60.0


@pytest.mark.sandbox
def test_gigabytes_of_output_are_cut_and_named():
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", max_output_bytes=100_000)
    assert result.stopped_by == "output", result
    assert len(result.stdout) + len(result.stderr) <= 100_000


@pytest.mark.sandbox
def test_a_file_past_its_limit_is_named():
    result = run("open('big', 'wb').write(b'x' * (8 * 2**20))", max_file_mb=1)
    assert result.stopped_by == "output", result


@pytest.mark.sandbox
def test_no_process_is_left_behind():
    tag = f"asyncrl-left-behind-{uuid.uuid4().hex}"
    result = run("import subprocess\n"
                 f"subprocess.Popen(['/bin/sh', '-c', 'exec -a {tag} sleep 600'], start_new_session=True)\n"
                 "print('started')")
    assert result.ok and "started" in result.stdout
    left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True)
    assert left.stdout == "", f"processes left behind: {left.stdout}"


@pytest.mark.sandbox
def test_a_killed_process_is_named_signal():
    result = run("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert result.stopped_by == "signal"
    assert result.exit_code == -15


@pytest.mark.sandbox
def test_the_reward_helper_and_the_tool():
    solution = "def add(a, b):\n    return a + b\n"
    assert asyncio.run(passes_tests(solution, "from solution import add\nassert add(2, 3) == 5\n")) == 1.0
    assert asyncio.run(passes_tests(solution, "from solution import add\nassert add(2, 3) == 6\n")) == 0.0
    assert asyncio.run(python_tool("print(6 * 7)")) == "42"
    assert "[stopped by the sandbox's time limit]" in asyncio.run(python_tool("while True: pass", timeout_s=1.0))


@pytest.mark.sandbox
def test_a_file_path_that_leaves_the_sandbox_is_refused():
    with pytest.raises(ValueError, match="outside the sandbox directory"):
        run("print(1)", files={"../escape.py": "x"})


def test_without_bubblewrap_nothing_runs(monkeypatch, tmp_path: Path):
    marker = tmp_path / "ran"
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        run(f"open({str(marker)!r}, 'w')")
    assert not marker.exists()
    script = tmp_path / "code.py"
    script.write_text(f"open({str(marker)!r}, 'w')")
    cli = subprocess.run([sys.executable, "-m", "asyncrl.tools.sandbox", str(script)], capture_output=True, text=True,
                         env={**os.environ, "PATH": str(tmp_path)})
    assert cli.returncode == 2
    assert "bubblewrap" in cli.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_without_bubblewrap_the_sandbox_tests_skip_and_the_summary_says_why(tmp_path: Path):
    """The skip is decided once, at collection (tests/conftest.py), and said in the summary
    with the install line: a newcomer running the README's command learns it there."""
    chosen = "runs_as_nobody or leaves_the_sandbox"
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", __file__, "-k", chosen],
                         env={**os.environ, "PATH": str(tmp_path)}, cwd=Path(__file__).parents[1],
                         capture_output=True, text=True, timeout=600)  # no bwrap on that PATH
    assert run.returncode == 0 and "2 skipped" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert ("sandbox tests skipped: 2 tests run model-written code in the sandbox, and bubblewrap (bwrap) is not "
            "found on PATH; apt-get install bubblewrap") in run.stdout, run.stdout[-3000:]
