"""A fault matrix: ``kill -9`` at many points of a short run, each followed by
``resume=true``. The kill is real (SIGKILL of the training run's process group — the driver; the learner's
fork server and its process follow it out — sent by whichever process reaches the point, which dies with it:
a ``sitecustomize`` this test writes wraps the function where the point is), so no
test hook lives in the package. Each case then resumes and must finish every step once,
train no sample twice, and keep every trained token within η; a damaged newest checkpoint
is refused, named, and the run resumes from the one before. ``python
tests/test_fault_matrix.py`` prints the matrix that docs/faults.md shows."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here is a whole run in a child process

ETA = 2
STEPS = 6
SITE = textwrap.dedent('''
    import os, signal

    def _install():
        point, nth = os.environ["ASYNCRL_KILL_AT"].rsplit(":", 1)
        nth, seen = int(nth), [0]

        def hit():
            seen[0] += 1
            if seen[0] == nth:
                with open(os.environ["ASYNCRL_KILL_MARK"], "w") as f:
                    f.write(point)
                os.killpg(int(os.environ["ASYNCRL_KILL_GROUP"]), signal.SIGKILL)
                # and the process that got here, which may be the learner's (a session of its own): it
                # would otherwise go on, finish step_4's write and rename it into place before it
                # followed the driver out, and the half-written checkpoint would not be there to resume past
                os.kill(os.getpid(), signal.SIGKILL)

        def wrap(owner, name, when=lambda *a, **k: True):
            original = getattr(owner, name)

            def wrapped(*args, **kwargs):
                if when(*args, **kwargs):
                    hit()
                return original(*args, **kwargs)

            async def awrapped(*args, **kwargs):
                if when(*args, **kwargs):
                    hit()
                return await original(*args, **kwargs)

            import inspect
            setattr(owner, name, awrapped if inspect.iscoroutinefunction(original) else wrapped)

        if point == "mid-step":  # inside the learner's step: the batch taken, no optimizer step yet
            from asyncrl.learner.learner import Learner
            wrap(Learner, "_optimizer_step")
        elif point == "mid-weight-sync":  # the engines paused for new weights, not loaded yet
            from asyncrl.engine.torch_engine import TorchEngine
            wrap(TorchEngine, "update_weights")
        elif point == "mid-checkpoint-write":  # step_N.tmp half written
            import torch
            # step_4's own write, named by its path: a count of saves would also count any other one
            wrap(torch, "save", lambda obj, f, *a, **k: str(f).endswith("step_4.tmp/trainer_state.pt"))
        elif point == "before-checkpoint-rename":  # step_N.tmp complete, not renamed into place
            wrap(os, "replace", lambda src, dst, *a, **k: str(src).endswith(".tmp"))
        elif point == "mid-evaluation":
            from asyncrl.rollout.worker import RolloutWorker
            wrap(RolloutWorker, "_episode", lambda self, task, engine, sampling, purpose, *a, **k: purpose == "eval")
        elif point == "agent-episode-in-flight":  # an OpenAI-SDK agent between two calls to the gateway
            from asyncrl.rollout.client import LLMClient
            wrap(LLMClient, "chat")

    if os.environ.get("ASYNCRL_KILL_AT"):
        # the run started a session of its own: its driver's group is what a hard kill takes
        # (the learner's fork server has a session of its own and follows the driver out);
        # the driver starts first, and every later process inherits its environment
        os.environ.setdefault("ASYNCRL_KILL_GROUP", str(os.getpgid(0)))
        _install()
''')

COUNTDOWN = ["examples/countdown/async.yaml", "model.path=models/countdown-tiny"]
AGENT = ["examples/openai_agent/train.yaml", "model.path=models/countdown-tiny"]
CRITIC = [*COUNTDOWN, "algorithm.advantage=gae", "critic=true"]  # PPO with a critic beside the policy
POINTS = {  # point -> (config, n-th hit to die on: after the step-2 checkpoint)
    "mid-step": (COUNTDOWN, 4),
    "critic-mid-step": (CRITIC, 4),  # mid-step of a run with a critic: the policy stepped in step 4, not the critic
    "mid-weight-sync": (COUNTDOWN, 4),
    "mid-checkpoint-write": (COUNTDOWN, 1),
    "before-checkpoint-rename": (COUNTDOWN, 2),
    "mid-evaluation": (COUNTDOWN, 5),
    "agent-episode-in-flight": (AGENT, 55),  # a run makes 80 chat calls; step_2 is saved after the 44th
}


def train_args(config: list[str], out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "train", *config, f"output_dir={out}", "mode=async",
            f"max_staleness={ETA}", f"total_steps={STEPS}", "save_every=2", "keep_last=3", "batch_size=2",
            "group_size=4", "eval_every=2", "eval.num_tasks=2", "eval.samples_per_task=1", "eval.background=false",
            "task.num_train=64", "task.num_validation=4", "algorithm.filter_zero_variance=false", *extra]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def outcome(out: Path) -> dict:
    """What the finished run's files say: steps logged, groups trained in more than one
    step, the largest staleness of a trained token."""
    metrics, samples = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "samples.jsonl")
    steps_of_group = defaultdict(set)
    for s in samples:
        steps_of_group[s["group"]].add(s["step"])
    return {"steps": [m["step"] for m in metrics],
            "trained_twice": sorted(g for g, steps in steps_of_group.items() if len(steps) > 1),
            "staleness_max": max((s["trained_version"] - s["behavior_version_min"] for s in samples), default=0),
            "replayed_tokens": metrics[-1].get("rollout/replayed_tokens_total", 0) if metrics else 0}


def hook(point: str) -> str:
    """The function a point kills in (``SITE``): a critic's point is its run's mid-step."""
    return point.removeprefix("critic-")


def kill_then_resume(tmp_path: Path, point: str) -> dict:
    config, nth = POINTS[point]
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    out, mark = tmp_path / point, tmp_path / f"{point}.killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(site), os.path.dirname(__file__)]),
           "ASYNCRL_KILL_AT": f"{hook(point)}:{nth}", "ASYNCRL_KILL_MARK": str(mark)}
    killed = subprocess.run(train_args(config, out), capture_output=True, text=True, env=env, timeout=300,
                            start_new_session=True)
    assert killed.returncode == -signal.SIGKILL and mark.read_text() == hook(point), killed.stderr[-3000:]
    env.pop("ASYNCRL_KILL_AT")
    resumed = subprocess.run(train_args(config, out, "resume=true"), capture_output=True, text=True, env=env,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {**outcome(out), "stderr": resumed.stderr, "out": out}


def critic_steps(checkpoint: Path) -> tuple[int, int, set[float]]:
    """What a checkpoint's critic has taken: its version, its LR schedule's steps and its
    AdamW's step count (one value per parameter, all equal for a critic trained whole)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    trainer = torch.load(checkpoint / "critic" / "trainer_state.pt", weights_only=False)
    flat = checkpoint.parent / f"{checkpoint.name}.critic_optimizer.pt"
    dcp_to_torch_save(checkpoint / "critic" / "optimizer", flat)
    state = torch.load(flat, weights_only=False)["optimizer"]["state"]
    return trainer["version"], trainer["scheduler"]["last_epoch"], {float(s["step"]) for s in state.values()}


@pytest.mark.parametrize("point", list(POINTS))
def test_kill_9_at_a_point_then_resume(tmp_path, point):
    result = kill_then_resume(tmp_path, point)
    assert result["steps"] == list(range(STEPS + 1))  # every step logged, none twice
    assert result["trained_twice"] == []
    assert result["staleness_max"] <= ETA
    if point == "mid-checkpoint-write":  # the half-written step_4.tmp is cleared, step_2 resumed from
        assert "step_4.tmp" in result["stderr"] and "resuming from" in result["stderr"]
    if point == "critic-mid-step":  # the critic resumed from step_2's and took steps 3-6 once each:
        # a critic started afresh would have taken 4 AdamW steps, one trained twice 7 or more
        assert "resuming from" in result["stderr"] and "step_2" in result["stderr"]
        assert critic_steps(result["out"] / "checkpoints" / f"step_{STEPS}") == (STEPS, STEPS, {float(STEPS)})
        rows = read_jsonl(result["out"] / "metrics.jsonl")
        assert all(math.isfinite(r["critic/value_loss"]) for r in rows if r["step"] > 0)


def test_a_damaged_newest_checkpoint_is_refused_and_the_previous_one_resumed(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(train_args(COUNTDOWN, out, "total_steps=4"), capture_output=True, text=True, env=env,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = out / "checkpoints" / "step_4" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a copy cut short
    resumed = subprocess.run(train_args(COUNTDOWN, out, "resume=true"), capture_output=True, text=True, env=env,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint {out / 'checkpoints' / 'step_4'} is damaged (SafetensorError" in resumed.stderr
    assert f"resuming from {out / 'checkpoints' / 'step_2'} (step 2)" in resumed.stderr
    result = outcome(out)
    assert result["steps"] == list(range(STEPS + 1)) and result["trained_twice"] == []


if __name__ == "__main__":  # the matrix, as docs/faults.md shows it
    import tempfile

    print("| killed at | resumed | steps logged once | trained twice | max staleness (η = 2) | replayed tokens |")
    print("|---|---|---|---|---|---|")
    for point in POINTS:
        with tempfile.TemporaryDirectory() as tmp:
            r = kill_then_resume(Path(tmp), point)
        print(f"| {point} | yes | {r['steps'] == list(range(STEPS + 1))} | {len(r['trained_twice'])} | "
              f"{r['staleness_max']} | {r['replayed_tokens']} |")
