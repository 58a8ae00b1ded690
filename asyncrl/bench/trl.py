"""``asyncrl bench trl``: TRL's ``GRPOTrainer`` against asyncrl ``sync`` and ``async`` in
one run, same model directory, task, reward function, group size, batch and learning
rate (optional dependency ``trl``), each run in a fresh process of its own.

Matched: model and tokenizer (the same directory), Countdown train tasks (same seed),
reward function, n samples per task, tasks per step, learning rate, temperature, max
response length, ε_low/ε_high, no KL (β = 0), group-normalised advantages, token-level
loss aggregation, no zero-variance filtering, no activation checkpointing (TRL 1.x's
``GRPOConfig`` turns gradient checkpointing on by default; asyncrl's learner keeps its
activations, so the bench turns TRL's off: recomputing them would slow TRL's backward
pass for a memory saving neither side needs here; docs/results.md says since when).
Device and precision: TRL trains on the device asyncrl's learner uses (``model.device``:
on CUDA when there is one) and in its precision: weights loaded in ``model.dtype``, and
bf16 autocast (``GRPOConfig(bf16=True)``: float32 master weights, bf16 matmuls) exactly
where asyncrl's learner autocasts (``learner.autocast``; by default on CUDA). Each system
in ``bench.json`` says its ``device``, ``dtype`` and ``autocast``.
Not matched, and why: TRL generates with
``model.generate`` in the training process (asyncrl uses its own engine — that is what
is being compared); TRL computes the old-policy logprobs itself while asyncrl uses the
engine's behavior logprobs with a truncated importance weight.

Held-out time-to-target. Each system saves a Hugging Face checkpoint every ``eval_every``
steps and at its last step (asyncrl: ``save_every``; TRL: a callback calling
``save_pretrained``), stamped with the training wall time at which it was taken. After
all three runs, every checkpoint, and the start policy once (step 0, time 0, shared by
all three), is scored by the same evaluator: ``asyncrl eval``'s ``run_eval`` on the
Countdown validation split (the first ``eval_tasks`` tasks, ``eval_samples`` samples
each, the evaluator's temperature, ``max_tokens``; per-sample seeds, so every checkpoint
sees the same draws). Evaluation runs after training, so it slows none of the clocks.
Saving does run inside them, and is material: an asyncrl save also writes the optimizer
state and flushes the logs, ten times a TRL save of weights and tokenizer (docs/design.md),
a few % of a 40-step run. So each save is timed and its duration subtracted from
every later time stamp and from ``wall_s`` (``save_s``: the total subtracted).

Target rule (``target_rule``): the held-out reward of TRL's last checkpoint. A system's
``time_to_target_s`` is the time stamp of its first checkpoint (step 0 included) whose
held-out reward reaches it, ``None`` if none does. Where TRL ends no better than it
started (``target_above_start`` false: short runs, as held-out reward moves slowly on
this task), every system is at the target at time 0 and the ratio is ``None``; the
table says so. The training reward curve stays in ``train_curve``; ``final_reward`` is
its mean over the last ``smooth`` steps.

Several batch sizes in one sitting (``batch_sizes=[4,8,16]``, groups per step; it
overrides ``batch_size``): the three systems train at each size in turn, smallest first
as listed, and each size's results go under ``sizes``, keyed ``"BxG"`` (``"4x8"``); the
top-level keys are the first size's, as for a single one. ``held_out=false``: a
speed-only run: no checkpoints are saved inside the clocks and none is scored
(``time_to_target_s`` is then ``None`` and the table says skipped).

Any task, several seeds. ``config=examples/smollm2/train.yaml`` takes the model, the task
(its train split in the order asyncrl's trainer draws it, its validation split for the
held-out score), the reward function, the chat-template switch, ``sampling.max_tokens``
and the temperature from an ``asyncrl train`` config, for both sides: TRL gets the same
prompts (chat messages when the config renders them through the chat template, else
the plain text) and a reward function that calls the config's own on each completion.
Without it the task is Countdown on ``models/countdown-tiny``. ``seeds=3`` repeats the
whole sitting with seeds ``seed``, ``seed + 1``, … (each under ``seed_N/``) and reports,
per system, the time to target of every seed, how many reached it, and the mean with a
Student-t 95 % interval over those that did; the target is each seed's own TRL final
score unless ``target=`` fixes one for all.
"""

from __future__ import annotations

import multiprocessing
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from asyncrl.bench.progress import phase
from asyncrl.bench.trl_report import print_seed_table, print_size_table, print_table, summarise_seeds
from asyncrl.config import Config, ConfigError, EvalConfig, Section, apply_overrides, load_config, validate
from asyncrl.jsonl import read_jsonl
from asyncrl.orchestrator.eval_command import run_eval
from asyncrl.orchestrator.task_stream import TaskStream
from asyncrl.orchestrator.trainer import Trainer
from asyncrl.policy import resolve_device, resolve_model_path
from asyncrl.rollout.workflows.registry import build_reward_fn, build_tasks
from asyncrl.tasks.base import Task

SYSTEMS = ("trl", "asyncrl_sync", "asyncrl_async")
TARGET_RULE = "held-out reward of TRL's last checkpoint (step = steps)"


class TrlBenchSettings(Section):
    config: str | None = None
    """An ``asyncrl train`` config whose model, task, reward function, chat-template switch,
    ``sampling.max_tokens`` and temperature both sides use; None: Countdown on the tiny policy."""
    model_path: str | None = None
    """The policy both sides start from; None: the config's ``model.path``, else ``models/countdown-tiny``."""
    steps: int = Field(40, ge=2)
    asyncrl_steps: int | None = Field(None, ge=2)
    """asyncrl's steps (both modes); None: ``steps``. More lets the faster side train on
    through TRL's wall time, so its time to target is not cut off at TRL's step count."""
    batch_size: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    lr: float = Field(3e-4, gt=0)
    max_tokens: int | None = Field(None, ge=1)
    """Response tokens; None: the config's ``sampling.max_tokens``, else 24."""
    smooth: int = Field(5, ge=1)
    seed: int = 0
    eval_every: int = Field(10, ge=1)
    """Steps between checkpoints scored on held-out tasks (the last step always is)."""
    eval_tasks: int = Field(128, ge=1)
    """Countdown validation tasks per held-out evaluation (the first N of the split)."""
    eval_samples: int = Field(2, ge=1)
    """Samples per validation task."""
    batch_sizes: list[Annotated[int, Field(ge=1)]] | None = None
    """Tasks per step for each size to measure, one after another (overrides ``batch_size``)."""
    held_out: bool = True
    """Save and score checkpoints on held-out tasks; false: samples/s only (no saves, no evaluation)."""
    seeds: int = Field(1, ge=1)
    """Sittings, with seeds ``seed``, ``seed + 1``, …: time to target per seed and its interval."""
    target: float | None = None
    """A held-out reward every system must reach; None: each seed's TRL final (``target_rule``)."""
    async_sharing: list[Literal["colocated", "colocated_learner", "turns"]] = []
    """Also train ``async`` with each of these ``rollout.thread_sharing`` settings (system
    ``asyncrl_async_<setting>``, run after ``asyncrl_async``, which keeps ``split``), so the
    ways of sharing the cores and ``sync`` are measured in one sitting."""
    ablations: dict[str, list[str]] = {}
    """Also train ``sync`` once per entry, with that entry's ``asyncrl train`` overrides on
    top of the bench's own (system ``asyncrl_sync_<name>``, run after the others): one
    change at a time against TRL and plain ``sync`` in the same sitting, to find what moves
    per-sample learning (``'ablations.beta2_999=["optim.betas=[0.9,0.999]"]'``). An override
    of a key the bench sets itself (``mode``, ``total_steps``, ``batch_size``, …) is refused."""
    ablation_modes: list[Literal["sync", "async"]] = ["sync"]
    """The schedules each ablation trains in (system ``asyncrl_<mode>_<name>``): ``["sync", "async"]``
    asks whether a change that helps ``sync`` per sample also helps ``async``, whose generation
    overlaps the learner and so may pay less for it (the zero-variance filter's refills)."""
    keep_checkpoints: bool = False
    """Keep every checkpoint once scored; false: each is deleted after its held-out score is
    written (an asyncrl checkpoint holds the optimizer state, twice the weights: three seeds of
    the SmolLM2 bench once filled a disk; docs/design.md has the sizes)."""

    def sizes(self) -> list[int]:
        return list(self.batch_sizes) if self.batch_sizes else [self.batch_size]

    def steps_of(self, system: str) -> int:
        """Steps ``system`` trains: TRL ``steps``, asyncrl's modes ``asyncrl_steps`` (or ``steps``)."""
        return self.steps if system == "trl" else self.asyncrl_steps or self.steps

    def label(self) -> str:
        """This size's key in ``sizes``: tasks × samples per step."""
        return f"{self.batch_size}x{self.group_size}"


def task_config(s: TrlBenchSettings, overrides: list[str]) -> Config:
    """The run's config: ``s.config`` (or Countdown on the tiny policy) with the bench's
    model, seed, response length and ``overrides``."""
    model = [f"model.path={s.model_path}"] if s.model_path else []
    tokens = [f"sampling.max_tokens={s.max_tokens}"] if s.max_tokens else []
    if s.config is None:
        base = ["model.path=models/countdown-tiny", "task.name=countdown", "sampling.max_tokens=24",
                "sampling.temperature=1.0"]
        return load_config(None, [*base, *model, f"seed={s.seed}", *tokens, *overrides])
    return load_config(s.config, [*model, f"seed={s.seed}", *tokens, *overrides])


def precision(cfg: Config) -> dict[str, str]:
    """The device and precision asyncrl's learner trains in under ``cfg`` (``learner.autocast``
    resolved as the trainer resolves it), which TRL is given too."""
    device = resolve_device(cfg.model.device)
    autocast = cfg.learner.autocast or ("bfloat16" if device.type == "cuda" else "off")
    return {"device": device.type, "dtype": cfg.model.dtype, "autocast": autocast}


def trl_precision_args(side: dict[str, str]) -> dict[str, Any]:
    """``GRPOConfig``'s arguments for ``side`` (``precision``'s dict): the CPU only where
    asyncrl is on it, bf16 autocast where asyncrl autocasts, the weights in its dtype."""
    return {"use_cpu": side["device"] == "cpu", "bf16": side["autocast"] == "bfloat16",
            "model_init_kwargs": {"dtype": side["dtype"]}}


def trl_prompt(cfg: Config, task: Task) -> Any:
    """The prompt as asyncrl's single-turn workflow renders it: chat messages through the
    chat template, or the plain text."""
    if task.messages is not None:
        return list(task.messages)
    if cfg.workflow.use_chat_template:
        return [{"role": "user", "content": task.prompt}]
    return task.prompt


class Run:
    """One system's training: its reward curve and its checkpoints, on a clock that starts
    at the first step and excludes the time spent saving."""

    def __init__(self) -> None:
        self.train_curve: list[tuple[float, float]] = []  # (time s, training reward) per step
        self.checkpoints: list[tuple[int, float, Path]] = []  # (step, time s, HF model directory)
        self.save_s = 0.0  # time spent saving inside the clock (subtracted from it)
        self.wall_s = 0.0


def checkpoint_steps(s: TrlBenchSettings, steps: int | None = None) -> list[int]:
    """Every ``eval_every`` steps and the last of ``steps`` (default ``s.steps``)."""
    if not s.held_out:
        return []
    steps = steps or s.steps
    return sorted({*range(s.eval_every, steps + 1, s.eval_every), steps})


def _smoothed(curve: list[tuple[float, float]], k: int) -> list[tuple[float, float]]:
    return [(t, statistics.mean(r for _, r in curve[max(0, i - k + 1):i + 1])) for i, (t, _) in enumerate(curve)]


def time_to_target(held_out: list[dict[str, Any]], target: float) -> float | None:
    """The time of the first checkpoint, in step order, whose held-out reward reaches ``target``."""
    return next((p["time_s"] for p in sorted(held_out, key=lambda p: p["step"])
                 if p["reward_mean"] >= target - 1e-9), None)


BENCH_KEYS = ("output_dir", "mode", "max_staleness", "rollout.thread_sharing", "partial_rollout", "total_steps",
              "batch_size", "group_size", "eval_every", "save_every", "keep_last", "save_every_minutes")
"""The keys of ``_asyncrl_run``'s overrides that shape the run (schedule, sizes, checkpoints): an
ablation that changed one would not be the bench's run. Its learning settings matched to TRL
(``optim.lr``, ``algorithm.filter_zero_variance``) are what ablations are for, so not here."""


def check_ablations(ablations: dict[str, list[str]]) -> None:
    """Refuse, naming the entry, an ablation without overrides or one that overrides a key
    the bench itself sets (the arms must differ from ``sync`` only in what they name)."""
    for name, overrides in ablations.items():
        if not overrides:
            raise ConfigError(f"ablations.{name}: no overrides (give a list of key=value)")
        for item in overrides:
            key = item.partition("=")[0].strip()
            if key in BENCH_KEYS:
                raise ConfigError(f"ablations.{name}: {key!r} is set by the bench itself ({', '.join(BENCH_KEYS)})")


def _asyncrl_run(s: TrlBenchSettings, out: Path, mode: str, sharing: str = "split",
                 extra: tuple[str, ...] = ()) -> Run:
    total = s.steps_of(f"asyncrl_{mode}")
    steps = checkpoint_steps(s, total)
    cfg = task_config(s, [
        f"output_dir={out}", f"mode={mode}", "max_staleness=2", f"rollout.thread_sharing={sharing}",
        f"partial_rollout={'abort' if mode == 'async' else 'off'}",
        f"total_steps={total}", f"batch_size={s.batch_size}", f"group_size={s.group_size}", "eval_every=0",
        "eval.num_tasks=8", "eval.samples_per_task=1",
        f"optim.lr={s.lr}", "algorithm.filter_zero_variance=false",
        f"save_every={s.eval_every if s.held_out else 0}", f"keep_last={len(steps) + 1}",
        "save_every_minutes=0",  # only the evaluated steps' checkpoints: keep_last holds them all
        *extra,  # an ablation's changes (check_ablations: none of the keys above)
    ])
    trainer = Trainer(cfg)
    trainer.run()
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]  # the step rows
    t0 = rows[0]["time/elapsed"] - rows[0]["time/step"]  # the first step's start

    def clock(row: dict[str, Any]) -> float:  # saves after earlier steps fall inside this step's time
        return row["time/elapsed"] - t0 - sum(d for k, d in trainer.save_seconds.items() if k < row["step"])

    run = Run()
    run.train_curve = [(clock(r), r["reward/mean"]) for r in rows]
    at = {r["step"]: clock(r) for r in rows}
    run.checkpoints = [(k, at[k], out / "checkpoints" / f"step_{k}") for k in steps]
    for _, _, path in run.checkpoints if not s.keep_checkpoints else ():
        # Scored after every system of the sitting has trained, then deleted: their optimizer
        # state (twice the weights) goes now, so that a SmolLM2 sitting with its sharing arms
        # peaks at a third of the disk it took before (docs/design.md).
        shutil.rmtree(path / "optimizer", ignore_errors=True)
    run.save_s = sum(d for k, d in trainer.save_seconds.items() if k < total)
    run.wall_s = run.train_curve[-1][0]
    return run


def _trl_run(s: TrlBenchSettings, out: Path) -> Run:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = task_config(s, [])
    stream = TaskStream(build_tasks(cfg).train, s.seed)  # the order asyncrl's trainer draws them in
    tasks = [stream.next() for _ in range(s.steps * s.batch_size)]
    data = Dataset.from_list([{"prompt": trl_prompt(cfg, t), "task_index": i} for i, t in enumerate(tasks)])
    score = build_reward_fn(cfg)

    def reward(prompts, completions, task_index, **_: Any) -> list[float]:
        return [float(score(tasks[i], c if isinstance(c, str) else c[0]["content"]))
                for c, i in zip(completions, task_index)]

    run, due = Run(), set(checkpoint_steps(s))

    class Clock(TrainerCallback):
        """Starts at the first step; saves at the checkpoint steps, off the clock."""

        def on_step_begin(self, args, state, control, **kwargs):
            if not hasattr(self, "t0"):
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if state.global_step in due:  # on_step_end comes before the step's on_log
                start = time.perf_counter()
                path = out / "checkpoints" / f"step_{state.global_step}"
                model.save_pretrained(path)
                processing_class.save_pretrained(path)
                run.checkpoints.append((state.global_step, start - self.t0 - run.save_s, path))
                run.save_s += time.perf_counter() - start

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                run.train_curve.append((time.perf_counter() - self.t0 - run.save_s, float(logs["reward"])))

    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=s.batch_size * s.group_size,
        num_generations=s.group_size, max_completion_length=cfg.sampling.max_tokens,
        temperature=cfg.sampling.temperature, top_k=0, top_p=1.0,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, max_steps=s.steps, beta=0.0,
        epsilon=0.2, epsilon_high=0.28, scale_rewards="group", loss_type="dapo", **trl_precision_args(precision(cfg)),
        gradient_checkpointing=False, report_to="none", logging_steps=1, save_strategy="no", seed=s.seed,
        shuffle_dataset=False,
    )
    model = str(resolve_model_path(cfg.model.path))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Clock()])
    trainer.train()
    run.wall_s = run.train_curve[-1][0]  # the last save came before the last log: already off the clock
    return run


def held_out_eval(s: TrlBenchSettings, model_dir: Path, out: Path) -> dict[str, float]:
    """``asyncrl eval``'s evaluation of ``model_dir`` (written to ``out``): mean reward and pass@1."""
    validation = [f"task.num_validation={max(s.eval_tasks, 128)}"] if s.config is None else []
    cfg = task_config(s.model_copy(update={"model_path": str(model_dir)}), [
        f"output_dir={out}", *validation, f"eval.num_tasks={s.eval_tasks}", f"eval.samples_per_task={s.eval_samples}",
        *([] if s.config else [f"eval.temperature={EvalConfig().temperature}"]),
    ])
    result = run_eval(cfg)
    return {"reward_mean": result.mean_reward, "pass@1": result.pass_at[1]}


def run_trl_bench(overrides: list[str], out: Path) -> dict[str, Any]:
    s = validate(TrlBenchSettings, apply_overrides({}, overrides))
    check_ablations(s.ablations)
    if s.seeds > 1:
        return _across_seeds(s, out)
    sizes = [s.model_copy(update={"batch_size": b, "batch_sizes": None}) for b in s.sizes()]
    if len(sizes) == 1:  # one size: its directories and phase names as they always were
        result = {"settings": s.model_dump(), **_bench_size(sizes[0], out, "")}
        print_table(result)
        return result
    per_size = {}
    for size in sizes:
        per_size[size.label()] = _bench_size(size, out / size.label(), f"{size.label()}: ")
    result = {"settings": s.model_dump(), **per_size[sizes[0].label()], "sizes": per_size}
    for label, size_result in per_size.items():
        print(f"--- {label} ({size_result['samples_per_step']} samples per step)")
        print_table(size_result)
    print_size_table(per_size)
    return result


def _across_seeds(s: TrlBenchSettings, out: Path) -> dict[str, Any]:
    """One sitting per seed (one batch size), then each system's time to target over the
    seeds: every seed's, how many reached it, and the mean ± CI95 of those that did."""
    if s.batch_sizes and len(s.batch_sizes) > 1:
        raise ValueError("seeds > 1 takes one batch size (batch_size=B), not batch_sizes")
    sittings = []
    for k in range(s.seeds):
        seed = s.seed + k
        print(f"--- seed {seed} ({k + 1} of {s.seeds})")
        one = s.model_copy(update={"seed": seed, "seeds": 1, "batch_sizes": None,
                                   "batch_size": s.sizes()[0]})
        sitting = {"seed": seed, **_bench_size(one, out / f"seed_{seed}", f"seed {seed}: ")}
        print_table(sitting)
        sittings.append(sitting)
    summary = summarise_seeds(sittings)
    print_seed_table(summary)
    return {"settings": s.model_dump(), "seeds": sittings, "across_seeds": summary}


def _in_own_process(train: Callable[..., Run], *args: Any) -> Run:
    """``train(*args)`` in a fresh (spawned) process, as a user runs either system: what one
    run leaves in a process slows the next — TRL trains on the main thread, whose OpenMP
    team then sits idle beside asyncrl's threads (``asyncrl.runtime.one_torch_thread``) —
    and each system's clock starts at its first step, so start-up is not counted."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(train, *args).result()


def _bench_size(s: TrlBenchSettings, out: Path, prefix: str) -> dict[str, Any]:
    """The three systems at ``s.batch_size``: trained in turn, then (``held_out``) their
    checkpoints scored; ``prefix`` starts each phase's name."""
    trainers = {"trl": (_trl_run, s, out / "trl"),  # TRL and the trainer show their own bars
                "asyncrl_sync": (_asyncrl_run, s, out / "asyncrl_sync", "sync"),
                "asyncrl_async": (_asyncrl_run, s, out / "asyncrl_async", "async")}
    for sharing in s.async_sharing:  # async again, the cores shared otherwise
        trainers[f"asyncrl_async_{sharing}"] = (_asyncrl_run, s, out / f"asyncrl_async_{sharing}", "async", sharing)
    for name, overrides in s.ablations.items():  # sync (or async) again, one change at a time
        for mode in s.ablation_modes:
            trainers[f"asyncrl_{mode}_{name}"] = (_asyncrl_run, s, out / f"asyncrl_{mode}_{name}", mode, "split",
                                                  tuple(overrides))
    per_step = s.batch_size * s.group_size
    samples = {name: s.steps_of(name) * per_step for name in trainers}
    runs: dict[str, Run] = {}
    for i, (name, (train, *args)) in enumerate(trainers.items(), 1):
        with phase("trl", f"{prefix}{name} (run {i}/{len(trainers)})") as progress:
            runs[name] = run = _in_own_process(train, *args)
            progress.figure = (f"{samples[name] / run.wall_s:.1f} samples/s, "
                               f"final reward {_smoothed(run.train_curve, s.smooth)[-1][1]:.3f}")

    # held-out evaluation, after all training: the start policy once, then every checkpoint
    held_out: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    start = None
    if s.held_out:
        with phase("trl", f"{prefix}held-out eval: start policy") as progress:
            start = held_out_eval(s, resolve_model_path(task_config(s, []).model.path), out / "start_policy_eval")
            progress.figure = f"reward {start['reward_mean']:.3f}, pass@1 {start['pass@1']:.3f}"
        for name, run in runs.items():
            with phase("trl", f"{prefix}held-out eval: {name} ({len(run.checkpoints)} checkpoints)",
                       total=len(run.checkpoints), unit="checkpoint") as progress:
                held_out[name] = [{"step": 0, "time_s": 0.0, **start}]
                for step, t, path in run.checkpoints:
                    scores = held_out_eval(s, path, out / name / "held_out_eval" / f"step_{step}")
                    held_out[name].append({"step": step, "time_s": t, **scores})
                    if not s.keep_checkpoints:
                        shutil.rmtree(path)
                    progress.advance()
                progress.figure = " → ".join(f"{p['reward_mean']:.3f}" for p in held_out[name])

    target = (s.target if s.target is not None else held_out["trl"][-1]["reward_mean"]) if s.held_out else None
    systems = {}
    side = precision(task_config(s, []))
    for name, run in runs.items():
        systems[name] = {
            "samples_per_s": samples[name] / run.wall_s, "wall_s": run.wall_s,
            "final_reward": _smoothed(run.train_curve, s.smooth)[-1][1],
            "time_to_target_s": time_to_target(held_out[name], target) if s.held_out else None,
            "final_held_out_reward": held_out[name][-1]["reward_mean"] if s.held_out else None,
            "held_out": held_out[name], "save_s": run.save_s, "train_curve": run.train_curve,
            **side,  # device, dtype, autocast: TRL is given asyncrl's (trl_precision_args)
        }
    trl_t, async_t = systems["trl"]["time_to_target_s"], systems["asyncrl_async"]["time_to_target_s"]
    trl_rate = systems["trl"]["samples_per_s"]
    return {
        "batch_size": s.batch_size, "samples_per_step": s.batch_size * s.group_size,
        "target_reward": target, "target_rule": TARGET_RULE if s.target is None else "target= (fixed)",
        "held_out_eval": {"split": f"{s.config or 'countdown'} validation", "tasks": s.eval_tasks,
                          "samples_per_task": s.eval_samples, "max_tokens": task_config(s, []).sampling.max_tokens,
                          "temperature": task_config(s, []).eval.temperature,
                          "evaluator": "asyncrl eval (run_eval) on each checkpoint directory"} if s.held_out else None,
        "target_above_start": target > start["reward_mean"] + 1e-9 if s.held_out else None,
        "systems": systems,
        "sync_vs_trl_samples_per_s": systems["asyncrl_sync"]["samples_per_s"] / trl_rate,
        "async_vs_trl_samples_per_s": systems["asyncrl_async"]["samples_per_s"] / trl_rate,
        "async_vs_trl_time_to_target": async_t / trl_t if async_t is not None and trl_t else None,
        # every async system's samples/s against sync's, the cores shared each way (async_sharing)
        "async_vs_sync_samples_per_s": {name: v["samples_per_s"] / systems["asyncrl_sync"]["samples_per_s"]
                                        for name, v in systems.items() if name.startswith("asyncrl_async")},
        "unmatched": " ".join(__doc__.split("Not matched, and why: ")[1].split("\n\n")[0].split()),
    }


