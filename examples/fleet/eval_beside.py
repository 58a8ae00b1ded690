"""Training steps/s on a fleet of ``asyncrl serve-engine`` servers with evaluation beside
training (``eval.urls``) against evaluation blocking it, side by side in one sitting.

    python examples/fleet/eval_beside.py [--config examples/addition/async.yaml] [--steps 30]
        [--eval-every 5] [--rounds 1] [--out DIR]

Three servers start on free loopback ports (``asyncrl serve-engine CONFIG
engine_server.port=0 rollout.num_threads=1``; ready once each prints its URL) and are
stopped at the end, also on failure. Then, per round, three runs of ``asyncrl train CONFIG
engine=remote`` on the same servers (each fresh run reloads the base weights there):

- ``blocking``: training on servers 1 and 2, ``eval.background=false`` (training waits for
  each evaluation, which runs on those two);
- ``own``: training on servers 1 and 2, evaluation beside it on server 3 (``eval.urls``);
- ``share``: ``remote.urls`` servers 1 and 2, ``eval.urls`` server 2: training on server 1
  alone, evaluation beside it on the share.

Each run's ``steps_per_s`` is its steps over the wall time of its logged steps (step 1's
start to the last step's end, ``training_seconds``: the evaluation before step 1 and the
one after the last step are outside it, the ones between inside it when they block);
``steps_per_s_with_evals`` its steps over the loop's whole span, every evaluation included
(``timeline.jsonl``: from the loop's start to its last event's end); ``command_wall_s`` the
whole command's, start-up included. Every process here shares
this machine's cores: on a small machine a server of evaluation's own competes with the
trainer and the training servers for them, which a fleet of separate machines would not.
Writes ``fleet_eval.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

READY_S = 300.0
"""How long a server may take to print its URL (a loaded machine importing torch)."""


class Server:
    """``asyncrl serve-engine`` in a process of its own, its stderr drained to ``log``."""

    def __init__(self, config: str, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "serve-engine", config, "engine=torch", "engine_server.port=0",
             "rollout.num_threads=1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        with open(self.log, "w") as out:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                out.write(line)
                out.flush()
                found = re.search(r"asyncrl serve-engine: .* at (http://\S+) ", line)
                if found and self.url is None:
                    self.url = found.group(1)
                    self._ready.set()
        self._ready.set()  # exited: wait_ready says so

    def wait_ready(self) -> str:
        if not self._ready.wait(READY_S) or self.url is None:
            raise SystemExit(f"serve-engine did not print its URL within {READY_S:g} s (or exited); see {self.log}")
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def train(config: str, out: Path, urls: list[str], eval_urls: list[str], steps: int, eval_every: int) -> dict:
    """One ``asyncrl train`` run; its steps/s, wall time, evaluations and placement line."""
    settings = [f"output_dir={out}", f"total_steps={steps}", f"eval_every={eval_every}", "engine=remote",
                f"remote.urls=[{','.join(urls)}]", "mode=async"]
    settings += [f"eval.urls=[{','.join(eval_urls)}]"] if eval_urls else ["eval.background=false"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", config, *settings],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"asyncrl train {' '.join(settings)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    from asyncrl.jsonl import read_jsonl
    from asyncrl.orchestrator.metrics import training_seconds

    rows = read_jsonl(out / "metrics.jsonl")
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "time/elapsed" in r]
    seconds = training_seconds(steps_rows)
    evals = [r for r in rows if "eval/reward_mean" in r]
    span = max(e["end"] for e in read_jsonl(out / "timeline.jsonl"))  # the loop's start to its last event's end
    placement = next((line.strip() for line in done.stderr.splitlines() if "evaluation" in line), "")
    return {"steps": len(steps_rows), "training_s": round(seconds, 2),
            "steps_per_s": round(len(steps_rows) / seconds, 3), "run_s": round(span, 2),
            "steps_per_s_with_evals": round(len(steps_rows) / span, 3), "command_wall_s": round(wall, 1),
            "evaluations": len(evals),
            "eval_s_total": round(sum(r["time/eval"] for r in evals), 2),
            "final_eval_reward": evals[-1]["eval/reward_mean"] if evals else None, "placement": placement}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/addition/async.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fleet-eval-"))
    out.mkdir(parents=True, exist_ok=True)
    servers = [Server(args.config, out / f"server{i}.log") for i in range(3)]
    try:
        s1, s2, s3 = (s.wait_ready() for s in servers)
        layouts = {"blocking": ([s1, s2], []), "own": ([s1, s2], [s3]), "share": ([s1, s2], [s2])}
        rows = []
        for round_ in range(args.rounds):
            for name, (urls, eval_urls) in layouts.items():
                result = train(args.config, out / f"{name}-{round_}", urls, eval_urls, args.steps, args.eval_every)
                rows.append({"layout": name, "round": round_, **result})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for server in servers:
            server.stop()
    summary = {"config": args.config, "steps": args.steps, "eval_every": args.eval_every, "rows": rows}
    (out / "fleet_eval.json").write_text(json.dumps(summary, indent=1))
    print(f"{'layout':<9} {'round':>5} {'steps/s':>8} {'train s':>8} {'w/ evals':>9} {'run s':>7} {'eval s':>7} "
          f"{'wall s':>7} {'eval':>6}")
    for r in rows:
        print(f"{r['layout']:<9} {r['round']:>5} {r['steps_per_s']:>8.3f} {r['training_s']:>8.1f} "
              f"{r['steps_per_s_with_evals']:>9.3f} {r['run_s']:>7.1f} {r['eval_s_total']:>7.1f} "
              f"{r['command_wall_s']:>7.1f} {r['final_eval_reward']:>6.3f}")
    print(f"wrote {out / 'fleet_eval.json'}")


if __name__ == "__main__":
    main()
