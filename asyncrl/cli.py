"""``asyncrl train|eval|serve|serve-engine|serve-tinker|sft|bench|report|doctor|plan|models``: thin dispatch
through one table, ``COMMANDS`` (a subcommand's parser and what it runs); exit 2 for usage/config errors, 1 for
failures."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, load_config
from asyncrl.model_convert import add_models_command, run_models_command
from asyncrl.orchestrator.inputs import check_inputs
from asyncrl.orchestrator.watchdog import WatchdogStop
from asyncrl.sft.config import load_sft_config
from asyncrl.threads import stuck_report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL post-training for LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.declare(sub, name)
    return parser


def _config_command(help_: str) -> Callable[[Any, str], None]:
    """``train``, ``eval``, ``serve``: a config file, its overrides, ``--keys``."""
    def declare(sub: Any, name: str) -> None:
        cmd = sub.add_parser(name, help=help_, epilog=KEYS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_argument("config", help="YAML config file (e.g. examples/countdown/async.yaml)")
        cmd.add_argument("overrides", nargs="*", metavar="key=value",
                         help="optional overrides of the file's keys, dotted (e.g. optim.lr=1e-4 total_steps=100)")
        cmd.add_argument("--keys", action=_ListKeys, help="list every config key with its default, and exit")
    return declare


def _declare_sft(sub: Any, name: str) -> None:
    sft = sub.add_parser(name, help="cold-start SFT of model.path on OpenAI-format conversations (JSONL)",
                         epilog=SFT_KEYS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sft.add_argument("config", help="YAML config file (e.g. examples/sft/conversations.yaml)")
    sft.add_argument("overrides", nargs="*", metavar="key=value",
                     help="optional overrides of the file's keys, dotted (e.g. optim.lr=2e-5 data.max_length=1024)")
    sft.add_argument("--keys", action=_ListKeys, schema="sft", help="list every config key with its default, and exit")


def _declare_bench(sub: Any, name: str) -> None:
    bench = sub.add_parser(name, help="benchmarks; writes bench.json under --out")
    bench.add_argument("suite", choices=["engine", "modes", "gateway", "learner", "sync", "trl", "staleness",
                                          "retokenize", "precision", "tinker"])
    bench.add_argument("overrides", nargs="*", help="key=value settings of the benchmark")
    bench.add_argument("--out", default=None, help="output directory (default bench/SUITE-<timestamp>)")


def _run_dir_command(help_: str) -> Callable[[Any, str], None]:
    """``report``, ``doctor``: a train run's directory."""
    def declare(sub: Any, name: str) -> None:
        sub.add_parser(name, help=help_).add_argument("run_dir", help="output directory of an asyncrl train run")
    return declare


def _declare_plan(sub: Any, name: str) -> None:
    plan = sub.add_parser(name, help="the scheduler on a simulated clock: samples/s, speed-up over sync, "
                                     "idle fractions, staleness, a sweep over η and the rollout/learner split")
    plan.add_argument("config", help="YAML config file of the run to plan (e.g. examples/countdown/async.yaml)")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="optional overrides of the file's keys")
    plan.add_argument("--from", dest="from_run", metavar="RUN_DIR",
                      help="fit the costs to a finished asyncrl train run")
    plan.add_argument("--cluster", metavar="TABLE", help="a cluster table (YAML; keys in docs/planner.md)")
    plan.add_argument("--out", default=None, help="output directory (default plan/<timestamp>)")
    plan.add_argument("--no-sweep", dest="sweep", action="store_false", help="only the config and its sync baseline")
    plan.add_argument("--server", choices=("asyncrl", "vllm"), default=None,
                      help="engine=remote: the servers' commands for asyncrl serve-engine (default) or vllm serve")
    plan.add_argument("--probe", action="store_true",
                      help="engine=remote: ask each server's /health and /v1/models now, naming any that does not "
                           "answer")


KEYS_EPILOG = """every key, its type, default and meaning is documented once, in asyncrl/config/;
`asyncrl train --keys` lists them with their defaults"""
SFT_KEYS_EPILOG = """every key, its type, default and meaning is documented once, in asyncrl/sft/config.py;
`asyncrl sft --keys` lists them with their defaults; the data format is in docs/agents.md"""


class _ListKeys(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, schema: str = "train", **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.schema = schema  # whose keys: train's (train, eval, serve) or sft's

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from asyncrl.config import Config, all_keys
        from asyncrl.sft.config import RL_ONLY, SFTConfig

        schema = SFTConfig if self.schema == "sft" else Config
        defaults = schema.model_construct().model_dump()
        refused = ({f"{section}.{key}" for section, keys in RL_ONLY.items() for key in keys}
                   if schema is SFTConfig else set())
        for key in all_keys(schema):
            if key in refused:  # train's, in a section sft shares: sft refuses them
                continue
            value = defaults
            for part in key.split("."):
                value = value[part]
            print(f"{key} = {value!r}")
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    failed_run: list[str] = []  # where a failed run's last good checkpoint is: said after the error
    try:
        return _run(args, failed_run)
    finally:
        for line in failed_run:
            print(line, file=sys.stderr)
        stuck = stuck_report()  # daemon threads: the exit does not wait for them, but says so
        if stuck is not None:
            print(stuck, file=sys.stderr)


def _ending(trainer) -> str:
    """The run in one glance: where evaluation went, how long it took, what to run next."""
    from asyncrl.jsonl import read_jsonl

    out = trainer.output_dir
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if "eval/reward_mean" in r]
    lines = []
    if trainer.interrupted:
        lines.append(f"asyncrl train: interrupted at step {trainer.step}; continue with the same command and "
                     "resume=true")
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(f"asyncrl train: eval reward {first['eval/reward_mean']:.3f} → {last['eval/reward_mean']:.3f}, "
                     f"pass@1 {first['eval/pass@1']:.3f} → {last['eval/pass@1']:.3f} (step {first['step']} → "
                     f"{last['step']}); wall time {_duration(trainer.wall_s)}")
    lines.append(f"report: asyncrl report {out}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def _quiet_transformers() -> None:
    """Our own bars show progress; transformers' would interleave with them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _train(args: argparse.Namespace, failed_run: list[str]) -> None:
    cfg = load_config(args.config, args.overrides)  # before torch loads: a typo fails in a blink
    splits = check_inputs(cfg, "train")  # so do data, reward and agent mistakes
    _quiet_transformers()
    from asyncrl.orchestrator.trainer import Trainer

    trainer = Trainer(cfg, splits=splits)
    try:
        checkpoint = trainer.run()
    except BaseException:
        from asyncrl.orchestrator.announce import failed_note

        failed_run.append(failed_note(trainer.output_dir, trainer.last_checkpoint))
        raise
    if trainer.finished:  # a resume with nothing to train: the trainer said why
        print(f"already finished; final checkpoint: {checkpoint}")
    else:
        print(_ending(trainer), file=sys.stderr)
        print(f"done; final checkpoint: {checkpoint}")


def _eval(args: argparse.Namespace, failed_run: list[str]) -> None:
    cfg = load_config(args.config, args.overrides)
    splits = check_inputs(cfg, "eval")
    _quiet_transformers()
    from asyncrl.orchestrator.eval_command import run_eval

    result = run_eval(cfg, splits)
    print(json.dumps(result.summary(), indent=2))


def _serve(args: argparse.Namespace, failed_run: list[str]) -> None:
    cfg = load_config(args.config, args.overrides)
    _quiet_transformers()
    from asyncrl.orchestrator.serve import serve

    serve(cfg)


def _serve_engine(args: argparse.Namespace, failed_run: list[str]) -> None:
    cfg = load_config(args.config, args.overrides)
    _quiet_transformers()
    from asyncrl.rollout.engine_server import serve_engine

    serve_engine(cfg)


def _serve_tinker(args: argparse.Namespace, failed_run: list[str]) -> None:
    cfg = load_config(args.config, args.overrides)
    _quiet_transformers()
    if importlib.util.find_spec("tinker") is None:
        raise ConfigError("asyncrl serve-tinker speaks the wire of Tinker's SDK and needs it installed: "
                          "pip install 'asyncrl[tinker]'")
    from asyncrl.tinker.server import serve_tinker

    serve_tinker(cfg)


def _sft(args: argparse.Namespace, failed_run: list[str]) -> int | None:
    cfg = load_sft_config(args.config, args.overrides)
    _quiet_transformers()
    if cfg.learner.world_size > 1:  # N rank processes, each an SFTRun on its rows of every step
        from asyncrl.sft.ranks import INTERRUPTED, launch

        code = launch(args.config, args.overrides, cfg)
        if code == 0:
            print(f"done; model saved in {cfg.output_dir} (model.path for asyncrl train/serve)")
        elif code == INTERRUPTED:
            print(f"asyncrl sft: interrupted; model saved in the newest of {cfg.output_dir}/checkpoints",
                  file=sys.stderr)
        return code or None
    from asyncrl.sft.trainer import SFTRun

    run = SFTRun(cfg)
    try:
        saved = run.run()
    except ConfigError:
        raise  # bad settings or data, found before any step: the message says what to fix
    except BaseException:
        failed_run.append(f"asyncrl sft: the run failed at step {run.step}; last saved model: "
                          f"{run.last_saved or 'none yet'}")
        raise
    if run.interrupted:
        print(f"asyncrl sft: interrupted at step {run.step}; model saved in {saved}", file=sys.stderr)
        return 130
    print(f"done; model saved in {saved} (model.path for asyncrl train/serve)")
    return None


def _bench(args: argparse.Namespace, failed_run: list[str]) -> None:
    _quiet_transformers()
    from asyncrl.bench import run_bench

    run_bench(args.suite, args.overrides, args.out)


def _plan(args: argparse.Namespace, failed_run: list[str]) -> int | None:
    from asyncrl.plan.planner import run_plan_command

    result = run_plan_command(args.config, args.overrides, args.from_run, args.cluster, args.out, args.sweep,
                              args.probe, args.server)
    return 1 if result.get("fleet", {}).get("problems") else None  # a fleet that would not run as planned


def _report_or_doctor(args: argparse.Namespace, failed_run: list[str]) -> int | None:
    from asyncrl.report import load_run, write_report
    from asyncrl.report.doctor import diagnose

    try:
        run = load_run(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:  # not a usable run dir: a usage error
        raise ConfigError(str(exc)) from None
    lines, status = diagnose(run)
    if args.command == "doctor":
        print("\n".join(lines))
        return status
    try:
        print(write_report(run))
    except ImportError as exc:  # a missing extra is a usage error: one line, how to install it
        print(f"asyncrl report: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines[1:]), file=sys.stderr)  # the doctor's lines, also on the page
    return None


@dataclass(frozen=True)
class Command:
    """One subcommand: ``declare(subparsers, name)`` adds its parser, ``run(args, failed_run)``
    runs it and returns the exit status (None: 0; ``failed_run``: lines said after a failure)."""

    declare: Callable[[Any, str], None]
    run: Callable[[argparse.Namespace, list[str]], int | None]


COMMANDS: dict[str, Command] = {
    "train": Command(_config_command("RL training (sync, one_step_off, async)"), _train),
    "eval": Command(_config_command("score a policy on a task's validation split"), _eval),
    "serve": Command(_config_command("OpenAI-compatible gateway over model.path at gateway.host:gateway.port"),
                     _serve),
    "serve-engine": Command(_config_command("the rollout engine over vLLM's HTTP API at "
                                            "engine_server.host:engine_server.port (for engine=remote)"),
                            _serve_engine),
    "serve-tinker": Command(_config_command("the Tinker API (LoRA training and sampling clients for Tinker's SDK) "
                                            "over model.path at tinker.host:tinker.port"), _serve_tinker),
    "sft": Command(_declare_sft, _sft),
    "bench": Command(_declare_bench, _bench),
    "report": Command(_run_dir_command("write report.html (+ PNG figures) into a train run directory"),
                      _report_or_doctor),
    "doctor": Command(_run_dir_command("check every invariant of a train run (also one crashed or running): "
                                       "OK / WARN / FAIL per line; exit 0 all OK, 1 a WARN, 2 a FAIL"),
                      _report_or_doctor),
    "plan": Command(_declare_plan, _plan),
    "models": Command(lambda sub, name: add_models_command(sub), lambda args, failed_run: run_models_command(args)),
}
"""Every subcommand, in the order ``asyncrl --help`` lists them."""


def _run(args: argparse.Namespace, failed_run: list[str]) -> int:
    try:
        return COMMANDS[args.command].run(args, failed_run) or 0
    except ConfigError as exc:
        print(f"asyncrl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asyncrl: interrupted", file=sys.stderr)
        return 130
    except asyncio.CancelledError as exc:  # a second SIGINT/SIGTERM while the run was stuck waiting
        print(f"asyncrl {args.command}: {exc or 'cancelled'}", file=sys.stderr)
        return 1
    except WatchdogStop as exc:  # its message holds the evidence; our own stack would only hide it
        print(f"asyncrl {args.command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if _says_it_all(exc):  # it names the quantity, the step and the task (or the version): the stack adds nothing
            print(f"asyncrl {args.command}: stopped: {exc}", file=sys.stderr)
            return 1
        traceback.print_exc()
        print(f"asyncrl {args.command}: failed (see the traceback above)", file=sys.stderr)
        return 1


def _says_it_all(exc: Exception) -> bool:
    """A run stopped by a check whose message is the whole story: a non-finite quantity, or
    weights not delivered to an engine. Imported only once torch is loaded (an exception
    from a run means it is)."""
    from asyncrl.algorithms.finite import NonFiniteError
    from asyncrl.weight_sync.delivery import WeightsNotDelivered

    return isinstance(exc, (NonFiniteError, WeightsNotDelivered))


if __name__ == "__main__":
    sys.exit(main())
