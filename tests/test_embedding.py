"""asyncrl inside a user's own program: ``train`` (with the learner in a process of its own),
``eval`` and ``serve`` from a script without an ``if __name__ == "__main__":`` guard, from
standard input, from ``python -c``, from a thread and from a notebook kernel's
``__main__`` — each runs the user's top level exactly once and ends as it should. Real
interpreters, because what is tested is what the interpreter runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here is a whole run in a child process

TOP = "print('the top level ran', flush=True)\n"


def train_call(policy_dir: Path, out: Path) -> str:
    args = ["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
            "learner.process=true", "total_steps=2", "batch_size=2", "group_size=2", "eval_every=0",
            "eval.num_tasks=2", "eval.samples_per_task=1", "task.num_train=16", "task.num_validation=4",
            "algorithm.filter_zero_variance=false"]
    return f"from asyncrl.cli import main\ncode = main({args!r})\nprint('exit', code, flush=True)\n"


def thread_wrapped(call: str) -> str:
    """``call`` run on a thread of the program (an application's worker, a notebook's)."""
    body = textwrap.indent(call, "    ")
    return f"import threading\n\ndef work():\n{body}\n\nt = threading.Thread(target=work)\nt.start()\nt.join()\n"


def kernel_wrapped(code: str) -> str:
    """``code`` executed as a Jupyter kernel executes a cell: in a ``__main__`` module that
    has no ``__file__`` and no ``__spec__`` (IPython's user namespace)."""
    return textwrap.dedent(f'''
        import sys, types
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile({code!r}, "<ipython-input-1>", "exec"), main.__dict__)
    ''')


def run(how: str, code: str, tmp_path: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if how == "script":
        script = tmp_path / "user_script.py"
        script.write_text(code)
        cmd, stdin = [sys.executable, str(script)], None
    elif how == "stdin":
        cmd, stdin = [sys.executable, "-"], code
    else:  # -c
        cmd, stdin = [sys.executable, "-c", code], None
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=timeout_s)


@pytest.mark.parametrize("how,wrap", [("script", None), ("stdin", None), ("-c", None), ("script", "thread"),
                                      ("stdin", "kernel")])
def test_train_from_a_users_own_program_runs_its_top_level_once(tmp_path, policy_dir, how, wrap):
    call = train_call(policy_dir, tmp_path / "run")
    code = TOP + (thread_wrapped(call) if wrap == "thread" else kernel_wrapped(call) if wrap == "kernel" else call)
    done = run(how, code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("the top level ran") == 1, done.stdout
    assert "exit 0" in done.stdout, done.stdout + done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors").exists()
    assert "without replying" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_eval_from_standard_input(tmp_path, policy_dir):
    out = tmp_path / "eval"
    args = ["eval", "examples/countdown/eval.yaml", f"model.path={policy_dir}", f"output_dir={out}",
            "eval.num_tasks=2", "eval.samples_per_task=1", "task.num_validation=4"]
    done = run("stdin", TOP + f"from asyncrl.cli import main\nprint('exit', main({args!r}))\n", tmp_path)
    assert done.returncode == 0 and "exit 0" in done.stdout, done.stderr[-3000:]
    assert done.stdout.count("the top level ran") == 1
    assert (out / "eval.json").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_from_a_thread_of_a_program_read_from_standard_input(tmp_path, policy_dir):
    """``serve`` off the main thread (no signal handlers there): the program asks it once
    and ends; the server's daemon thread ends with it."""
    port = free_port()
    args = ["serve", "examples/countdown/eval.yaml", f"model.path={policy_dir}", f"gateway.port={port}"]
    code = TOP + textwrap.dedent(f'''
        import json, threading, time, urllib.request
        from asyncrl.cli import main
        threading.Thread(target=main, args=({args!r},), daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:{port}/v1/models", timeout=5) as reply:
                    print("models", json.load(reply)["data"][0]["id"], flush=True)
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    ''')
    done = run("stdin", code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("the top level ran") == 1
    assert f"models {policy_dir}" in done.stdout, done.stdout
