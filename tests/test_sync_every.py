"""``sync_every > 1``: several optimizer steps per weight sync (verl's first knob). The
engines serve a version for ``sync_every`` steps, so the learner trains on samples up to
``sync_every - 1`` versions older than it would otherwise; the config refuses a
``sync_every`` beyond η + 1, and within it the gate and the buffer keep every trained
token within η (``trainable`` stops the run on one older). End to end, with groups that
finish out of order."""

from __future__ import annotations

import json
import time
import zlib
from collections import defaultdict

import pytest

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config


def uneven_reward(task, response: str) -> float:
    """Parity, after a pause that depends on the task: groups finish out of the order they
    started in, as groups of long and short responses do."""
    time.sleep(0.03 * (zlib.crc32(task.id.encode()) % 4))
    return float(len(response) % 2)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("mode, eta, sync_every", [("async", 2, 3), ("one_step_off", 1, 2)])
@pytest.mark.slow
def test_several_steps_per_sync_run_end_to_end_within_eta(mode, eta, sync_every, tmp_path, policy_dir):
    out, steps = tmp_path / "run", 4 * sync_every
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 f"mode={mode}", f"max_staleness={eta}", f"sync_every={sync_every}", f"total_steps={steps}",
                 "batch_size=2", "group_size=4", "eval_every=0", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "task.num_train=64", "task.num_validation=4", "task.reward_fn=test_sync_every:uneven_reward",
                 *(["partial_rollout=off"] if mode == "one_step_off" else [])]) == 0
    metrics = [r for r in read(out / "metrics.jsonl") if "time/step" in r]
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    assert max(r["staleness/max"] for r in metrics) <= eta
    assert metrics[-1]["buffer/stale_dropped_total"] == 0

    # the engines were sent every sync_every-th version, and only those
    synced = [e["version"] for e in read(out / "timeline.jsonl") if e["kind"] == "sync"]
    assert synced == list(range(sync_every, steps + 1, sync_every))
    samples = read(out / "samples.jsonl")
    behavior = {v for s in samples for v in (s["behavior_version_min"], s["behavior_version_max"])}
    assert behavior <= {0, *synced}, f"tokens sampled by versions never sent to the engines: {sorted(behavior)}"

    # within η, and the last step before each sync trains on samples exactly sync_every - 1 versions old
    # (the engines still hold the version of the sync before): the bound is reached, not passed
    ages = defaultdict(set)
    for s in samples:
        ages[s["trained_version"]].add(s["trained_version"] - s["behavior_version_min"])
    assert max(max(a) for a in ages.values()) <= eta
    for version, seen in ages.items():
        if version % sync_every == sync_every - 1:
            assert min(seen) >= sync_every - 1, (version, seen)


def test_the_last_step_and_an_evaluation_on_the_engines_sync_whatever_sync_every(tmp_path, policy_dir):
    """An evaluation not beside training scores what the engines serve: at a step between
    syncs that was a version behind the step it was logged at, and the run's last
    evaluation (its summary line) was not of the final policy. Such a step syncs first."""
    out = tmp_path / "run"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "max_staleness=2", "sync_every=3", "total_steps=7", "eval_every=2", "eval.background=false",
                 "batch_size=2", "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=1", "task.num_train=64",
                 "task.num_validation=4", "task.reward_fn=test_sync_every:uneven_reward"]) == 0
    evaluated = {r["step"]: r["eval/version"] for r in read(out / "metrics.jsonl") if "eval/version" in r}
    assert evaluated == {0: 0, 2: 2, 4: 4, 6: 6, 7: 7}
    assert [e["version"] for e in read(out / "timeline.jsonl") if e["kind"] == "sync"] == [2, 3, 4, 6, 7]
    samples = read(out / "samples.jsonl")
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 2


@pytest.mark.parametrize("overrides, bound", [(["mode=one_step_off", "partial_rollout=off", "sync_every=3"], 2),
                                              (["max_staleness=0", "sync_every=2"], 1)])
def test_sync_every_beyond_eta_plus_one_is_refused_naming_the_bound(overrides, bound):
    with pytest.raises(ConfigError) as info:
        load_config("examples/countdown/async.yaml", overrides)
    assert f"use sync_every <= {bound}" in str(info.value)
