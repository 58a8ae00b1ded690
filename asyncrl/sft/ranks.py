"""``asyncrl sft`` over N learner ranks (``learner.world_size`` > 1): N processes, each one
rank of a ``torch.distributed`` process group running :class:`~asyncrl.sft.trainer.SFTRun`
on its rows of every step. The step goes through the training core's one micro-batch
loop, sharded as RL's learner is (``asyncrl/learner/core.py``), so N ranks take the step
one rank takes (``tests/test_sft_ranks.py`` compares them).

:func:`launch` is the driver ``asyncrl sft`` runs: it starts the ranks (a rendezvous on a
free port), hands each stop signal it gets on to them, and ends the others as soon as one
fails, naming it, so no rank is left waiting in a collective. The ranks read torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):
``torchrun --nproc-per-node N -m asyncrl.sft.ranks CONFIG [key=value ...]`` starts the
same ranks by hand.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator

from asyncrl.config import ConfigError
from asyncrl.learner.distributed import (
    Sharding,
    default_backend,
    destroy_process_group,
    free_port,
    init_process_group,
    rank_device,
)
from asyncrl.sft.config import SFTConfig, load_sft_config
from asyncrl.sft.trainer import SFTRun

INTERRUPTED = 130
"""A rank's exit status after a stop that saved (as ``asyncrl sft``'s own)."""


def launch(config: str, overrides: list[str], cfg: SFTConfig) -> int:
    """Run ``asyncrl sft CONFIG overrides`` as ``cfg.learner.world_size`` rank processes on
    this machine (:func:`run_ranks`)."""
    return run_ranks([sys.executable, "-m", "asyncrl.sft.ranks", config, *overrides], cfg.learner.world_size)


def run_ranks(command: list[str], world: int) -> int:
    """``command`` as ``world`` processes, each with torchrun's environment for its rank and
    one rendezvous on a free port; returns the exit status: 0, :data:`INTERRUPTED` after a
    stop, else the first failed rank's (its error is on stderr above, then named). No rank
    outlives it: when one fails the others are killed, and so are all on any way out."""
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world):  # a session each: a terminal's Ctrl-C reaches them through here, once
            procs.append(subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          start_new_session=True))
        with _forwarding(procs):
            return _wait(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _wait(procs: list[subprocess.Popen]) -> int:
    """Until every rank has ended, or one has failed (the others are then ended)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0, INTERRUPTED)]
        if failed:
            rank, code = failed[0]
            print(f"asyncrl sft: learner rank {rank} of {len(procs)} failed (exit status {code}); the other ranks "
                  "were stopped", file=sys.stderr)
            return code
        if None not in codes:
            return INTERRUPTED if INTERRUPTED in codes else 0
        time.sleep(0.1)


@contextlib.contextmanager
def _forwarding(procs: list[subprocess.Popen]) -> Iterator[None]:
    """SIGINT and SIGTERM handed on to every rank still running (each rank's first finishes
    the step and saves, its second stops at once). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    before = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def main(argv: list[str] | None = None) -> int:
    """One rank: ``CONFIG [key=value ...]`` with torchrun's environment. Exit status 0, 2
    for a config or data error, :data:`INTERRUPTED` after a stop that saved, 1 for a failure
    (the traceback and the last saved model said)."""
    config, *overrides = sys.argv[1:] if argv is None else argv
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        cfg = load_sft_config(config, overrides)
    except ConfigError as exc:
        print(f"asyncrl sft: {exc}", file=sys.stderr)
        return 2
    device = rank_device(cfg.model.device, int(os.environ.get("LOCAL_RANK", rank)))
    init_process_group(rank=rank, world_size=world, init_method="env://",
                       backend=cfg.learner.backend or default_backend(device), timeout_s=cfg.learner.timeout_s)
    run = SFTRun(cfg, Sharding.current(cfg.learner.effective_strategy, device))
    try:
        run.run()
    except ConfigError as exc:
        print(f"asyncrl sft: rank {rank}: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        traceback.print_exc()
        print(f"asyncrl sft: rank {rank} failed at step {run.step}; last saved model: {run.last_saved or 'none yet'}",
              file=sys.stderr)
        return 1
    finally:
        destroy_process_group()
    return INTERRUPTED if run.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
