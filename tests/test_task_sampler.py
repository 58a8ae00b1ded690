"""``task.sampler: adaptive``: tasks whose recent groups all scored the same are handed out
less often, never never; deterministic given the seed; off by default, where the task
order is what it always was."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config
from asyncrl.orchestrator.task_sampler import TaskSampler, group_outcome
from asyncrl.orchestrator.task_stream import TaskStream


def test_outcomes():
    assert group_outcome([1.0, 1.0, 1.0], success_threshold=1.0) == "saturated"
    assert group_outcome([0.1, 0.1], success_threshold=1.0) == "hopeless"
    assert group_outcome([0.0, 1.0], success_threshold=1.0) == "mixed"
    assert group_outcome([0.5, 0.5], success_threshold=0.5) == "saturated"


def test_visit_probability_falls_with_uninformative_groups_and_never_reaches_zero():
    sampler = TaskSampler(seed=0, window=4, min_probability=0.3)
    assert sampler.probability(7) == 1.0  # never seen
    sampler.observe(7, "hopeless")
    assert sampler.probability(7) == 1 / 2
    sampler.observe(7, "saturated")
    assert sampler.probability(7) == pytest.approx(1 / 3)
    sampler.observe(7, "hopeless")
    assert sampler.probability(7) == 0.3  # (0 + 1) / 4 is below the floor
    for _ in range(4):
        sampler.observe(7, "mixed")
    assert sampler.probability(7) == 1.0  # the window forgets: the task teaches again
    sampler.observe(8, "mixed")
    assert sampler.probability(8) == 1.0
    with pytest.raises(ValueError, match="min_probability"):
        TaskSampler(seed=0, window=4, min_probability=0.0)


def hand_out(stream: TaskStream, n: int) -> list[tuple[int, int]]:
    return [(d.index, d.epoch) for d in (stream.next_draw() for _ in range(n))]


def test_uniform_is_the_old_order_and_a_sampler_with_nothing_learnt_changes_nothing():
    tasks = list(range(10))
    plain = hand_out(TaskStream(tasks, seed=5), 35)
    assert sorted(i for i, epoch in plain if epoch == 0) == tasks  # every task once an epoch
    assert hand_out(TaskStream(tasks, seed=5, sampler=TaskSampler(5, 4, 0.1)), 35) == plain


def test_uninformative_tasks_are_visited_less_but_still_visited_and_deterministically():
    tasks = list(range(20))
    hopeless = set(range(10))  # tasks 0-9 always score the same, 10-19 never

    def run(seed):
        sampler = TaskSampler(seed, window=4, min_probability=0.1)
        stream = TaskStream(tasks, seed, sampler=sampler)
        draws = []
        for _ in range(400):
            draw = stream.next_draw()
            sampler.observe(draw.index, "hopeless" if draw.index in hopeless else "mixed")
            draws.append((draw.index, draw.epoch))
        return draws, sampler.counts["sampler_skipped"], stream.epoch, stream.index

    draws, skipped, epochs, index = run(seed=1)
    visits = Counter(i for i, _ in draws)
    assert set(visits) == set(tasks)  # none left out for good
    informative = sum(visits[i] for i in range(10, 20))
    assert informative > 3 * sum(visits[i] for i in hopeless)
    assert all(visits[i] == epochs + 1 or visits[i] == epochs for i in range(10, 20))  # always handed out
    assert all(visits[i] >= 2 for i in hopeless)  # the floor: revisited
    assert skipped == 20 * epochs + index - len(draws) > 0  # every position passed over is counted
    assert run(seed=1) == (draws, skipped, epochs, index)  # deterministic given the seed
    assert run(seed=2)[0] != draws


def test_config_opt_in_and_shorthand():
    assert load_config("examples/countdown/async.yaml").task.sampler.name == "uniform"
    cfg = load_config("examples/countdown/async.yaml", ["task.sampler=adaptive"])
    assert (cfg.task.sampler.name, cfg.task.sampler.window, cfg.task.sampler.min_probability) == ("adaptive", 4, 0.1)
    with pytest.raises(ConfigError, match="min_probability"):
        load_config("examples/countdown/async.yaml", ["task.sampler.min_probability=0"])
    with pytest.raises(ConfigError, match="sampler"):
        load_config("examples/countdown/async.yaml", ["task.sampler=hardest"])


def half_hopeless(task, text):
    """Odd-numbered tasks score the length's parity (mixed groups); even ones 0, always."""
    return float(len(text) % 2) if int(task.id.rsplit("-", 1)[1]) % 2 else 0.0


def test_a_run_with_the_sampler_counts_what_it_passed_over(tmp_path, policy_dir):
    out = tmp_path / "run"
    assert main(["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "total_steps=8", "batch_size=2", "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=1",
                 "eval_every=0", "task.num_train=8", "task.num_validation=4", "sampling.max_tokens=8",
                 "task.reward_fn=test_task_sampler:half_hopeless", "task.sampler=adaptive",
                 "task.sampler.min_probability=0.2"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    last = metrics[-1]
    assert last["rollout/groups_hopeless_total"] >= 4  # the even tasks, each at least once
    assert last["rollout/groups_hopeless_total"] <= last["rollout/groups_filtered_total"]
    assert last["rollout/sampler_skipped_total"] > 0
    assert {int(s["task_id"].rsplit("-", 1)[1]) % 2 for s in samples} == {1}  # only the mixed ones train
