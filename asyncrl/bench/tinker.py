"""``asyncrl bench tinker``: a learner behind a Tinker-API URL against the learner in
process, side by side in one run, on the same batch and the same model.

Two phases:

- ``step``: one training step of asyncrl's learner (``LearnerWorker.train_step``, LoRA,
  ``decoupled_ppo`` in bypass) and the same step through ``asyncrl serve-tinker`` in a child
  process (``TinkerLearnerWorker.train_step``: ``forward_backward`` + ``optim_step`` over
  Tinker's SDK), alternately, ``repeats`` times each after a warm-up; then each side's
  ``publish`` (the weights the engines load: in process the LoRA update, through the URL the
  adapters saved, listed, downloaded and read back). Ratio: the URL's median over the
  in-process median. The server is idle while the learner in process steps, and the
  learner in process idle while the server steps: each side has every core in turn.
- ``run`` (``run_steps`` > 0): ``asyncrl train`` of the addition example (LoRA, bypass)
  for ``run_steps`` steps in process and through the URL, each in a child process, one
  after the other; ratio of their wall times (the whole run: engines, staleness gate,
  evaluation off).

Where the time goes is in the report: the URL step's client-side split (``forward_backward``
answered, then ``optim_step`` answered), its publish's parts, and the server's own compute is
what is left of the in-process step's time.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from asyncrl.bench.learner import LearnerBenchSettings, bench_batch
from asyncrl.bench.progress import phase
from asyncrl.config import Config, ConfigError, Section, apply_overrides, load_config, save_config, validate

SERVER_START_S = 180.0
"""How long the child server may take to load its model and print its URL."""


class TinkerBenchSettings(Section):
    model_path: str = "models/addition-tiny"
    """The served and the in-process base model (a directory or a name ``asyncrl models list`` knows)."""
    base_model: str = "bench-base"
    """The name the server serves the model under (what the client asks for)."""
    rows: int = Field(8, ge=1)
    """Trajectories in the step's batch."""
    prompt_tokens: int = Field(32, ge=1)
    response_tokens: int = Field(96, ge=2)
    """The longest response; lengths are drawn from [response_tokens / 2, response_tokens] (both
    clamped to the model's context)."""
    lora_rank: int = Field(16, ge=1)
    repeats: int = Field(5, ge=1)
    run_steps: int = Field(0, ge=0)
    """Steps of the ``run`` phase (0: no run phase)."""
    run_config: str = "examples/addition/async.yaml"
    server: list[str] = Field([], strict=False)
    """The server's own settings, ``key=value`` as on its command line (``tinker.recompute_layers=false``)."""
    seed: int = 0


def _config(s: TinkerBenchSettings, output_dir: Path, url: str | None = None, server: list[str] = ()) -> Config:
    return load_config(None, [*server, f"model.path={s.model_path}", "model.device=cpu", "model.lora=true",
                              f"model.lora.rank={s.lora_rank}", "algorithm.bypass=true", "total_steps=1000",
                              f"output_dir={output_dir}", f"tinker.base_model={s.base_model}", f"seed={s.seed}",
                              *([f"learner.url={url}"] if url else [])])


class ChildServer:
    """``asyncrl serve-tinker`` in a child process on a free port: entered once its URL is
    printed, stopped (SIGTERM, then kill) when left, failed or not."""

    def __init__(self, cfg: Config, directory: Path) -> None:
        self.path = directory / "serve.yaml"
        save_config(cfg, self.path)
        self.log = directory / "serve.log"
        self.process: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> ChildServer:
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve-tinker", str(self.path),
                                             "tinker.port=0"], stdout=subprocess.PIPE, stderr=log, text=True)
        deadline = time.monotonic() + SERVER_START_S
        assert self.process.stdout is not None
        while not self.url:
            line = self.process.stdout.readline()
            if line.startswith("http"):
                self.url = line.strip()
            elif not line and self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"bench tinker: serve-tinker did not print its URL within {SERVER_START_S:.0f} s "
                                   f"(exit {self.process.returncode}); its log: {self.log.read_text()[-2000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _median(times: list[float]) -> float:
    return statistics.median(times)


def step_phase(s: TinkerBenchSettings, directory: Path) -> dict[str, Any]:
    """The step and publish of each learner on the same batch, alternately (module docstring)."""
    from transformers import AutoConfig

    from asyncrl.policy import resolve_model_path
    from asyncrl.runtime.learner_worker import LearnerWorker
    from asyncrl.runtime.tinker_learner import TinkerLearnerWorker

    model_dir = resolve_model_path(s.model_path).resolve()
    shape = AutoConfig.from_pretrained(model_dir)
    batch = bench_batch(LearnerBenchSettings(rows=s.rows, prompt_tokens=s.prompt_tokens,
                                             response_tokens=s.response_tokens, seed=s.seed),
                        shape.vocab_size, shape.max_position_embeddings)
    local_cfg = _config(s, directory / "local")
    with ChildServer(_config(s, directory / "server", server=s.server), directory) as server:
        remote = TinkerLearnerWorker(_config(s, directory / "url", server.url))
        local = LearnerWorker(local_cfg, num_threads=os.cpu_count())
        local.join()
        remote.join()
        times: dict[str, list[float]] = {"local_step": [], "url_step": [], "url_forward_backward": [],
                                         "local_publish": [], "url_publish": []}
        try:
            with phase("tinker", f"step: {s.rows} rows, {int(batch.loss_mask.sum())} model tokens, "
                                 f"{model_dir.name}", total=s.repeats + 1, unit="step") as progress:
                for i in range(s.repeats + 1):
                    start = time.perf_counter()
                    ours = local.train_step(batch, False)
                    local_step = time.perf_counter() - start
                    start = time.perf_counter()
                    metrics = remote.train_step(batch, False)
                    url_step = time.perf_counter() - start
                    if not i:  # the same loss from the same weights (LoRA's B starts at 0): the same step
                        first_loss = {"local": ours["actor/loss"], "url": metrics["actor/loss"]}
                    start = time.perf_counter()
                    local.publish()
                    local_publish = time.perf_counter() - start
                    start = time.perf_counter()
                    remote.publish()
                    url_publish = time.perf_counter() - start
                    if i:  # the first of each warms up (allocations, thread pools, the server's first client)
                        times["local_step"].append(local_step)
                        times["url_step"].append(url_step)
                        times["url_forward_backward"].append(metrics["time/learner_url_forward_backward_s"])
                        times["local_publish"].append(local_publish)
                        times["url_publish"].append(url_publish)
                    progress.advance()
                medians = {key: _median(values) for key, values in times.items()}
                ratio = medians["url_step"] / medians["local_step"]
                progress.figure = (f"step {medians['url_step']:.3f} s through the URL, {medians['local_step']:.3f} s "
                                   f"in process: {ratio:.2f}x")
        finally:
            remote.leave()
            local.leave()
    return {"model": model_dir.name, "model_tokens": int(batch.loss_mask.sum()), "times": times,
            "medians": medians, "step_ratio": ratio, "first_loss": first_loss,
            "publish_ratio": medians["url_publish"] / max(medians["local_publish"], 1e-9)}


def _train(args: list[str], out: Path) -> float:
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        code = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", *args, f"output_dir={out}"],
                              stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"bench tinker: asyncrl train {' '.join(args)} exited {code}; its log: "
                           f"{out.with_suffix('.log')}")
    return time.perf_counter() - start


def run_phase(s: TinkerBenchSettings, directory: Path) -> dict[str, Any]:
    """``asyncrl train`` in process, then through the URL, wall time each (module docstring)."""
    args = [s.run_config, "model.lora=true", f"model.lora.rank={s.lora_rank}", "algorithm.bypass=true",
            f"total_steps={s.run_steps}", "eval_every=0", f"seed={s.seed}", f"model.path={s.model_path}"]
    with phase("tinker", f"run: {s.run_config}, {s.run_steps} steps, in process then through the URL") as progress:
        local = _train(args, directory / "run-local")
        with ChildServer(_config(s, directory / "run-server", server=s.server), directory) as server:
            url = _train([*args, f"learner.url={server.url}", f"tinker.base_model={s.base_model}"],
                         directory / "run-url")
        progress.figure = f"{url:.1f} s through the URL, {local:.1f} s in process: {url / local:.2f}x"
    return {"local_s": local, "url_s": url, "ratio": url / local}


def run_tinker_bench(overrides: list[str]) -> dict[str, Any]:
    s = validate(TinkerBenchSettings, apply_overrides({}, overrides))
    try:
        import tinker  # noqa: F401
    except ImportError:
        raise ConfigError("bench tinker needs Tinker's SDK: pip install 'asyncrl[tinker]'") from None
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-tinker-") as tmp:
        result: dict[str, Any] = {"settings": s.model_dump(), "step": step_phase(s, Path(tmp))}
        if s.run_steps:
            result["run"] = run_phase(s, Path(tmp))
    print(table(result))
    return result


def table(result: dict[str, Any]) -> str:
    step = result["step"]
    m = step["medians"]
    lines = [f"{'':34s} {'in process':>11s} {'through URL':>12s} {'ratio':>6s}",
             f"{'train step, s (median)':34s} {m['local_step']:11.3f} {m['url_step']:12.3f} {step['step_ratio']:6.2f}",
             f"{'  of which forward_backward, s':34s} {'':11s} {m['url_forward_backward']:12.3f}",
             f"{'publish (weights out), s':34s} {m['local_publish']:11.3f} {m['url_publish']:12.3f} "
             f"{step['publish_ratio']:6.2f}"]
    if "run" in result:
        run = result["run"]
        lines.append(f"{'asyncrl train, wall s':34s} {run['local_s']:11.1f} {run['url_s']:12.1f} {run['ratio']:6.2f}")
    return "\n".join(lines)
