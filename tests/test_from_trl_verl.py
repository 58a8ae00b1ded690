"""The "Coming from TRL / verl" examples (docs/usage.md): each trains with its documented
command, and the rewards come from the user's function as written, called the way its
framework calls it (TRL's once per group with the columns, verl's once per completion
with the ground truth)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from test_examples import REPO, in_repo  # noqa: F401 (a fixture: the examples' paths are the repository's)
from test_examples import train as train_example

from asyncrl.config import load_config
from asyncrl.plugins import load_named
from asyncrl.rollout.workflows.registry import build_tasks


def spy_on(monkeypatch, spec):
    """Record every call of the example's reward function (its signature kept: the wrapper
    is recognised as the function it wraps); returns the list of (kwargs, result)."""
    fn = load_named(spec, key="task.reward_fn")
    module = sys.modules[fn.__module__]
    calls = []

    @functools.wraps(fn)
    def spy(*args, **kwargs):
        result = fn(*args, **kwargs)
        calls.append((kwargs, result))
        return result

    monkeypatch.setattr(module, fn.__name__, spy)
    return fn, calls


def run_example(name, tmp_path, monkeypatch):
    """The documented command of ``examples/NAME/train.yaml`` for 2 small steps
    (test_examples.py's sizes), its reward function watched: (the function, its calls, the
    trained samples, the train tasks by id). No episode failed."""
    config = f"examples/{name}/train.yaml"
    cfg = load_config(config)
    fn, calls = spy_on(monkeypatch, cfg.task.reward_fn)
    samples = train_example(config, tmp_path / name)
    assert not (tmp_path / name / "errors.jsonl").read_text().strip()
    assert len(samples) == 2 * 2 * 4
    return fn, calls, samples, {t.id: t for t in build_tasks(cfg).train}


@pytest.mark.slow
@pytest.mark.usefixtures("in_repo")
def test_the_trl_example_trains_with_its_reward_called_once_per_group(tmp_path, monkeypatch):
    fn, calls, samples, tasks = run_example("from_trl", tmp_path, monkeypatch)
    batches = [kwargs for kwargs, _ in calls]
    assert batches and max(len(k["completions"]) for k in batches) == 4  # a group's completions in one call
    assert all(set(k) >= {"prompts", "completions", "completion_ids", "numbers", "target"} for k in batches)
    for s in samples:  # each trained reward is the function's own verdict on that response
        task = tasks[s["task_id"]]
        assert s["reward"] == fn(completions=[s["response"]], numbers=[task.data["numbers"]],
                                 target=[task.data["target"]])[0]


@pytest.mark.slow
@pytest.mark.usefixtures("in_repo")
def test_the_verl_example_trains_with_compute_score_per_completion(tmp_path, monkeypatch):
    fn, calls, samples, tasks = run_example("from_verl", tmp_path, monkeypatch)
    assert len(calls) >= len(samples)  # one call per completion (evaluation's too)
    assert all(set(k) == {"data_source", "solution_str", "ground_truth", "extra_info"} for k, _ in calls)
    for s in samples:
        data = tasks[s["task_id"]].data
        verdict = fn("countdown", s["response"], data["reward_model"]["ground_truth"], data["extra_info"])
        assert s["reward"] == verdict["score"]
        assert s["reward_extras"] == {"parsed": verdict["parsed"]}  # the dict's other keys, kept


def test_the_examples_data_is_what_their_scripts_write(tmp_path):
    subprocess.run([sys.executable, str(REPO / "examples/from_trl/make_data.py"), "--out", str(tmp_path / "trl")],
                   check=True, capture_output=True)
    shipped, written = datasets.load_from_disk(str(REPO / "examples/from_trl/data")), \
        datasets.load_from_disk(str(tmp_path / "trl"))
    assert {k: v.to_list() for k, v in shipped.items()} == {k: v.to_list() for k, v in written.items()}
    assert (len(shipped["train"]), len(shipped["test"])) == (168, 32)
    subprocess.run([sys.executable, str(REPO / "examples/from_verl/make_data.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for split in ("train", "test"):
        read = functools.partial(datasets.Dataset.from_parquet, cache_dir=str(tmp_path / "cache"))
        assert read(str(REPO / f"examples/from_verl/{split}.parquet")).to_list() == \
            read(str(tmp_path / f"{split}.parquet")).to_list()


@pytest.mark.usefixtures("in_repo")
def test_the_examples_rewards_score_the_known_solutions():
    rows = [json.loads(line) for line in Path("examples/jsonl/data.jsonl").read_text().splitlines()]
    trl = load_named("examples/from_trl/reward.py:countdown_reward", key="task.reward_fn")
    assert trl(prompts=[r["prompt"] for r in rows], completions=[r["solution"] for r in rows],
               numbers=[r["numbers"] for r in rows], target=[r["target"] for r in rows]) == [1.0] * len(rows)
    assert trl(completions=[[{"role": "assistant", "content": "9*(4-3)"}], "9*(4-3)+0"], numbers=[[4, 9, 3]] * 2,
               target=[9, 9]) == [1.0, 0.0]
    verl = load_named("examples/from_verl/reward.py:compute_score", key="task.reward_fn")
    assert verl("countdown", "9*(4-3)", "9", {"numbers": [4, 9, 3]})["score"] == 1.0
    assert verl("countdown", "nine", "9", {"numbers": [4, 9, 3]}) == {"score": 0.0, "parsed": False}


@pytest.mark.slow
@pytest.mark.usefixtures("in_repo")
def test_the_trl_example_trains_on_a_weighted_list_each_function_logged_apart(tmp_path):
    from asyncrl.jsonl import read_jsonl

    out = tmp_path / "list"
    samples = train_example("examples/from_trl/train.yaml", out,
                            "task.reward_fn=[examples/from_trl/reward.py:countdown_reward, "
                            "examples/from_trl/reward.py:short_answer]", "task.reward_weights=[1.0, 0.1]")
    assert samples and not (out / "errors.jsonl").read_text().strip()
    for s in samples:  # the reward is the weighted sum of the two, each kept by name
        assert set(s["rewards"]) == {"countdown_reward", "short_answer"}
        assert s["reward"] == pytest.approx(s["rewards"]["countdown_reward"] + 0.1 * s["rewards"]["short_answer"])
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert steps and all({"reward/countdown_reward/mean", "reward/short_answer/mean"} <= set(r) for r in steps)
