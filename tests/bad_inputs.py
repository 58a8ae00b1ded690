"""The bad inputs and faults the reliability table of docs/faults.md reports, each run as a user
would: ``python -m asyncrl.cli train ...`` in a fresh process on the shipped Countdown
example and tiny policy.

``tests/test_bad_inputs.py`` runs every case and checks its exit code, its message and a
bound on its time, and that the table in docs/faults.md lists exactly these cases with
these codes and messages. ``python tests/bad_inputs.py`` prints the table with the times
measured now (paste it into docs/faults.md, below its marker, when a case changes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
BASE = ["examples/countdown/async.yaml", "model.path=models/countdown-tiny", "total_steps=3", "batch_size=2",
        "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=1", "eval_every=0", "task.num_train=64",
        "task.num_validation=4", "algorithm.filter_zero_variance=false", "workflow.max_retries=0"]


@dataclass(frozen=True)
class Case:
    tried: str
    """What a user did, as the table in docs/faults.md says it."""
    args: tuple[str, ...]
    """Overrides after the base command; ``{dir}`` is a scratch directory."""
    exit_code: int
    says: str
    """A fragment of the last lines of stderr: the message the user reads."""
    within_s: float = 120.0
    """The test's bound on the time from start to exit, the same for every case and
    generous, for a loaded 2-core machine: no case took over 9.7 s in docs/faults.md's
    table (about 6 s of each is Python, torch and the model loading), but one took 64.6 s
    with other jobs on both cores. It is there to catch a run that does not end."""
    setup: Callable[[Path], None] | None = field(default=None, compare=False)
    command: str = "train"
    signals: tuple[signal.Signals, ...] = ()
    """Sent 1 s apart once the user code has announced itself (``ASYNCRL_TEST_MARKER``)."""


def _not_empty(scratch: Path) -> None:
    (scratch / "out").mkdir()
    (scratch / "out" / "metrics.jsonl").write_text("{}\n")


def _bad_row(scratch: Path) -> None:
    rows = (ROOT / "examples/jsonl/data.jsonl").read_text().splitlines()
    rows[6] = '{"id": "row-006", "numbers": [1, 2]}'
    (scratch / "data.jsonl").write_text("\n".join(rows) + "\n")


def _bad_yaml(scratch: Path) -> None:
    (scratch / "bad.yaml").write_text("mode: async\nbatch_size: [2\n")


def _not_a_model(scratch: Path) -> None:
    (scratch / "model").mkdir()
    (scratch / "model" / "config.json").write_text('{"model_type": "bert", "vocab_size": 10}')


CASES: list[Case] = [
    # -- refused before any work: exit 2, naming the key
    Case("unknown key", ("optim.lrr=0.1",), 2, "optim.lrr"),
    Case("wrong type", ("batch_size=two",), 2, "batch_size"),
    Case("η < 0", ("max_staleness=-1",), 2, "max_staleness"),
    Case("`sync` with a partial-rollout mode", ("mode=sync", "partial_rollout=abort"), 2,
         "set partial_rollout=off"),
    Case("`sync_every` beyond η + 1", ("max_staleness=1", "sync_every=3"), 2, "use sync_every <= 2"),
    Case("a micro-batch that does not divide the step", ("optim.micro_batch_size=3",), 2,
         "optim.micro_batch_size=3 does not divide"),
    Case("`group_size=1` with GRPO", ("group_size=1", "optim.micro_batch_size=2"), 2,
         "group_size=1: algorithm.advantage='grpo'"),
    Case("`sampling.temperature=0` with groups", ("sampling.temperature=0",), 2,
         "sampling.temperature=0 decodes greedily"),
    Case("an unknown advantage estimator", ("algorithm.advantage=gpro",), 2,
         "unknown advantage estimator 'gpro'"),
    Case("a reward function that does not exist", ("task.reward_fn=nowhere:score",), 2, "task.reward_fn"),
    Case("a model path that does not exist", ("model.path={dir}/missing",), 2, "model.path"),
    Case("a model path that is not a causal LM", ("model.path={dir}/model",), 2, "model.path",
         setup=_not_a_model),
    Case("a dataset row without a prompt", ("task.name=jsonl", "task.path={dir}/data.jsonl",
                                            "task.reward_fn=examples/jsonl/reward.py:score", "task.num_train=0"),
         2, "data.jsonl, line 7", setup=_bad_row),
    Case("a malformed YAML file", ("{dir}/bad.yaml",), 2, "bad.yaml", setup=_bad_yaml, command="train-file"),
    Case("an `output_dir` holding an earlier run", ("output_dir={dir}/out",), 2, "is not empty",
         setup=_not_empty),
    Case("`resume=true` with no checkpoint", ("output_dir={dir}/out", "resume=true"), 2,
         "no complete checkpoint to resume from", setup=_not_empty),
    Case("`openai_agent` without an agent", ("workflow.name=openai_agent",), 2, "workflow.agent"),
    # -- faults during the run: exit 1, the cause, the last good checkpoint
    Case("a reward function that always raises", ("task.reward_fn=bad_rewards:raises",), 1,
         "stopped by the watchdog"),
    Case("a reward function that hangs", ("task.reward_fn=bad_rewards:hangs", "workflow.timeout_s=1"), 1,
         "stopped by the watchdog"),
    Case("a reward of NaN", ("task.reward_fn=bad_rewards:nan",), 1, "non-finite reward nan for task"),
    Case("a reward of ±1e300", ("task.reward_fn=bad_rewards:huge",), 1,
         "is beyond algorithm.max_abs_reward=1e+06"),
    Case("a reward function returning a string", ("task.reward_fn=bad_rewards:text",), 1,
         "stopped by the watchdog"),
    Case("an advantage estimator that divides by zero", ("algorithm.advantage=bad_rewards:nan_advantage",), 1,
         "non-finite advantage from estimator"),
    # -- user code that never returns, and the signals that end it
    Case("a synchronous agent that hangs, then SIGTERM",
         ("workflow.name=openai_agent", "workflow.agent=test_stoppable:hang_forever", "workflow.timeout_s=3"), 0,
         "still in user code, not waited for: agent test_stoppable:hang_forever", signals=(signal.SIGTERM,)),
    Case("a synchronous agent that always hangs", ("workflow.name=openai_agent", "watchdog.window=8",
                                                   "workflow.agent=test_stoppable:hang_forever",
                                                   "workflow.timeout_s=1"), 1,
         "stopped by the watchdog: 8 of the last 8 episodes failed"),
    Case("a policy loss that hangs, then SIGTERM twice", ("algorithm.policy_loss=test_stoppable:hang_loss",), 1,
         "stopped by a second signal", signals=(signal.SIGTERM, signal.SIGTERM)),
    Case("a policy loss that turns NaN at step 2", ("algorithm.policy_loss=bad_rewards:nan_loss_at_step_2",
                                                     "save_every=1", "optim.micro_batch_tokens=null"), 1,
         "non-finite actor/loss at step 2"),
]


def argv(case: Case, scratch: Path) -> list[str]:
    args = [a.replace("{dir}", str(scratch)) for a in case.args]
    if case.command == "train-file":
        return ["train", *args]
    out = [] if any(a.startswith("output_dir=") for a in args) else [f"output_dir={scratch}/run"]
    return ["train", *BASE, *out, *args]


def run_case(case: Case, scratch: Path, timeout_s: float | None = None) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of the case in a fresh process, from the repository root."""
    if case.setup is not None:
        case.setup(scratch)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    marker = scratch / "user_code_called"
    env["ASYNCRL_TEST_MARKER"] = str(marker)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *argv(case, scratch)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if case.signals:
            while not marker.exists() and proc.poll() is None and time.perf_counter() - start < case.within_s:
                time.sleep(0.05)
            for sig in case.signals:
                time.sleep(1)
                proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout_s or case.within_s * 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err, time.perf_counter() - start


def message(stderr: str, says: str) -> str:
    """The last stderr line holding ``says`` (what the table quotes; a traceback may quote
    the source line that raised it first)."""
    return next((line.strip() for line in reversed(stderr.splitlines()) if says in line), "")


if __name__ == "__main__":
    print("| what was tried | exit | what it says (excerpt) | time to exit |")
    print("|---|---|---|---|")
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            code, err, seconds = run_case(case, Path(tmp))
        said = message(err.replace(tmp, "<dir>"), case.says) or f"**differs**: expected `{case.says}`"
        said = said.removeprefix("asyncrl: error: ").removeprefix("asyncrl train: ")
        end = max(110, said.find(case.says) + len(case.says))
        cell = (said if len(said) <= end else said[:end] + "…").replace("|", "\\|")
        print(f"| {case.tried} | {code} | {cell} | {seconds:.1f} s |", flush=True)
