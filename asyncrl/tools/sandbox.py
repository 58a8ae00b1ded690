"""Model-written Python run in a sandbox: bubblewrap for isolation, rlimits for size, a wall deadline.

Three promises, each tested by an escape attempt (tests/test_sandbox.py):

1. **Isolated or not at all.** The code runs under bubblewrap (`bwrap`, Debian's package
   `bubblewrap`) with no network (its own network namespace holds only a downed loopback), a
   read-only view of the system directories and of the interpreter, nothing of the host's
   home, temporary or project directories, and one private writable directory that is
   deleted afterwards. Where bwrap is missing or cannot create its namespaces,
   `run_python` raises `SandboxUnavailable` naming the package: it never falls back to
   running the code bare.
2. **Bounded.** CPU seconds, address space, processes, file size and open files are
   rlimits set in the sandbox before the code starts; wall time is a deadline here, after
   which the whole process tree is killed; output is read here and the run is killed once
   it passes `max_output_bytes`. The sandbox's pid namespace dies with its first process,
   so nothing the code started outlives the run.
3. **Named.** `SandboxResult.stopped_by` says what ended a run that did not end by itself:
   `"time"` (wall deadline or CPU limit), `"memory"` (the address-space limit: a
   `MemoryError` or an allocation the kernel refused), `"output"` (stdout/stderr or a file
   past its limit), `"processes"` (a fork refused at the process limit), `"signal"` (killed
   by any other signal), or `None`.

Why the code runs as uid 65534 ("nobody"): the process limit (RLIMIT_NPROC) counts the
processes of the host user the sandboxed code runs as, and the kernel exempts root from
it. When the caller is root, bwrap keeps only CAP_SETUID/CAP_SETGID and the launcher drops
to nobody before the code starts (no capability survives the switch); otherwise bwrap maps
the caller to nobody in a user namespace and the process limit counts from the caller's
current processes. Not covered: a syscall filter (seccomp); the namespaces and the
read-only mounts are the isolation.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

StoppedBy = Literal["time", "memory", "output", "signal", "processes"]

NOBODY = 65534
SANDBOX_DIR = "/sandbox"  # the private writable directory, as the code sees it (also its cwd and $HOME)
# What the sandbox sees of the host, read-only, when it exists: the system and the interpreter.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/alternatives",
               "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/ssl")
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"

# Runs inside the sandbox before the user's code: limits, then (as root) the switch to nobody, then exec.
_LAUNCHER = """
import os, resource, sys
limits = {limits!r}
for name, value in limits.items():  # CPU: SIGXCPU at the soft limit, SIGKILL a second later
    resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
if os.getuid() == 0:
    os.setgroups([])
    os.setgid({nobody})
    os.setuid({nobody})
os.execv(sys.executable, [sys.executable, "-E", "-s", "-B", "main.py"])
"""


# The wall seconds of every run in the current context (an episode's, see `recording_seconds`); None: not recorded
_RUN_SECONDS: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("asyncrl_sandbox_seconds",
                                                                                  default=None)


@contextlib.contextmanager
def recording_seconds() -> Iterator[list[float]]:
    """Collect the wall seconds of every `run_python` in this context into the list yielded.

    The `openai_agent` workflow wraps each episode in it, so an agent's sandbox time (its
    tools and its reward) reaches the step rows as `sandbox/seconds_mean` without the agent
    returning more than its reward. Tasks the agent starts, and threads it runs on, see the
    same list (both copy the context, the list is shared)."""
    seconds: list[float] = []
    token = _RUN_SECONDS.set(seconds)
    try:
        yield seconds
    finally:
        _RUN_SECONDS.reset(token)


class SandboxUnavailable(RuntimeError):
    """The isolation layer is missing or cannot start here: nothing was run."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. `exit_code` is the process's status (negative: the signal that
    ended it, as `subprocess` reports it); `stdout`/`stderr` are cut at the output limit."""

    exit_code: int
    stdout: str
    stderr: str
    stopped_by: StoppedBy | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.stopped_by is None


def bwrap_path() -> str:
    """The bwrap binary, or `SandboxUnavailable` naming the package to install."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(f"the sandbox needs bubblewrap (`bwrap` is not on PATH): {INSTALL_HINT}; "
                                 "asyncrl never runs model-written code without it")
    return path


def _interpreter_dirs() -> list[str]:
    """The directories the interpreter needs (its prefix, a venv's prefix), bound read-only."""
    dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    return sorted(d for d in dirs if not any(d != o and d.startswith(o + "/") for o in dirs))


def _bwrap_argv(bwrap: str, workdir: Path, as_root: bool) -> list[str]:
    # Every namespace but the user namespace, which only the non-root path asks for (below): as root, a user
    # namespace would map uid 0 alone, and the launcher could not become nobody.
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--perms", "0755", "--dir", "/etc", "--new-session", "--clearenv",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/var/tmp"]
    for path in SYSTEM_DIRS:
        if os.path.lexists(path):
            argv += ["--ro-bind", path, path]
    for path in _interpreter_dirs():
        # bwrap makes missing parents (say /root/.pyenv for a pyenv interpreter) mode 0700, which nobody cannot cross
        for parent in reversed(Path(path).parents[:-1]):
            if str(parent) not in SYSTEM_DIRS:
                argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", path, path]
    argv += ["--bind", str(workdir), SANDBOX_DIR, "--chdir", SANDBOX_DIR,
             "--setenv", "HOME", SANDBOX_DIR, "--setenv", "PATH", "/usr/bin:/bin",
             "--setenv", "PYTHONIOENCODING", "utf-8", "--remount-ro", "/"]
    if as_root:  # bwrap drops every capability as root; the launcher needs these two to become nobody
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    return argv


def _own_process_count() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                continue
    return count


def _limits(*, cpu_s: float, memory_mb: int, max_processes: int, max_file_mb: int, as_root: bool) -> dict[str, int]:
    # As root the code runs as nobody (no other process of nobody's counts); else the caller's own processes do.
    nproc = max_processes if as_root else _own_process_count() + max_processes
    return {"RLIMIT_CPU": max(1, int(cpu_s + 0.999)), "RLIMIT_AS": memory_mb * 2**20, "RLIMIT_NPROC": nproc,
            "RLIMIT_FSIZE": max_file_mb * 2**20, "RLIMIT_NOFILE": 256, "RLIMIT_CORE": 0}


async def _read_capped(stream: asyncio.StreamReader, sink: bytearray, budget: list[int], over: asyncio.Event) -> None:
    """Read a pipe to its end; past the shared byte budget, keep nothing more and set `over`."""
    while chunk := await stream.read(65536):
        if budget[0] <= 0:
            over.set()
            continue
        sink += chunk[: budget[0]]
        budget[0] -= len(chunk)
        if budget[0] < 0:
            over.set()


def _classify(code: int, stderr: str, *, timed_out: bool, output_over: bool) -> StoppedBy | None:
    if timed_out:
        return "time"
    if output_over:
        return "output"
    if code == -signal.SIGXCPU:
        return "time"
    tail = stderr[-2000:]
    if code == -signal.SIGXFSZ or (code != 0 and "File too large" in tail):  # Python ignores SIGXFSZ: EFBIG
        return "output"
    if code != 0 and ("MemoryError" in tail or "Cannot allocate memory" in tail):
        return "memory"
    if code != 0 and ("BlockingIOError" in tail or "Resource temporarily unavailable" in tail):
        return "processes"
    if code < 0:
        return "memory" if code == -signal.SIGSEGV and "Fatal Python error" in tail else "signal"
    return None


async def run_python(code: str, *, timeout_s: float, memory_mb: int, files: dict[str, str | bytes] | None = None,
                     cpu_s: float | None = None, max_processes: int = 16, max_file_mb: int = 16,
                     max_output_bytes: int = 1 << 20) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox directory holding `files` (relative paths).

    `timeout_s` is the wall deadline (the whole process tree is killed at it); `cpu_s` the
    CPU-seconds limit (default: the wall deadline); `memory_mb` the address space of each
    process. Raises `SandboxUnavailable` (before running anything) where bwrap is missing
    or cannot start; `ValueError` for a file path that leaves the sandbox directory."""
    bwrap = bwrap_path()
    as_root = os.getuid() == 0
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as tmp:
        workdir = Path(tmp)
        for name, content in (files or {}).items():
            target = (workdir / name).resolve()
            if workdir.resolve() not in target.parents:
                raise ValueError(f"sandbox file {name!r} is outside the sandbox directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content.encode() if isinstance(content, str) else content)
        (workdir / "main.py").write_text(code)
        if as_root:  # the code runs as nobody; bwrap (root without capabilities) must still enter the directory
            for path in [workdir, *workdir.rglob("*")]:
                os.chown(path, NOBODY, NOBODY)
            workdir.chmod(0o755)
        limits = _limits(cpu_s=cpu_s if cpu_s is not None else timeout_s, memory_mb=memory_mb,
                         max_processes=max_processes, max_file_mb=max_file_mb, as_root=as_root)
        launcher = _LAUNCHER.format(limits=limits, nobody=NOBODY)
        argv = [*_bwrap_argv(bwrap, workdir, as_root), sys.executable, "-I", "-S", "-c", launcher]
        result = await _run(argv, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
    recorded = _RUN_SECONDS.get()
    if recorded is not None:
        recorded.append(result.wall_s)
    return result


async def _run(argv: list[str], *, timeout_s: float, max_output_bytes: int) -> SandboxResult:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                start_new_session=True)
    out, err, budget, over = bytearray(), bytearray(), [max_output_bytes], asyncio.Event()
    readers = asyncio.gather(_read_capped(proc.stdout, out, budget, over), _read_capped(proc.stderr, err, budget, over))
    over_waiter = asyncio.ensure_future(over.wait())
    timed_out = False
    try:
        done, _ = await asyncio.wait({readers, over_waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            timed_out = True
        if over.is_set() or timed_out:
            _kill_tree(proc.pid)
        await asyncio.wait_for(asyncio.shield(readers), timeout=10)
        code = await asyncio.wait_for(proc.wait(), timeout=10)
    finally:
        over_waiter.cancel()
        if proc.returncode is None:
            _kill_tree(proc.pid)
            await proc.wait()
    stderr = err.decode("utf-8", "replace")
    if code > 128:  # bwrap reports a child killed by signal N as 128 + N, as a shell does
        code = -(code - 128)
    if code == 1 and stderr.startswith("bwrap:"):
        raise SandboxUnavailable(f"bubblewrap could not start the sandbox ({stderr.strip()}): user namespaces may "
                                 "be disabled here; asyncrl never runs model-written code without isolation")
    stopped_by = _classify(code, stderr, timed_out=timed_out, output_over=over.is_set())
    return SandboxResult(exit_code=code, stdout=out.decode("utf-8", "replace"), stderr=stderr,
                         stopped_by=stopped_by, wall_s=time.monotonic() - started)


def _kill_tree(pid: int) -> None:
    """SIGKILL the sandbox's session: bwrap and, through its pid namespace, all it started."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # the session already ended, every process of it with it
        pass


async def passes_tests(solution: str, tests: str, *, timeout_s: float = 10.0, memory_mb: int = 512) -> float:
    """A reward helper: 1.0 when `tests` (Python, e.g. asserts that import `solution`) exit 0
    against `solution.py` in the sandbox, else 0.0. A sandbox that cannot start raises."""
    result = await run_python(tests, timeout_s=timeout_s, memory_mb=memory_mb, files={"solution.py": solution})
    return 1.0 if result.ok else 0.0


def describe(result: SandboxResult, *, max_chars: int = 2000) -> str:
    """A run as the tool message a model reads: its output, then what stopped it, if anything."""
    text = result.stdout
    if result.stderr:
        text += ("\n" if text else "") + result.stderr
    text = text[-max_chars:]
    if result.stopped_by is not None:
        text += f"\n[stopped by the sandbox's {result.stopped_by} limit]"
    elif result.exit_code != 0:
        text += f"\n[exit code {result.exit_code}]"
    return text.strip() or "(no output)"


PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run a Python program in a sandbox (no network, no files of the host) and read what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                       "required": ["code"]},
    },
}


async def python_tool(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512) -> str:
    """The `run_python` tool an agent calls: the program's output as the tool message."""
    return describe(await run_python(code, timeout_s=timeout_s, memory_mb=memory_mb))


def main(argv: list[str] | None = None) -> int:
    """`python -m asyncrl.tools.sandbox FILE.py`: run a file in the sandbox, print its output and what stopped
    it; exit 2 naming the package when the isolation layer is missing."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m asyncrl.tools.sandbox", description=main.__doc__)
    parser.add_argument("file")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--memory-mb", type=int, default=512)
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(run_python(Path(args.file).read_text(), timeout_s=args.timeout_s,
                                        memory_mb=args.memory_mb))
    except SandboxUnavailable as exc:
        print(f"asyncrl sandbox: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.stopped_by is not None:
        print(f"asyncrl sandbox: stopped by the {result.stopped_by} limit", file=sys.stderr)
    return result.exit_code if result.exit_code >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
