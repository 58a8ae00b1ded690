"""A fractional staleness bound: the gate's limit ``(v + 1) * B + floor(η · B)`` by hand,
the integer rule unchanged, the two claims of ``orchestrator/staleness.py``'s proof under
random interleavings, and the doctor failing a run that breaks the off-policy share."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.modes import off_policy_groups, staleness_fraction, staleness_lag
from asyncrl.orchestrator import StalenessGate
from asyncrl.orchestrator.invariants import FAIL, OK, Limits, staleness_bound
from asyncrl.report import load_run
from asyncrl.report.doctor import findings
from asyncrl.report.summary import summarize

# (η, B) -> (floor(η·B), ceil(η)), worked out by hand
BY_HAND = {
    (0, 1): (0, 0), (0, 4): (0, 0), (0, 8): (0, 0),
    (0.5, 1): (0, 1), (0.5, 4): (2, 1), (0.5, 8): (4, 1),
    (1, 1): (1, 1), (1, 4): (4, 1), (1, 8): (8, 1),
    (1.25, 1): (1, 2), (1.25, 4): (5, 2), (1.25, 8): (10, 2),
    (2, 1): (2, 2), (2, 4): (8, 2), (2, 8): (16, 2),
}


@pytest.mark.parametrize(("eta", "b"), list(BY_HAND))
def test_the_limit_by_hand(eta, b):
    extra, lag = BY_HAND[(eta, b)]
    for version in (0, 3):
        gate = StalenessGate(eta, b, version)
        assert gate.limit == (version + 1) * b + extra
        assert (gate.off_policy_groups, gate.max_lag) == (extra, lag)
    assert StalenessGate(eta, b).max_staleness == eta  # as configured: an int stays an int


@given(eta=st.integers(0, 6), b=st.integers(1, 16), version=st.integers(0, 50))
def test_an_integer_eta_keeps_the_old_rule(eta, b, version):
    gate = StalenessGate(eta, b, version)
    assert gate.limit == (eta + version + 1) * b and gate.max_lag == eta
    assert StalenessGate(float(eta), b, version).limit == gate.limit  # 2.0 is 2


def test_eta_is_read_as_the_decimal_it_prints_as():
    # 0.3 as a binary float is just below 3/10: floor(0.3 * 10) in floats would be 2
    assert staleness_fraction(0.3) * 10 == 3 and off_policy_groups(0.3, 10) == 3
    assert off_policy_groups(0.1, 30) == 3 and staleness_lag(0.1) == 1 and staleness_lag(3.0) == 3
    for bad in (-0.5, -1, "0.5", True, None):
        with pytest.raises(ValueError, match="max_staleness"):
            StalenessGate(bad, 4)


def test_the_config_takes_a_fractional_eta():
    cfg = load_config("examples/addition/async.yaml", ["max_staleness=0.5"])
    assert cfg.effective_max_staleness == 0.5
    assert load_config("examples/addition/async.yaml", ["max_staleness=2"]).max_staleness.__class__ is int
    # modes that fix η ignore it
    assert load_config("examples/addition/async.yaml", ["mode=one_step_off", "max_staleness=0.5"]
                       ).effective_max_staleness == 1
    with pytest.raises(ValueError, match="sync_every"):  # a sync every 2 steps trains samples 1 version old
        load_config("examples/addition/async.yaml", ["max_staleness=0.5", "sync_every=2"])


def test_half_a_batch_from_the_previous_version_and_no_more():
    # η = 0.5, B = 4: six groups start at version 0, the first four train version 0's step
    gate = StalenessGate(0.5, 4)
    for _ in range(6):
        gate.on_start()
    assert not gate.can_start()
    for _ in range(6):
        gate.on_accept()
    gate.on_version(1)  # 4 consumed; the step of version 1 can take the 2 left over and 2 fresh ones
    assert gate.capacity == 4


@dataclass
class Group:
    start_version: int
    accepted: bool = False


START, ACCEPT, REJECT_RUNNING, DROP_ACCEPTED, LEARN = range(5)


@settings(max_examples=300, deadline=None)
@given(
    eta=st.sampled_from([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 2.5]),
    b=st.integers(1, 8),
    in_start_order=st.booleans(),
    ops=st.lists(st.tuples(st.sampled_from([START, START, START, ACCEPT, ACCEPT, ACCEPT, REJECT_RUNNING,
                                            DROP_ACCEPTED, LEARN, LEARN]),
                           st.integers(0, 15)), min_size=60, max_size=250),
)
def test_any_completion_order_keeps_both_bounds(eta, b, in_start_order, ops):
    """Groups complete in any order. The learner takes any B accepted groups (or, with
    ``in_start_order``, the B oldest once they are all done); as the buffer does, it drops
    first any group older than ``ceil(η)``. Claim (b) holds whatever it takes: at most
    ``floor(η·B)`` groups of a step started before the version it trains. Claim (a) holds
    with start-order consumption without any drop: no group is older than ``ceil(η)``."""
    gate = StalenessGate(eta, b)
    lag, most = math.ceil(eta), math.floor(eta * b + 1e-9)
    live: list[Group] = []  # started, not rejected, not consumed; in start order
    for op, pick in ops:
        running = [g for g in live if not g.accepted]
        accepted = [g for g in live if g.accepted]
        if op == START and gate.can_start():
            gate.on_start()
            live.append(Group(gate.version))
        elif op == ACCEPT and running:
            running[pick % len(running)].accepted = True
            gate.on_accept()
        elif op in (REJECT_RUNNING, DROP_ACCEPTED) and (running if op == REJECT_RUNNING else accepted):
            pool = running if op == REJECT_RUNNING else accepted
            live.remove(pool[pick % len(pool)])
            gate.on_reject(was_accepted=op == DROP_ACCEPTED)
        elif op == LEARN:
            if in_start_order:
                batch = live[:b]
                if len(batch) < b or not all(g.accepted for g in batch):
                    continue
                assert all(gate.version - g.start_version <= lag for g in batch)  # (a)
            else:
                for g in [g for g in accepted if gate.version - g.start_version > lag]:
                    live.remove(g)  # the buffer's age check
                    gate.on_reject(was_accepted=True)
                accepted = [g for g in live if g.accepted]
                if len(accepted) < b:
                    continue
                turned = accepted[pick % len(accepted):] + accepted[:pick % len(accepted)]
                batch = (turned if pick % 2 else turned[::-1])[:b]  # any B of them, oldest or youngest first
            assert sum(g.start_version < gate.version for g in batch) <= most  # (b)
            for g in batch:
                live.remove(g)
            gate.on_version(gate.version + 1)
        assert gate.started <= gate.limit


def _samples(off_per_step: dict[int, int], b: int = 8) -> list[dict]:
    """Two samples per group, B groups a step; ``off_per_step[step]`` of them one version old."""
    rows = []
    for step in range(1, 4):
        for group in range(b):
            age = 1 if group < off_per_step.get(step, 0) else 0
            rows += [{"step": step, "group": step * 100 + group, "trained_version": step,
                      "behavior_version_min": step - age, "response_tokens": 3}] * 2
    return rows


def test_the_doctor_checks_the_off_policy_share_of_a_fractional_eta():
    limits = Limits.from_config({"batch_size": 8}, 0.5)
    found = staleness_bound(_samples({2: 4, 3: 4}), limits)
    assert found.status == OK and "at most 4 off-policy groups" in found.evidence, found
    found = staleness_bound(_samples({2: 4, 3: 5}), limits)
    assert (found.status, found.step) == (FAIL, 3) and "floor(η·B)=4 of B=8" in found.evidence, found
    # age past ceil(η) = 1 fails whatever the share
    rows = [{**r, "behavior_version_min": r["trained_version"] - 2} if r["step"] == 2 else r for r in _samples({})]
    found = staleness_bound(rows, limits)
    assert (found.status, found.step) == (FAIL, 2), found
    # an integer η bounds only the age: 5 of 8 groups one version old is fine at η = 1
    assert staleness_bound(_samples({3: 5}), Limits.from_config({"batch_size": 8}, 1)).status == OK


def test_the_report_reads_a_fractional_eta_as_an_age_of_ceil_eta(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("mode: async\nmax_staleness: 0.5\nbatch_size: 8\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    (run_dir / "timeline.jsonl").write_text("")
    rows = _samples({2: 4}) + [{"step": 3, "group": 399, "trained_version": 3, "behavior_version_min": 1,
                                "response_tokens": 3}]
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(run_dir)
    assert (run.max_staleness, run.max_lag) == (0.5, 1)
    summary = summarize(run)
    assert summary["staleness bound η"] == 0.5 and summary["samples beyond η"] == 1  # the one 2 versions old
    found = {f.name: f for f in findings(run)}["staleness ≤ η"]
    assert (found.status, found.step) == (FAIL, 3), found


@pytest.mark.slow
def test_half_a_batch_stale_trains_and_keeps_its_share(tmp_path):
    """``max_staleness=0.5`` on the addition example (B = 8): no sample more than 1 version
    old, at most 4 groups of a step from the previous version, and the doctor agrees."""
    out = tmp_path / "eta05"
    assert main(["train", "examples/addition/async.yaml", f"output_dir={out}", "max_staleness=0.5",
                 "total_steps=12", "eval_every=0"]) == 0
    off: dict[int, set] = defaultdict(set)
    ages = []
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["response_tokens"]:
            ages.append(row["trained_version"] - row["behavior_version_min"])
            if ages[-1] > 0:
                off[row["step"]].add(row["group"])
    assert ages and 0 <= min(ages) and max(ages) <= 1
    assert all(len(groups) <= 4 for groups in off.values()), {s: len(g) for s, g in off.items()}
    found = {f.name: f for f in findings(load_run(out))}["staleness ≤ η"]
    assert found.status == OK and "floor(η·B)=4 of B=8" in found.evidence, found
