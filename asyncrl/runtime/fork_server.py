"""The fork server the learner's rank processes come from: a fresh interpreter of our own
that imports the learner once, then forks one process per rank on request.

Why not :mod:`multiprocessing`'s ``forkserver``: its children re-run the driver's
``__main__`` (a script without an ``if __name__ == "__main__":`` guard ran twice; run from
standard input it died looking for a file ``<stdin>``), and nothing ties them to the
driver's life (a SIGKILLed driver left the server, a hung learner and the resource
tracker behind, parent 1). This one is started as ``python -c``: it never imports the
user's ``__main__``, so ``train`` works from a script, standard input, ``python -c``, a
thread or a notebook alike. Not a fork of the driver itself: that copies its threads'
locks mid-use. Not a fresh interpreter per rank: importing torch and transformers costs
seconds of CPU, paid here once per driver.

Lifetimes, the invariant: **nothing of it outlives the driver.**
- The server reads its requests from a socket whose other end only the driver holds; when
  the driver is gone, however it died, the socket reads end-of-file and the server kills
  every child (SIGKILL also ends a stopped one) and exits.
- Each child asks the kernel for SIGKILL when the server dies (``PR_SET_PDEATHSIG``), so a
  SIGKILLed server takes its children with it too.
- A child's exit status reaches the driver through a pipe of its own, which the server
  writes when it reaps the child; the pipe closing with nothing written means the server
  itself is gone, which the driver reports as that, not as the rank's exit code.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

_STATUS = struct.Struct("i")
_MAX_MESSAGE = 1 << 17  # one datagram of the request socket: a rank's config pickles to a few KiB
_PR_SET_PDEATHSIG = 1


class ForkServerGone(RuntimeError):
    """The fork server died: its rank processes died with it."""


class ForkedProcess:
    """The driver's view of one child of the fork server, shaped like a
    :class:`multiprocessing.Process` where the rank transport uses it."""

    def __init__(self, pid: int, status_fd: int, name: str) -> None:
        self.pid, self.name = pid, name
        self.sentinel = status_fd  # readable once the child exited or the server is gone
        self._exitcode: int | None = None
        self._server_gone = False
        self._lock = threading.Lock()  # the status is read once, by whichever thread asks first

    def _settle(self, timeout: float | None) -> bool:
        if self._exitcode is not None or self._server_gone:
            return True
        ready, _, _ = select.select([self.sentinel], [], [], timeout)
        if not ready:
            return False
        with self._lock:
            if self._exitcode is None and not self._server_gone:
                data = os.read(self.sentinel, _STATUS.size)
                if len(data) == _STATUS.size:
                    self._exitcode = _STATUS.unpack(data)[0]
                else:
                    self._server_gone = True
        return True

    def join(self, timeout: float | None = None) -> None:
        self._settle(timeout)

    def is_alive(self) -> bool:
        return not self._settle(0)

    @property
    def exitcode(self) -> int | None:
        """As :mod:`multiprocessing` gives it: the exit code, or minus the killing signal;
        ``None`` while alive or when the server died before it could say."""
        self._settle(0)
        return self._exitcode

    @property
    def server_gone(self) -> bool:
        """The fork server died, so nobody can say how this child ended (it was killed with it)."""
        self._settle(0)
        return self._server_gone

    def kill(self) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended between the check and the kill: what the kill was for
                pass

    def close(self) -> None:
        os.close(self.sentinel)


class ForkServer:
    """The driver's handle on its fork server, started at the first :meth:`fork`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _ensure_running(self) -> socket.socket:
        if self._proc is not None and self._proc.poll() is None:
            assert self._sock is not None
            return self._sock
        self.stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.set_inheritable(False)
        code = "from asyncrl.runtime.fork_server import serve; serve()"
        env = {**os.environ, "ASYNCRL_FORK_SERVER_FD": str(theirs.fileno())}
        # a session of its own: a terminal's Ctrl-C or a signal to the driver's process group
        # is the driver's to act on (finish the step, checkpoint); the server follows the driver
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._sock = ours
        return ours

    def fork(self, target: Callable[..., Any], args: tuple[Any, ...], fds: list[int], name: str) -> ForkedProcess:
        """A child running ``target(*fds_as_received, *args)``; ``target`` must be importable
        by name. The child's ``sys.path`` and working directory are the caller's now."""
        call = pickle.dumps((target, args), protocol=pickle.HIGHEST_PROTOCOL)  # read once sys.path is the caller's
        payload = pickle.dumps((list(sys.path), os.getcwd(), name, call), protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > _MAX_MESSAGE:
            raise ValueError(f"a rank's arguments pickle to {len(payload)} bytes, more than {_MAX_MESSAGE}")
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                sock = self._ensure_running()
                try:
                    socket.send_fds(sock, [payload], [status_w, *fds])
                    reply = sock.recv(64)
                except OSError as exc:
                    reply = b""
                    detail = str(exc)
                else:
                    detail = "no reply"
                if len(reply) != _STATUS.size:
                    code = self._proc.poll() if self._proc is not None else None
                    raise ForkServerGone(f"the learner's fork server (pid {self._proc.pid if self._proc else '?'}) "
                                         f"died before it started {name} ({detail}; exit code {code})")
        finally:
            os.close(status_w)
        return ForkedProcess(_STATUS.unpack(reply)[0], status_r, name)

    def stop(self) -> None:
        """End the server (its children are killed with it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


_server = ForkServer()


def fork_server() -> ForkServer:
    """This process's fork server (one per driver, started at its first fork)."""
    return _server


# ---------------------------------------------------------------- the server's side
def serve() -> None:
    """The server's main loop (``python -c``): import the learner once, then fork on request."""
    sock = socket.socket(fileno=int(os.environ.pop("ASYNCRL_FORK_SERVER_FD")))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to act on
    import asyncrl.runtime.learner_worker  # noqa: F401  (the preload: every child starts with it)

    children: dict[int, int] = {}  # pid -> the status pipe's write end
    while True:
        ready, _, _ = select.select([sock], [], [], 0.2)
        _reap(children)
        if not ready:
            continue
        try:
            payload, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 8)
        except OSError:
            payload, fds = b"", []
        if not payload:  # the driver is gone: take every child with us
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # already gone (its status not yet reaped): nothing left to end
                    pass
            os._exit(0)
        status_w, *child_fds = fds
        pid = os.fork()
        if pid == 0:
            sock.close()
            for fd in children.values():
                os.close(fd)
            os.close(status_w)
            _child(payload, child_fds)
        for fd in child_fds:
            os.close(fd)
        children[pid] = status_w
        sock.send(_STATUS.pack(pid))


def _reap(children: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = children.pop(pid, None)
        if fd is not None:
            code = os.waitstatus_to_exitcode(status)
            try:
                os.write(fd, _STATUS.pack(code))
            except OSError:  # the driver closed its end: nobody to tell
                pass
            os.close(fd)


def _child(payload: bytes, fds: list[int]) -> None:
    """A forked child: die with the server, take the driver's path, run the target, exit."""
    code = 1
    try:
        _die_with_parent()
        sys_path, cwd, name, call = pickle.loads(payload)
        sys.path[:] = sys_path
        os.chdir(cwd)
        _set_title(name)
        target, args = pickle.loads(call)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        target(*fds, *args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent() -> None:
    """SIGKILL when the server dies (Linux); checked after, in case it died before the ask."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the server's own kill on the driver's exit remains
        pass
    if os.getppid() != parent:
        os._exit(1)


def _set_title(name: str) -> None:
    """The process's name in ``ps``/``top`` (Linux; 15 bytes), so a rank is recognisable."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the rank keeps Python's name, and runs the same
        pass
