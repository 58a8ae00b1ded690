"""A command's peak memory, all its processes together: every 0.5 s the PSS (proportional
set size: shared pages split between the processes sharing them, so the sum is what the
run holds) of its whole process tree, from /proc/PID/smaps_rollup; at the end, on stderr,
the peak of that sum and the largest single process's peak RSS (what `top` shows one
process at). Linux only.

    python examples/memory/peak_pss.py asyncrl train examples/countdown/async.yaml
"""

import json
import os
import subprocess
import sys
import time

def tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    kids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        kids.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out

def field(pid: int, name: str) -> int:
    """``name`` (kB) of ``pid``'s smaps_rollup; 0 once it has exited."""
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith(name + ":"):
                return int(line.split()[1])
    except OSError:
        return 0
    return 0

def main() -> int:
    proc = subprocess.Popen(sys.argv[1:])
    peak_pss = peak_rss = peak_n = 0
    while proc.poll() is None:
        pids = tree(proc.pid)
        pss = sum(field(p, "Pss") for p in pids)
        rss = max((field(p, "Rss") for p in pids), default=0)
        peak_pss, peak_rss, peak_n = max(peak_pss, pss), max(peak_rss, rss), max(peak_n, len(pids))
        time.sleep(0.5)
    print(json.dumps({"exit": proc.returncode, "peak_pss_all_mb": peak_pss / 1024,
                      "peak_rss_largest_mb": peak_rss / 1024, "max_processes": peak_n}), file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
