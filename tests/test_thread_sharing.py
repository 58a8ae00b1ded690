"""``rollout.thread_sharing``: the rule that hands every core to the side working alone
(``CoreBudget``, hand-checked), the shared cell both sides meet in (``ThreadBudget``), and
a short async run in which the learner computed with every core while the engine waited."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.runtime import _thread_budget, _thread_split
from asyncrl.core_budget import CoreBudget, ThreadBudget


def test_the_side_working_alone_takes_every_core_and_both_working_split_them():
    rule = CoreBudget(cores=4, engine=1, learner=3, grace_s=0.05)
    # the other side works (None) on its share: the split, whichever side asks
    assert rule.threads("engine", None, 3) == 1
    assert rule.threads("learner", None, 1) == 3
    # the other side idle for less than the grace: still the split (between two pieces of work)
    assert rule.threads("engine", 0.049, 0) == 1
    assert rule.threads("learner", 0.0, 0) == 3
    # idle for the grace or longer: every core
    assert rule.threads("engine", 0.05, 0) == 4
    assert rule.threads("learner", 12.0, 0) == 4


def test_a_side_never_takes_a_core_the_other_holds_and_waits_while_it_holds_them_all():
    rule = CoreBudget(cores=2, engine=1, learner=1)
    # the learner took both while the engine was idle; the engine has work again: it waits (0)
    # until the learner, at its next boundary, sees the engine working and keeps to its share
    assert rule.threads("engine", None, 2) == 0
    assert rule.threads("learner", None, 0) == 1
    assert rule.threads("engine", None, 1) == 1
    # wanting every core beside a side still on one (its idle flag set, its count not yet given
    # back): what is left
    assert rule.threads("learner", 1.0, 1) == 1
    assert rule.threads("engine", None, 2) + 2 <= 2  # never a thread more than the cores


def test_colocated_learner_gives_every_core_to_the_learner_alone_and_the_engine_keeps_its_share():
    rule = CoreBudget(cores=2, engine=1, learner=1, whole=("learner",))
    assert rule.threads("learner", 1.0, 0) == 2
    assert rule.threads("engine", 1.0, 0) == 1
    cfg = load_config(None, ["mode=async", "rollout.thread_sharing=colocated_learner", "rollout.num_threads=1",
                             "rollout.learner_threads=1"])
    budget = _thread_budget(cfg, *_thread_split(cfg))
    try:
        assert budget.rule.whole == ("learner",)
    finally:
        budget.close()


@pytest.mark.parametrize("cores,engine,learner", [(0, 1, 1), (2, 0, 1), (2, 1, 3), (0, 0, 0)])
def test_a_budget_beyond_its_cores_is_refused(cores, engine, learner):
    with pytest.raises(ValueError, match="1 <= engine, learner <= cores"):
        CoreBudget(cores=cores, engine=engine, learner=learner)


def on_thread(fn):
    """``fn`` on a thread of its own, as each side runs in a run (torch threads are per thread)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_the_cell_hands_the_cores_between_the_engine_thread_and_the_learner_thread():
    """Each side on a thread of its own: each claim's count and the thread's own torch
    threads, the seconds counted at every core, the switches, both sides' slots kept."""
    budget = ThreadBudget(CoreBudget(cores=2, engine=1, learner=1, grace_s=0.0))

    def claim(side):
        return lambda: (budget.working(side), torch.get_num_threads())

    def stop(side):
        return lambda: (budget.idle(side), torch.get_num_threads())[1]

    try:
        assert on_thread(claim("engine")) == (2, 2)  # the learner never worked (idle since the cell was made)
        assert on_thread(stop("engine")) == 1  # back on its share, its cores free
        assert on_thread(claim("learner")) == (2, 2)  # the engine idle now: every core
        assert on_thread(stop("learner")) == 1
        assert on_thread(claim("engine")) == (2, 2)
        # the learner starts a step while the engine holds both cores: it waits for one, the
        # engine gives one back at its next boundary (once it sees the learner working)
        learner: list = []
        refused = threading.Event()  # the learner has asked the rule and been told to wait
        rule = budget.rule

        class Watched:  # the rule, seen: its answer to the learner's first claim is observed
            def __getattr__(self, name):
                return getattr(rule, name)

            def threads(self, side, other_idle_for, other_holds):
                count = rule.threads(side, other_idle_for, other_holds)
                if side == "learner" and count == 0:
                    refused.set()
                return count

        budget.rule = Watched()
        waiting = threading.Thread(target=lambda: learner.append(claim("learner")()))
        waiting.start()
        # until the learner has been told to wait (so it has waited once the engine gives a core
        # back): arranged, not hoped for — a fixed number of engine claims once ran out on a loaded
        # machine before the learner's thread was scheduled at all, and an engine claim made
        # between the learner's "working" and its first look let it in without a wait
        assert refused.wait(120), "the learner's thread never asked for its cores"
        assert math.isnan(budget._get("learner", "idle_since"))  # it says it works while it waits
        assert on_thread(claim("engine")) == (1, 1)  # it sees the learner working: back to its share
        waiting.join()
        assert learner == [(1, 1)]
        counters = budget.counters()
        # engine 2 -> 1 (idle), 1 -> 2, 2 -> 1; learner 2 -> 1 (idle), then 1 again
        assert (counters["engine_switches"], counters["learner_switches"]) == (3, 1)
        assert counters["engine_all_cores_s"] > 0 and counters["learner_all_cores_s"] > 0
        assert counters["learner_waited_s"] > 0 and counters["engine_waited_s"] == 0
    finally:
        budget.close()
def test_colocated_is_refused_where_one_engine_and_one_learner_rank_do_not_share_the_cores():
    with pytest.raises(Exception, match=r"rollout.num_workers=2.*rollout.thread_sharing=split"):
        load_config(None, ["rollout.thread_sharing=colocated", "rollout.num_workers=2"])
    with pytest.raises(Exception, match="learner.world_size=2"):
        load_config(None, ["rollout.thread_sharing=colocated", "learner.world_size=2"])


def test_split_makes_no_budget_and_sync_needs_none():
    """``split`` (the default) runs as before: no budget, each side its own count always."""
    for overrides in ([], ["mode=async"], ["mode=async", "rollout.thread_sharing=split"],
                      ["mode=sync", "rollout.thread_sharing=colocated"]):
        cfg = load_config(None, overrides)
        assert _thread_budget(cfg, *_thread_split(cfg)) is None, overrides
    cfg = load_config(None, ["mode=async", "rollout.thread_sharing=colocated", "rollout.num_threads=1",
                             "rollout.learner_threads=1"])
    budget = _thread_budget(cfg, *_thread_split(cfg))
    try:
        assert (budget.rule.cores, budget.rule.engine, budget.rule.learner) == (2, 1, 1)
    finally:
        budget.close()


def test_colocated_evaluates_on_the_rollout_engine_not_on_a_replica_beside_it():
    """The replica would be a third thread team on the cores the budget hands between two."""
    assert load_config(None, ["mode=async"]).background_eval
    for sharing in ("colocated", "colocated_learner"):
        assert not load_config(None, ["mode=async", f"rollout.thread_sharing={sharing}"]).background_eval
    assert not load_config(None, ["mode=async", "eval.background=false"]).background_eval


def _run(tmp_path, policy_dir, sharing):
    out = tmp_path / sharing
    # η = 4 over 4 steps: once the learner has taken its first batch (before it, one batch's groups
    # alone: GroupBuffer.hold_to_first_batch) the engine may generate every other step's groups and
    # then waits on the gate (or has nothing queued) while the learner still trains: one
    # micro-batch a sample and four passes over each batch, so the learner meets many boundaries
    # while the engine is idle
    overrides = [f"model.path={policy_dir}", f"output_dir={out}", "mode=async", "max_staleness=4", "total_steps=4",
                 "batch_size=2", "group_size=4", "eval_every=0", "eval.num_tasks=2", "eval.samples_per_task=1",
                 "task.num_train=32", "task.num_validation=4", "algorithm.filter_zero_variance=false",
                 "optim.micro_batch_size=1", "optim.ppo_epochs=4", "model.device=cpu", "save_every=0",
                 "rollout.num_threads=1", "rollout.learner_threads=1", f"rollout.thread_sharing={sharing}"]
    assert main(["train", "examples/countdown/async.yaml", *overrides]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _budget_run(tmp_path, policy_dir, sharing) -> list[dict]:
    """A short run with a core budget (``_run``), its steps' rows: every version trained,
    the bound kept, and each side computed some of its work with every core (the engine
    before the learner's first step, when it had nothing to train)."""
    rows = _run(tmp_path, policy_dir, sharing)
    steps = rows[1:]
    assert [r["version"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["staleness/max"] <= 4 for r in steps)
    assert sum(r["time/learner_all_cores_s"] for r in steps) > 0
    assert sum(r["time/engine_all_cores_s"] for r in steps) > 0
    return steps


@pytest.mark.slow
def test_an_async_colocated_run_gives_the_learner_every_core_while_the_engine_waits(tmp_path, policy_dir):
    steps = _budget_run(tmp_path, policy_dir, "colocated")
    # the learner (in its own process) never computed longer with every core than it computed at all
    assert all(r["time/learner_all_cores_s"] <= r["time/learner"] + 1e-6 for r in steps)
    assert sum(r["threads/learner_switches"] for r in steps) >= 1
    assert sum(r["threads/engine_switches"] for r in steps) >= 1


@pytest.mark.slow
def test_an_async_turns_run_keeps_the_bound_and_the_engine_waits_out_the_learners_steps(tmp_path, policy_dir):
    steps = _budget_run(tmp_path, policy_dir, "turns")
    # the learner's calls are its steps and the delivery check's forward pass
    # (time/delivery_check), which in turns also gets every core
    assert all(r["time/learner_all_cores_s"] <= r["time/learner"] + r.get("time/delivery_check", 0) + 1e-6
               for r in steps)
    # the engine, its groups queued (η = 4), waited for the learner's steps
    assert sum(r["time/engine_core_wait_s"] for r in steps) > 0


@pytest.mark.slow
def test_an_async_split_run_keeps_its_counts_and_logs_no_budget(tmp_path, policy_dir):
    rows = _run(tmp_path, policy_dir, "split")
    assert [r["version"] for r in rows] == [0, 1, 2, 3, 4]
    assert not any(k.startswith("threads/") or k.endswith("_all_cores_s") for r in rows for k in r)


def test_turns_gives_the_learner_every_core_whenever_it_works_and_the_engine_waits_for_it():
    """``turns``: the engine's share beside a working learner is 0 (it waits), the learner's
    every core; the engine takes every core once the learner has been idle for the grace."""
    rule = CoreBudget(cores=2, engine=0, learner=2, grace_s=0.05)
    assert rule.threads("engine", None, 2) == 0  # the learner works: wait
    assert rule.threads("engine", None, 0) == 0  # even where it holds none yet
    assert rule.threads("engine", 0.01, 0) == 0  # idle for less than the grace: between two micro-batches
    assert rule.threads("engine", 0.05, 0) == 2
    assert rule.threads("learner", None, 2) == 0  # the engine is inside a decode step on both: wait for it
    assert rule.threads("learner", None, 0) == 2
    assert rule.fallback("engine") == 1  # after max_wait_s, and the count it idles at
    cfg = load_config(None, ["mode=async", "rollout.thread_sharing=turns", "rollout.num_threads=1",
                             "rollout.learner_threads=1"])
    budget = _thread_budget(cfg, *_thread_split(cfg))
    try:
        assert (budget.rule.cores, budget.rule.engine, budget.rule.learner) == (2, 0, 2)
    finally:
        budget.close()
    assert not cfg.background_eval  # the replica would compute beside the learner


def test_in_turns_the_engine_thread_waits_out_the_learners_step_then_takes_every_core():
    budget = ThreadBudget(CoreBudget(cores=2, engine=0, learner=2, grace_s=0.0, max_wait_s=60.0))
    try:
        assert on_thread(lambda: budget.working("learner")) == 2
        engine: list = []
        waiting = threading.Thread(target=lambda: engine.append((budget.working("engine"), torch.get_num_threads())))
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive() and not engine  # the learner is still inside its step
        on_thread(lambda: budget.idle("learner"))
        waiting.join(10.0)
        assert engine == [(2, 2)]
        assert budget.counters()["engine_waited_s"] >= 0.2
    finally:
        budget.close()


def test_a_turns_engine_that_waited_max_wait_s_computes_on_one_thread():
    budget = ThreadBudget(CoreBudget(cores=2, engine=0, learner=2, grace_s=0.0, max_wait_s=0.05))
    try:
        assert on_thread(lambda: budget.working("learner")) == 2
        assert on_thread(lambda: (budget.working("engine"), torch.get_num_threads())) == (1, 1)
    finally:
        budget.close()


def test_evaluation_gives_the_engine_every_core_or_the_configs_count_and_no_learner():
    """``asyncrl eval`` (``train`` false): the engine's count is a number, every core the
    process has unless ``rollout.num_threads`` says otherwise — never None, which left the
    engine's new thread on one core (the docstring of ``_thread_split``)."""
    cores = torch.get_num_threads() or 2
    assert _thread_split(load_config(None, ["mode=async"]), train=False) == (cores, None)
    assert _thread_split(load_config(None, ["mode=sync"]), train=False) == (cores, None)
    assert _thread_split(load_config(None, ["rollout.num_threads=1"]), train=False) == (1, None)
