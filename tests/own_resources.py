"""What a test's own run holds: its processes and the shared-memory names they have open.

The machine is shared: other programs' ``/dev/shm`` entries (``psm_*``, ``sem.*``) and
processes come and go while a test runs, so a test that compares the whole machine's
``/dev/shm`` or process table before and after fails for what another program did. A test
asks instead about the processes its run started (:func:`descendants` of the pid it
launched) and the names those processes hold (:func:`shm_held`), read from ``/proc``.
This is the one module allowed to list ``/proc`` or ``/dev/shm`` whole:
``tests/test_house_rules.py`` fails for a test that does it anywhere else.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

SHM = "/dev/shm/"


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (which may hold spaces); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (its children, theirs, …), from ``/proc``: the
    whole table is read, and only ``pid``'s subtree kept."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None and fields[0] not in "ZX":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: Iterable[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie counts as gone)."""
    return {pid for pid in pids if (fields := _stat_fields(pid)) is not None and fields[0] not in "ZX"}


def shm_held(pids: Iterable[int]) -> set[str]:
    """The ``/dev/shm`` names that ``pids`` have mapped or open now (``psm_…``,
    ``sem.…``, ``torch_…``), from each one's ``/proc/<pid>/maps`` and ``fd``; a name
    already unlinked (``(deleted)``) is left out: it can no longer be left behind. An
    anonymous block (``memfd_create``) has no such name, so it never appears here."""
    names: set[str] = set()
    for pid in pids:
        paths = []
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths += [line.split(None, 5)[5].strip() for line in f if SHM in line]
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    paths.append(os.readlink(f"{fd_dir}/{fd}"))
                except OSError:  # closed between the listing and the read: it held nothing then
                    continue
        except OSError:  # the process ended (or is not ours to read): it holds nothing now
            continue
        names |= {p.removeprefix(SHM) for p in paths if p.startswith(SHM) and not p.endswith(" (deleted)")}
    return names


def shm_left(names: Iterable[str]) -> set[str]:
    """Those of ``names`` (from :func:`shm_held`) still in ``/dev/shm``."""
    return {name for name in names if os.path.exists(SHM + name)}


def is_anonymous(fd: int, pid: int | str = "self") -> bool:
    """Whether descriptor ``fd`` of ``pid`` is an anonymous memory file (no name to leave)."""
    return os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:")
