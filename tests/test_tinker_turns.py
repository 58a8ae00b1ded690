"""The training thread's turns (asyncrl/tinker/turns.py): each owner's jobs in its order, the
owners in turns, queued jobs cancelled at shutdown; no model, no server."""

from __future__ import annotations

import threading

import pytest

from asyncrl.tinker.turns import Turns


def test_owners_take_turns_and_each_keeps_its_order():
    turns, ran, release = Turns("test-turns"), [], threading.Event()
    try:
        first = turns.submit("x", lambda: (release.wait(10), ran.append("x1")))  # running while the rest queue
        jobs = [turns.submit(owner, lambda name=f"{owner}{k}": ran.append(name))
                for owner, k in [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 1), ("c", 1), ("b", 2)]]
        release.set()
        for job in [first, *jobs]:
            job.result(10)
    finally:
        turns.shutdown()
    # a's long queue came first, yet b and c wait for one of a's jobs, not four
    assert ran == ["x1", "a1", "b1", "c1", "a2", "b2", "a3", "a4"]


def test_a_failing_job_fails_its_future_only_and_shutdown_cancels_the_queued():
    turns, release = Turns("test-turns"), threading.Event()
    running = turns.submit("a", lambda: release.wait(10))

    def boom() -> None:
        raise ValueError("this job's own error")

    failing, after = turns.submit("b", boom), turns.submit("b", lambda: "still served")
    release.set()
    with pytest.raises(ValueError, match="this job's own error"):
        failing.result(10)
    assert after.result(10) == "still served" and running.result(10) is True
    release.clear()
    started = threading.Event()
    blocker = turns.submit("a", lambda: (started.set(), release.wait(10))[1])
    assert started.wait(10)
    queued = turns.submit("c", lambda: "never")
    threading.Timer(0.2, release.set).start()
    turns.shutdown()
    assert queued.cancelled() and blocker.result(0) is True
    with pytest.raises(RuntimeError, match="shut down"):
        turns.submit("a", lambda: None)
