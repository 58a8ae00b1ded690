"""Evaluation beside training on a fleet (``eval.urls``): servers of evaluation's own, or a
share of ``remote.urls`` taken out of training, each evaluation pinned to the version it
scores. Against in-process ``serve-engine`` servers (``test_remote_engine.ThreadFleet``)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from test_remote_engine import Fleet, ThreadFleet, _policy, perturbed

from asyncrl.config import ConfigError, load_config
from asyncrl.engine.factory import EngineRequest, build_engine
from asyncrl.jsonl import read_jsonl
from asyncrl.rollout.worker import check_pinned
from asyncrl.types import Episode, Trajectory

EXAMPLE = "examples/addition/async.yaml"


def test_eval_urls_take_their_share_of_the_fleet_and_are_refused_where_they_cannot_work():
    fleet = ["engine=remote", "remote.urls=[http://127.0.0.1:1,http://127.0.0.1:2/]", "mode=async"]
    shared = load_config(EXAMPLE, [*fleet, "eval.urls=[http://127.0.0.1:2]"])
    assert shared.background_eval and shared.training_urls == ["http://127.0.0.1:1"]
    own = load_config(EXAMPLE, [*fleet, "eval.urls=[http://127.0.0.1:3]"])
    assert own.background_eval and own.training_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2/"]
    assert not load_config(EXAMPLE, fleet).background_eval  # no eval.urls: blocking, said in the first line
    refusals = {
        "which engine=remote does on servers of evaluation's own": ["eval.background=true"],
        "eval.urls takes every server of remote.urls": ["eval.urls=[http://127.0.0.1:1,http://127.0.0.1:2]"],
        "which mode=sync does not do": ["eval.urls=[http://127.0.0.1:3]", "mode=sync",
                                        "partial_rollout=off"],
        "which eval.background=false does not do": ["eval.urls=[http://127.0.0.1:3]", "eval.background=false"],
        r"eval.urls=\['h:3'\]: each entry one server's base URL": ["eval.urls=[h:3]"],
    }
    for message, overrides in refusals.items():
        with pytest.raises(ConfigError, match=message):
            load_config(EXAMPLE, [*fleet, *overrides])
    with pytest.raises(ConfigError, match="engine=torch evaluates beside training on a replica of its own"):
        load_config(EXAMPLE, ["mode=async", "eval.urls=[http://127.0.0.1:3]"])
    # asyncrl plan starts evaluation's own servers too, and says which serve training
    from asyncrl.plan.fleet import describe_fleet

    planned = describe_fleet(own, EXAMPLE, [], "asyncrl")
    assert [s.port for s in planned.servers] == [1, 2, 3]
    assert ("   evaluation beside training on http://127.0.0.1:3 (eval.urls; training uses http://127.0.0.1:1, "
            "http://127.0.0.1:2/)") in planned.steps


def _episode(versions: list[int], mask: list[int]) -> Episode:
    n = len(versions)
    return Episode("t", [Trajectory([1], [2] * n, mask, [0.0] * n, versions)])


def test_an_evaluation_with_a_token_of_another_version_fails_naming_the_versions():
    check_pinned([_episode([3, 3], [1, 1]), _episode([3, -1], [1, 0])], 3)  # a token it did not write: no version
    with pytest.raises(RuntimeError, match=r"evaluation of version 3 got tokens sampled at version\(s\) \[4\]"):
        check_pinned([_episode([3, 4], [1, 1])], 3)


def test_the_eval_servers_hold_the_version_evaluated_while_the_training_servers_move_on(tmp_path):
    """The factory's two clients: training on ``remote.urls``, evaluation on a server of its
    own at ``eval.urls``. An update of the training client never reaches the evaluation server, and
    the evaluation server samples the weights it was sent, at their version."""
    from asyncrl.engine.protocol import FullWeights
    from asyncrl.types import SamplingParams

    base = _policy("models/addition-tiny")
    moved = perturbed(base)

    async def main():
        async with Fleet(base, 2) as fleet:
            train_url, eval_url = fleet.urls
            cfg = load_config(EXAMPLE, ["engine=remote", f"remote.urls=[{train_url}]", "mode=async",
                                        f"eval.urls=[{eval_url}]", f"remote.weights_dir={tmp_path}"])
            built = await build_engine(cfg, EngineRequest(seed=0, version=0, eval_replica=True))
            try:
                assert [s.url for s in built.engine.servers] == [train_url]
                assert [s.url for s in built.eval_engine.servers] == [eval_url]
                await built.engine.update_weights(FullWeights(moved), 1)
                training, evaluating = (s.engine for s in fleet.servers)
                assert (training.version, evaluating.version) == (1, 0)  # the eval server still on version 0
                params = SamplingParams(max_tokens=4, temperature=0.0)
                on_base = await built.eval_engine.generate([3, 4, 5], params)
                await built.eval_engine.update_weights(FullWeights(moved), 1)
                on_moved = await built.eval_engine.generate([3, 4, 5], params)
                assert on_base.versions == [0] * 4 and on_moved.versions == [1] * 4
                assert evaluating.version == 1 and (tmp_path / "eval" / "v1").is_dir()  # beside the training files
                reference = copy.deepcopy(base)
                reference.load_state_dict(moved, strict=False)
                logits = reference(torch.tensor([[3, 4, 5, *on_moved.token_ids[:-1]]])).logits[0, 2:]
                want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(on_moved.token_ids)[:, None])[:, 0]
                assert on_moved.logprobs == pytest.approx(want.tolist(), abs=1e-4)
            finally:
                await built.engine.shutdown()
                await built.eval_engine.shutdown()

    asyncio.run(main())


def test_a_run_evaluates_beside_training_on_a_share_of_the_fleet_each_evaluation_on_its_own_version(tmp_path):
    """A short async run with ``eval.urls`` one of ``remote.urls``: every evaluation row names
    the version it scored, each evaluation sample's tokens are of that version, and the
    shared server left the training pool (it sampled evaluation's tokens and nothing else)."""
    from asyncrl.cli import main

    fleet = ThreadFleet(_policy("models/addition-tiny"), 2)
    try:
        train_url, eval_url = fleet.fleet.urls
        code = main(["train", EXAMPLE, f"output_dir={tmp_path}", "total_steps=2", "batch_size=2", "group_size=4",
                     "eval_every=1", "eval.num_tasks=4", "eval.samples_per_task=2", "engine=remote",
                     f"remote.urls=[{train_url},{eval_url}]", f"eval.urls=[{eval_url}]"])
        training, evaluating = (s.engine for s in fleet.fleet.servers)
        served = training.stats.tokens, evaluating.stats.tokens
    finally:
        fleet.close()
    assert code == 0
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval/reward_mean" in r]
    assert [r["step"] for r in rows] == [0, 1, 2]
    samples = read_jsonl(tmp_path / "eval_samples.jsonl")
    assert len(samples) == 3 * 4 * 2
    by_step = {r["step"]: r["eval/version"] for r in rows}
    assert by_step == {0: 0, 1: 1, 2: 2}  # async: each step's own version, not what training served then
    assert all(s["version"] == by_step[s["step"]] and {v for t in s["trajectories"] for v in t["versions"]}
               == {s["version"]} for s in samples)
    eval_tokens = sum(len(t["response_ids"]) for s in samples for t in s["trajectories"])
    assert served[1] == eval_tokens and served[0] > 0  # the eval server sampled evaluation's tokens, and only those
