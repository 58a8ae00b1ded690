"""House rules a reader cannot keep by eye across 200 modules, checked on the source:

- an exception swallowed (``except …: pass``) says why, on the ``except`` or ``pass`` line:
  a silent one hides a bug the day its reason stops holding;
- a test looks only at what its own run created — the processes it started, the names they
  hold (``tests/own_resources.py``) — never the whole machine's ``/dev/shm`` or process
  table: on a shared machine other programs' entries come and go between its snapshots
  (issue 69: another program's ``psm_*`` failed three tests that pass alone).
"""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

from own_resources import alive, shm_held, shm_left

ROOT = Path(__file__).resolve().parents[1]
HELPER = "own_resources.py"  # the one module that may list /proc or /dev/shm whole
WHOLE_MACHINE_DIRS = {"/dev/shm", "/proc"}
WHOLE_MACHINE_CALLS = {"process_iter", "pids"}  # psutil's every-process listings


def silent_excepts(source: str) -> list[int]:
    """Lines of ``except …: pass`` handlers with no comment on the ``except`` or ``pass`` line."""
    lines = source.splitlines()
    return [h.lineno for h in ast.walk(ast.parse(source))
            if isinstance(h, ast.ExceptHandler) and all(isinstance(s, ast.Pass) for s in h.body)
            and not any("#" in lines[n - 1] for n in range(h.lineno, h.body[-1].lineno + 1))]


def whole_machine_looks(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each reference to a machine-wide listing: the directory
    ``/dev/shm`` or ``/proc`` itself (a path inside it built for one pid or one name, as
    ``f"/proc/{pid}/stat"``, is the test's own and passes), or psutil's process listings."""
    tree = ast.parse(source)
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings
                and node.value.rstrip("/") in WHOLE_MACHINE_DIRS):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Attribute) and node.attr in WHOLE_MACHINE_CALLS and \
                isinstance(node.value, ast.Name) and node.value.id == "psutil":
            found.append((node.lineno, f"psutil.{node.attr}"))
    return found


def test_the_checkers_see_a_silent_except_and_a_whole_machine_snapshot():
    assert silent_excepts("try:\n    f()\nexcept OSError:\n    pass\n") == [3]
    assert silent_excepts("try:\n    f()\nexcept OSError:  # gone already\n    pass\n") == []
    assert silent_excepts("try:\n    f()\nexcept OSError:\n    pass  # gone already\n") == []
    assert silent_excepts("try:\n    f()\nexcept OSError:\n    log()\n") == []
    before = 'import os, psutil\nshm_before = set(os.listdir("/dev/shm"))\nprocs = list(psutil.process_iter())\n'
    assert whole_machine_looks(before) == [(2, "/dev/shm"), (3, "psutil.process_iter")]
    assert whole_machine_looks('from pathlib import Path\nnames = list(Path("/proc/").iterdir())\n') == [(2, "/proc/")]
    own = 'pid = 1\nopen(f"/proc/{pid}/stat")\nopen(f"/dev/shm/{name}")\nerror = "shared memory (/dev/shm) short"\n'
    assert whole_machine_looks(own) == []


def test_every_swallowed_exception_says_why():
    silent = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "asyncrl").rglob("*.py"))
              for line in silent_excepts(path.read_text())]
    assert silent == [], "say on the except or pass line why swallowing is right there (or handle it): " + \
        ", ".join(silent)


def test_no_test_compares_the_whole_machine():
    looks = [f"{path.name}:{line}: {what}" for path in sorted((ROOT / "tests").glob("*.py"))
             if path.name not in (HELPER, Path(__file__).name)  # this one names the directories it looks for
             for line, what in whole_machine_looks(path.read_text())]
    assert looks == [], ("a test lists the whole machine's processes or /dev/shm; ask about its own run instead "
                         f"(tests/{HELPER}: descendants, alive, shm_held, shm_left): " + ", ".join(looks))


def test_the_helper_sees_a_name_a_killed_child_left_and_not_an_anonymous_block():
    name = f"asyncrl-test-{uuid.uuid4().hex}"
    child = subprocess.Popen([sys.executable, "-c", f"""
import mmap, os, sys, time
named = os.open("/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
anonymous = os.memfd_create("asyncrl-test")
for fd in (named, anonymous):
    os.ftruncate(fd, 4096)
maps = [mmap.mmap(fd, 4096) for fd in (named, anonymous)]
print("held", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n"
        assert shm_held([child.pid]) == {name}
        child.kill()
        child.wait()
        assert alive([child.pid]) == set() and shm_left({name}) == {name}  # killed: nothing unlinked it
    finally:
        child.kill()
        child.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")
