"""The starvation guard: a learner starved by zero-variance filtering is named on the bar
and in one warning, and past a second limit the run stops (exit 1) — while a healthy run's
filtering (the Countdown example drops ~69 % of its groups) never trips it."""

from __future__ import annotations

import asyncio
import json
import random
import time

from asyncrl.cli import main
from asyncrl.config import WatchdogConfig
from asyncrl.orchestrator.watchdog import StarvationGuard, Watchdog
from asyncrl.types import Episode


def feed(guard: StarvationGuard, outcomes: str) -> list[tuple[bool, bool]]:
    """``outcomes``: ``f`` filtered, ``a`` accepted; the (starved, must_stop) after each."""
    seen = []
    for outcome in outcomes:
        guard.group(outcome == "f")
        seen.append((guard.starved, guard.must_stop))
    return seen


def test_warns_then_stops_at_the_counts_the_limits_name():
    guard = StarvationGuard(window=10, warn_fraction=0.5, stop_fraction=0.8)
    feed(guard, "a" * 10)
    seen = feed(guard, "f" * 10)  # the window holds k filtered after the k-th
    assert [k + 1 for k, (starved, _) in enumerate(seen) if starved][0] == 6  # 6/10 > 0.5; 5/10 is not
    assert [k + 1 for k, (_, stop) in enumerate(seen) if stop][0] == 9  # 9/10 > 0.8
    assert guard.episodes == 1 and guard.fraction == 1.0


def test_nothing_is_judged_before_the_window_is_full():
    guard = StarvationGuard(window=10, warn_fraction=0.5, stop_fraction=0.8)
    assert feed(guard, "f" * 9) == [(False, False)] * 9
    assert guard.fraction == 1.0  # the metric is defined from the first group on
    assert feed(guard, "f") == [(True, True)]


def test_one_warning_per_episode_of_starvation():
    guard = StarvationGuard(window=10, warn_fraction=0.5, stop_fraction=1.0)
    feed(guard, "f" * 10)
    fractions = []
    for outcome in "fafafafafaf" * 4:  # wavers about the limit: 5 or 6 of the last 10 filtered
        feed(guard, outcome)
        fractions.append(guard.fraction)
    assert set(fractions[10:]) == {0.5, 0.6}
    assert guard.episodes == 1 and guard.starved
    feed(guard, "f" * 10 + "a" * 13)  # over the limit until the 5th accepted group, then 9 under it
    assert guard.starved  # 9 calm groups: the episode is not over yet
    feed(guard, "a")
    assert not guard.starved  # a whole window under the limit ends it
    feed(guard, "f" * 6)
    assert guard.episodes == 2 and guard.starved


def test_a_limit_of_1_never_fires():
    guard = StarvationGuard(window=4, warn_fraction=1.0, stop_fraction=1.0)
    assert feed(guard, "f" * 20)[-1] == (False, False)


def test_the_default_limits_hold_under_healthy_filtering():
    """Groups filtered independently at 69 % (Countdown's rate over its run) and at 80 %:
    over 50,000 groups the default window never warns."""
    cfg = WatchdogConfig()
    rng = random.Random(0)
    for rate in (0.69, 0.8):
        guard = StarvationGuard(cfg.starvation_window, cfg.starvation_warn_fraction, cfg.starvation_stop_fraction)
        highest = 0.0
        for _ in range(50_000):
            guard.group(rng.random() < rate)
            highest = max(highest, guard.fraction)
        assert guard.episodes == 0 and not guard.must_stop
        assert highest < cfg.starvation_warn_fraction


def test_the_default_limits_stop_a_collapse():
    """Healthy filtering, then a policy whose groups are all filtered but 1 in 60: warned
    within a few hundred groups, stopped within one window."""
    cfg = WatchdogConfig()
    guard = StarvationGuard(cfg.starvation_window, cfg.starvation_warn_fraction, cfg.starvation_stop_fraction)
    rng = random.Random(1)
    feed(guard, "".join("f" if rng.random() < 0.69 else "a" for _ in range(2000)))
    seen = feed(guard, ("f" * 59 + "a") * 20)
    warned_after = next(k for k, (starved, _) in enumerate(seen) if starved) + 1
    stopped_after = next(k for k, (_, stop) in enumerate(seen) if stop) + 1
    assert warned_after < 400 and stopped_after <= cfg.starvation_window


def test_the_evidence_names_the_counts_and_the_common_reward():
    guard = StarvationGuard(window=100, warn_fraction=0.9, stop_fraction=0.95)
    for value in [0.1] * 90 + [0.0] * 8 + [1.0] * 2:
        guard.reward(value)
    feed(guard, "f" * 98 + "a" * 2)
    text = guard.evidence("watchdog.starvation_stop_fraction=0.95")
    assert "98 of the last 100 groups were filtered, more than watchdog.starvation_stop_fraction=0.95" in text
    assert "(50 generated per group trained)" in text
    assert "of the last 100 training episodes 90 scored 0.1 (rewards from 0 to 1)" in text
    assert "collapsed onto one answer" in text


def failed(task_id: str) -> Episode:
    return Episode(task_id, status="error")


def test_the_watchdog_feeds_the_guard_and_stops_with_advice():
    dog = Watchdog(WatchdogConfig(starvation_window=8, starvation_warn_fraction=0.5, starvation_stop_fraction=0.8,
                                  max_error_rate=1.0))
    for _ in range(8):
        dog.episode(Episode("t", reward=0.1), "train")
        dog.episode(Episode("v", reward=1.0), "eval")  # evaluation is not what the learner is fed
        dog.episode(failed("x"), "train")
        dog.group("all_error")  # failures are the error rule's, not starvation
    assert len(dog.starvation.recent) == 0 and list(dog.starvation.rewards) == [0.1] * 8
    for _ in range(8):
        dog.group("filtered")
    reason = dog.verdict()
    assert "the learner is starved: 8 of the last 8 groups were filtered" in reason
    assert "all of the last 8 training episodes scored 0.1" in reason
    assert "watchdog.starvation_stop_fraction=1 lets a run go on starved" in reason


def test_watch_warns_once_marks_the_bar_and_stops(capsys):
    dog = Watchdog(WatchdogConfig(starvation_window=4, starvation_warn_fraction=0.5, starvation_stop_fraction=0.9))
    shown: list[str | None] = []

    async def run() -> str:
        watch = asyncio.create_task(dog.watch(shown.append, interval_s=0.001))
        for outcome in "aaaafffaa":  # 2 of 4 filtered is not more than 0.5, 3 of 4 is; then 2 again
            dog.group("filtered" if outcome == "f" else "accepted")
            await asyncio.sleep(0.01)
        for _ in range(4):  # 4 of 4 (past the stop limit) before the episode ended: no second warning
            dog.group("filtered")
        try:
            await asyncio.wait_for(watch, 1)
        except Exception as exc:  # noqa: BLE001 - the stop is what is tested
            return str(exc)
        return ""

    message = asyncio.run(run())
    err = capsys.readouterr().err
    assert err.count("asyncrl: warning: the learner is starved") == 1
    assert "3 of the last 4 groups were filtered" in err and "stops past watchdog.starvation_stop_fraction=0.9" in err
    assert shown == ["75% of groups filtered", "50% of groups filtered", "100% of groups filtered"]
    assert message.startswith("stopped by the watchdog: the learner is starved: 4 of the last 4 groups")


# ----------------------------------------------------------------- real runs
def constant_reward(task, response: str) -> float:
    return 0.1


def half_flat_reward(task, response: str) -> float:
    """Constant on half the tasks (their groups are filtered), varied on the others."""
    return 0.0 if len(task.prompt) % 2 else float(len(response) % 2)


def run_args(policy_dir, out, *extra):
    return ["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
            "batch_size=2", "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=1", "eval_every=0",
            "task.num_train=64", "task.num_validation=4", "algorithm.filter_zero_variance=true", *extra]


def test_a_run_whose_every_group_is_filtered_stops_starved(tmp_path, policy_dir, capsys):
    start = time.perf_counter()
    code = main(run_args(policy_dir, tmp_path / "flat", "total_steps=4",
                         "task.reward_fn=test_starvation:constant_reward",
                         "watchdog.starvation_window=16"))
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 1 and elapsed < 60
    assert "stopped by the watchdog: the learner is starved: 16 of the last 16 groups were filtered" in err
    assert "all of the last" in err and "training episodes scored 0.1" in err
    assert "asyncrl: warning: the learner is starved" in err  # said before it stopped
    assert "last good checkpoint: none yet" in err


def test_the_window_fraction_is_logged_each_step(tmp_path, policy_dir):
    out = tmp_path / "half_flat"
    assert main(run_args(policy_dir, out, "total_steps=3", "task.reward_fn=test_starvation:half_flat_reward")) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    for row in steps:  # fewer groups than the window: the fraction of every group so far
        filtered, accepted = row["rollout/groups_filtered_total"], row["rollout/groups_accepted_total"]
        assert row["rollout/filtered_fraction_window"] == filtered / (filtered + accepted)
    assert any(row["rollout/groups_filtered_total"] for row in steps)


def test_a_starved_stop_shows_what_the_model_answered_and_writes_it(tmp_path):
    """Every reward 0: no group is ever trained, so samples.jsonl stays empty; the stop's
    message quotes the answers and their rewards, and filtered_samples.jsonl holds them."""
    from asyncrl.types import AttemptError, Trajectory

    dog = Watchdog(WatchdogConfig(starvation_window=4, starvation_warn_fraction=0.5, starvation_stop_fraction=0.7),
                   output_dir=tmp_path)
    for g in range(6):
        group = [Episode(f"task{g}", [Trajectory([1], [7, 7, 3], [1] * 3, [0.0] * 3, [0] * 3)], reward=0.0,
                         metadata={"response": f"{g}+{s}=9"})
                 for s in range(3)]
        group.append(Episode(f"task{g}", status="error",
                             errors=[AttemptError(1, "ValueError: no number\nmore", "Traceback ...")]))
        for episode in group:
            dog.episode(episode, "train")
        dog.group("filtered", group)
    try:
        asyncio.run(dog.watch(interval_s=0))
    except Exception as exc:  # the stop
        message = str(exc)
    assert "the learner is starved: 4 of the last 4 groups were filtered" in message
    assert f"what the model answered in the last groups not trained (all 6 in {tmp_path / 'filtered_samples.jsonl'})" \
        in message
    assert "  task task5 (filtered):\n    reward 0, stop: '5+0=9'\n" in message
    assert "    failed: ValueError: no number, error: (0 tokens, no text kept)" in message
    assert "task task2" not in message  # the last three groups are quoted
    rows = [json.loads(line) for line in (tmp_path / "filtered_samples.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in rows] == [f"task{g}" for g in range(6)]
    assert rows[0]["outcome"] == "filtered"
    assert [(s["answer"], s["reward"], s["status"]) for s in rows[0]["samples"]] == [
        ("0+0=9", 0.0, "ok"), ("0+1=9", 0.0, "ok"), ("0+2=9", 0.0, "ok"), (None, 0.0, "error")]
    assert rows[0]["samples"][0]["response_tokens"] == 3 and rows[0]["samples"][3]["error"] == "ValueError: no number"
