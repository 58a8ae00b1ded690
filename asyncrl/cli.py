"""``asyncrl train|eval|bench|report``: thin dispatch; exit 2 for usage/config errors, 1 for failures."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import traceback

from asyncrl.config import ConfigError, load_config
from asyncrl.orchestrator.watchdog import WatchdogStop


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL post-training for LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="RL training (sync, one_step_off, async)")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    ev = sub.add_parser("eval", help="score a policy on a task's validation split")
    ev.add_argument("config", help="YAML config file")
    ev.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    bench = sub.add_parser("bench", help="benchmarks; writes bench.json under --out")
    bench.add_argument("suite", choices=["engine", "modes", "trl"])
    bench.add_argument("overrides", nargs="*", help="key=value settings of the benchmark")
    bench.add_argument("--out", default=None, help="output directory (default bench/SUITE-<timestamp>)")
    report = sub.add_parser("report", help="write report.html (+ PNG figures) into a train run directory")
    report.add_argument("run_dir", help="output directory of an asyncrl train run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    failed_run: list[str] = []  # where a failed run's last good checkpoint is: said after the error
    try:
        return _run(args, failed_run)
    finally:
        for line in failed_run:
            print(line, file=sys.stderr)


def _run(args: argparse.Namespace, failed_run: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bars show progress; theirs interleave
    try:
        if args.command == "train":
            from asyncrl.orchestrator.trainer import Trainer

            trainer = Trainer(load_config(args.config, args.overrides))
            try:
                checkpoint = trainer.run()
            except BaseException:
                failed_run.append(f"asyncrl train: the run failed; last good checkpoint: "
                                  f"{trainer.last_checkpoint or 'none yet'}")
                raise
            print(f"done; final checkpoint: {checkpoint}")
        elif args.command == "eval":
            from asyncrl.orchestrator.evaluator import run_eval

            result = run_eval(load_config(args.config, args.overrides))
            print(json.dumps(result.summary(), indent=2))
        elif args.command == "bench":
            from asyncrl.bench import run_bench

            run_bench(args.suite, args.overrides, args.out)
        elif args.command == "report":
            from asyncrl.report import load_run, write_report

            try:
                run = load_run(args.run_dir)
            except (FileNotFoundError, ValueError) as exc:  # not a usable run dir: a usage error
                raise ConfigError(str(exc)) from None
            try:
                print(write_report(run))
            except ImportError as exc:  # matplotlib is optional; the message says how to install it
                print(f"asyncrl report: {exc}", file=sys.stderr)
                return 1
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
    except Exception:
        traceback.print_exc()
        print(f"asyncrl {args.command}: failed (see the traceback above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
