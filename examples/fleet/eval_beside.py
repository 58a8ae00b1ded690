"""Training steps/s on a fleet of inference servers with evaluation beside training
(``eval.urls``) against evaluation blocking it, side by side in one sitting.

    python examples/fleet/eval_beside.py [--config examples/addition/async.yaml] [--steps 30]
        [--eval-every 5] [--rounds 1] [--out DIR] [--set KEY=VALUE ...]
        [--server serve-engine | vllm --vllm-python PYTHON] [--servers 3]

Three servers (``--servers 2``: the ``own`` layout left out) start on free loopback ports and
are stopped at the end, also on failure: ``asyncrl serve-engine CONFIG engine_server.port=0
rollout.num_threads=1`` (ready once each prints its URL), or with ``--server vllm`` real
``vllm serve`` processes run by ``--vllm-python`` (an environment with vLLM, e.g. the lane's
``.ci/vllm install DIR``), their command the one ``asyncrl plan --server vllm`` prints
(``vllm_serve_for``; ready once ``/health`` answers), plus ``VLLM_CPU_OMP_THREADS_BIND=nobind``
and ``--enforce-eager`` as the vLLM lane starts its servers (several servers' threads on a few
cores; no compile at start). A model that ties its LM head is served, and trained, from the
copy ``asyncrl models untie`` makes of it (in ``--out``): vLLM's CPU build refuses it
otherwise. Then, per round, one run of ``asyncrl train CONFIG engine=remote`` per layout on
the same servers (each fresh run reloads the base weights there), in an order that rotates
by one each round (so no layout always runs first, after the servers' start, or last):

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
whole command's, start-up included; ``load_before``/``load_after`` the 1-minute load average
just before and after it (other jobs on a shared machine move every figure). Per layout,
the medians over the rounds. Every process here shares this machine's cores: on a small
machine a server of evaluation's own competes with the trainer and the training servers for
them, which a fleet of separate machines would not. ``--set``: settings for every run and
for the servers' command (``eval.num_tasks=32``...). Writes ``fleet_eval.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from asyncrl.plan.vllm_process import VllmServeProcess

READY_S = 600.0
"""How long a server may take to be ready (three vLLM servers loading at once on a loaded machine)."""
LAYOUTS = ("blocking", "own", "share")


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

    def wait_ready(self, deadline: float) -> str:
        if not self._ready.wait(max(0.0, deadline - time.monotonic())) or self.url is None:
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


def vllm_server(cfg, python: str, log: Path) -> VllmServeProcess:
    """``vllm serve`` as ``asyncrl plan --server vllm`` prints it for ``cfg`` (``vllm_serve_for``),
    run by ``python``, with the lane's additions."""
    from asyncrl.plan.fleet import vllm_serve_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env, words = vllm_serve_for(cfg, host="127.0.0.1", port=port, loopback=True, api_key=None)
    return VllmServeProcess({**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, words, python=python, port=port, log=log,
                            extra=["--enforce-eager"])


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def train(config: str, out: Path, urls: list[str], eval_urls: list[str], steps: int, eval_every: int,
          extra: list[str]) -> dict:
    """One ``asyncrl train`` run; its steps/s, wall time, evaluations and placement line."""
    settings = [*extra, f"output_dir={out}", f"total_steps={steps}", f"eval_every={eval_every}", "engine=remote",
                f"remote.urls=[{','.join(urls)}]", "mode=async"]
    settings += [f"eval.urls=[{','.join(eval_urls)}]"] if eval_urls else ["eval.background=false"]
    load_before = load_average()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", config, *settings],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    load_after = load_average()
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
            "final_eval_reward": evals[-1]["eval/reward_mean"] if evals else None, "placement": placement,
            "load_before": load_before, "load_after": load_after}


def served_model(config: str, extra: list[str], out: Path) -> list[str]:
    """``extra`` with ``model.path`` set to ``asyncrl models untie``'s copy where the config's
    model ties its head (vLLM's CPU build would be refused at connect); else as given."""
    from asyncrl.config import load_config
    from asyncrl.model_untie import ties_head, untie
    from asyncrl.policy import resolve_model_path

    source = resolve_model_path(load_config(config, extra).model.path)
    if not ties_head(source):
        return extra
    copy = out / f"{source.name}-untied"
    if not copy.exists():
        untie(source, copy)
    print(f"serving and training {copy} (asyncrl models untie {source})", flush=True)
    return [*extra, f"model.path={copy}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/addition/async.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every run and the servers' command (repeatable)")
    parser.add_argument("--server", choices=["serve-engine", "vllm"], default="serve-engine")
    parser.add_argument("--servers", type=int, choices=[2, 3], default=3,
                        help="2: blocking and share alone (a vLLM CPU server holds ~2.7 GB)")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="with --server vllm: the Python of an environment with vLLM")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fleet-eval-"))
    out.mkdir(parents=True, exist_ok=True)
    extra = list(args.set)
    servers: list[Server | VllmServeProcess] = []
    try:
        if args.server == "vllm":
            from asyncrl.config import load_config

            extra = served_model(args.config, extra, out)
            cfg = load_config(args.config, extra)
            servers = [vllm_server(cfg, args.vllm_python, out / f"server{i}.log") for i in range(args.servers)]
        else:
            servers = [Server(args.config, out / f"server{i}.log") for i in range(args.servers)]
        deadline = time.monotonic() + READY_S
        s1, s2, *s3 = (s.wait_ready(deadline) for s in servers)
        layouts = {"blocking": ([s1, s2], []), "own": ([s1, s2], s3), "share": ([s1, s2], [s2])}
        names = [name for name in LAYOUTS if layouts[name][1] or name == "blocking"]
        rows = []
        for round_ in range(args.rounds):
            for i in range(len(names)):
                name = names[(i + round_) % len(names)]
                urls, eval_urls = layouts[name]
                result = train(args.config, out / f"{name}-{round_}", urls, eval_urls, args.steps, args.eval_every,
                               extra)
                rows.append({"layout": name, "round": round_, **result})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for server in servers:
            server.stop()
    medians = {name: {key: statistics.median(r[key] for r in rows if r["layout"] == name)
                      for key in ("steps_per_s", "steps_per_s_with_evals", "eval_s_total")} for name in names}
    summary = {"config": args.config, "server": args.server, "settings": extra, "steps": args.steps,
               "eval_every": args.eval_every, "rows": rows, "medians": medians}
    (out / "fleet_eval.json").write_text(json.dumps(summary, indent=1))
    print(f"{'layout':<9} {'round':>5} {'steps/s':>8} {'train s':>8} {'w/ evals':>9} {'run s':>7} {'eval s':>7} "
          f"{'wall s':>7} {'eval':>6} {'load':>11}")
    for r in rows:
        print(f"{r['layout']:<9} {r['round']:>5} {r['steps_per_s']:>8.3f} {r['training_s']:>8.1f} "
              f"{r['steps_per_s_with_evals']:>9.3f} {r['run_s']:>7.1f} {r['eval_s_total']:>7.1f} "
              f"{r['command_wall_s']:>7.1f} {r['final_eval_reward']:>6.3f} "
              f"{r['load_before']:>5.1f}-{r['load_after']:<5.1f}")
    for name, m in medians.items():
        print(f"{name:<9} {'median':>5} {m['steps_per_s']:>8.3f} {'':>8} {m['steps_per_s_with_evals']:>9.3f} "
              f"{'':>7} {m['eval_s_total']:>7.1f}")
    print(f"wrote {out / 'fleet_eval.json'}")


if __name__ == "__main__":
    main()
