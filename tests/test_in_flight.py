"""Episodes under way survive a restart: the client journals what it generates, a
checkpoint keeps the journals, and a resumed episode replays them — finished replies
without the engine, a cut-off one continued from its partial tokens to the very tokens
the uninterrupted run samples — then goes on. A real ``kill -9`` of a training run, then
``resume=true``: the episodes in flight continue, within η, none trained twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import pytest
from conftest import SpyEngine
from test_resume import read_jsonl_safe, run_args

from asyncrl.rollout.client import LLMClient
from asyncrl.config import load_config
from asyncrl.engine import TorchEngine
from asyncrl.rollout.journal import EpisodeKey, Journal
from asyncrl.orchestrator.checkpoint import IN_FLIGHT_FILE, RunState, latest_checkpoint
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.tasks.countdown import iter_countdown
from asyncrl.types import SamplingParams

SAMPLING = SamplingParams(max_tokens=24, temperature=1.0, seed=1234)
KEY = EpisodeKey("t", 0, 0, 1)


def generate(model, tokenizer, journal: Journal | None, prompt: str = "3 5 7 -> 22"):
    """One ``generate`` through a client with ``journal``; the completion and every call
    the engine served."""
    async def main():
        spy = SpyEngine(TorchEngine(model, max_batch_size=4, seed=1))
        try:
            llm = LLMClient(spy, tokenizer, SAMPLING)
            llm.journal = journal
            response = await llm.generate(prompt)
            return response, spy.calls, llm.trajectories[0]
        finally:
            await spy.engine.shutdown()

    return asyncio.run(main())


def test_a_journal_records_and_replays_finished_cut_off_and_divergent_calls(tiny_policy):
    model, tokenizer = tiny_policy
    recorded = Journal(KEY)
    full, calls, trajectory = generate(model, tokenizer, recorded)
    assert len(calls) == 1 and len(full.token_ids) > 8
    (segment,) = recorded.segments
    assert segment.token_ids == full.token_ids and segment.finish_reason == full.finish_reason
    assert recorded.tokens == len(full.token_ids) and recorded.parked

    # finished: the recorded reply, versions and logprobs, no engine call
    replayed = Journal.for_replay(json.loads(json.dumps(recorded.to_dict())))
    again, calls, again_trajectory = generate(model, tokenizer, replayed)
    assert calls == [] and again.token_ids == full.token_ids and again.logprobs == full.logprobs
    assert again_trajectory.versions == trajectory.versions and replayed.replayed_tokens == len(full.token_ids)

    # cut off after 5 tokens (as a checkpoint finds it): continued from there, to the same tokens
    cut = recorded.to_dict()
    seg = cut["segments"][0]
    seg.update(token_ids=seg["token_ids"][:5], logprobs=seg["logprobs"][:5], versions=seg["versions"][:5],
               finish_reason=None)
    continued_journal = Journal.for_replay(cut)
    continued, calls, _ = generate(model, tokenizer, continued_journal)
    assert len(calls) == 1 and calls[0][0] == segment.context + full.token_ids[:5]  # prompt + the partial tokens
    assert continued.token_ids == full.token_ids  # seeded per position: what the uninterrupted call sampled
    assert continued.logprobs[:5] == full.logprobs[:5]  # the recorded ones kept as they were
    assert max(abs(a - b) for a, b in zip(continued.logprobs, full.logprobs)) < 1e-4
    assert continued_journal.replayed_tokens == 5 and not continued_journal.diverged

    # another context: the replay ends there and the call samples afresh
    other = Journal.for_replay(recorded.to_dict())
    _, calls, _ = generate(model, tokenizer, other, prompt="9 9 -> 81")
    assert len(calls) == 1 and other.diverged and other.replayed_tokens == 0 and other.replay == []


def test_reading_the_journals_mid_generation_changes_no_token(policy_dir):
    """``in_flight`` aborts the running sequences to read their tokens; the clients resume
    them at once, and the episodes end with the tokens they would have had untouched."""
    cfg = load_config(None, [f"model.path={policy_dir}", "sampling.max_tokens=300", "rollout.max_batch_size=4"])
    task = next(iter_countdown(seed=5))

    async def run(read_midway: bool):
        worker = RolloutWorker(cfg, seed=0)
        await worker.start()
        try:
            group = asyncio.ensure_future(worker.run_group(task, 4))
            snapshots = []
            if read_midway:
                while worker.engine is None or worker.engine.stats.tokens < 4 * 8:  # some tokens each, none back
                    await asyncio.sleep(0.001)
                snapshots.append(await worker.in_flight())
            episodes = await group
            return [t.response_ids for e in episodes for t in e.trajectories], snapshots, worker.journals
        finally:
            await worker.shutdown()

    untouched, _, _ = asyncio.run(run(False))
    read, (snapshot,), left = asyncio.run(run(True))
    assert read == untouched
    assert {(j["key"]["task_id"], j["key"]["sample"]) for j in snapshot} == {(task.id, i) for i in range(4)}
    cut = [j["segments"][0] for j in snapshot if j["segments"][0]["finish_reason"] is None]
    assert cut and all(s["token_ids"] for s in cut)  # aborted mid-reply: the tokens so far are in the journal
    for j in snapshot:  # each a prefix of the reply its episode ends with
        tokens, (segment,) = untouched[j["key"]["sample"]], j["segments"]
        assert tokens[:len(segment["token_ids"])] == segment["token_ids"]
    assert left == {}  # finished episodes keep no journal


@pytest.mark.slow
def test_kill_9_then_resume_continues_the_episodes_in_flight(tmp_path, policy_dir):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(__file__)}
    proc = subprocess.Popen(run_args(policy_dir, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:  # kill once step 4 is logged (step_3 is saved)
        metrics_file = out / "metrics.jsonl"
        if metrics_file.exists() and any(r.get("step") == 4 for r in read_jsonl_safe(metrics_file)):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    checkpoint = latest_checkpoint(out / "checkpoints")
    assert checkpoint is not None
    state = RunState.from_json((checkpoint / "run_state.json").read_text())
    journals = [json.loads(line) for line in (checkpoint / IN_FLIGHT_FILE).read_text().splitlines()]
    kept = sum(len(s["token_ids"]) for j in journals for s in j["segments"])
    assert journals and kept > 0, "episodes should be under way at the checkpoint (slow reward, η = 3)"
    reissued = {(d.index, d.epoch) for d in state.reissue}
    assert len({(j["key"]["task_id"], j["key"]["draw"]) for j in journals}) <= len(reissued)

    resumed = subprocess.run([*run_args(policy_dir, out), "resume=true"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continue from the {kept:,} tokens they had generated" in resumed.stderr
    metrics = read_jsonl_safe(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(11))  # no step logged twice
    assert metrics[-1]["rollout/replayed_tokens_total"] == kept
    assert metrics[-1]["rollout/replay_diverged_total"] == 0
    samples = read_jsonl_safe(out / "samples.jsonl")
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 3


@pytest.mark.equivalence
def test_a_resumed_sync_run_replays_its_episodes_and_equals_the_uninterrupted_one(tmp_path, policy_dir):
    """Stopped at step 2 and resumed with the groups of step 3 under way: whatever the
    checkpoint found under way is replayed, and every group it found finished is turned
    into one under way whose journals hold its episodes' replies (as a checkpoint taken a
    moment earlier would have), so the resume always replays. The run equals the
    uninterrupted one: the same samples, weights within float noise."""
    from test_reproducible import METRIC_KEYS, WEIGHT_ATOL, run, same_run

    from asyncrl.rollout.workflows.registry import build_tasks

    sync = ["mode=sync", "partial_rollout=off"]
    whole = run(tmp_path, policy_dir, "whole", *sync)
    run(tmp_path, policy_dir, "parts", *sync, "total_steps=2")
    checkpoint = tmp_path / "parts" / "checkpoints" / "step_2"
    state = json.loads((checkpoint / "run_state.json").read_text())
    journals = [json.loads(line) for line in (checkpoint / IN_FLIGHT_FILE).read_text().splitlines()]
    cfg = load_config("examples/countdown/async.yaml", ["task.num_train=64", "task.num_validation=8"])
    index = {t.id: i for i, t in enumerate(build_tasks(cfg).train)}
    for g in state.pop("buffered"):
        group = g["group"]
        state["reissue"].append({"index": index[group["task_id"]], "epoch": 0, "order": g["start_order"]})
        state["counters"]["groups_accepted"] -= 1  # not finished, so not counted yet
        for sample, episode in enumerate(group["episodes"]):
            (t,) = episode["trajectories"]
            journals.append({"key": {"task_id": group["task_id"], "draw": 0, "sample": sample, "attempt": 1},
                             "segments": [{"context": t["prompt_ids"], "token_ids": t["response_ids"],
                                           "logprobs": t["logprobs"], "versions": t["versions"],
                                           "finish_reason": t["finish_reason"], "num_resumes": t["num_resumes"]}]})
    (checkpoint / "run_state.json").write_text(json.dumps({**state, "buffered": []}))
    (checkpoint / IN_FLIGHT_FILE).write_text("".join(json.dumps(j) + "\n" for j in journals))
    kept = sum(len(seg["token_ids"]) for j in journals for seg in j["segments"])
    assert kept > 0
    resumed = run(tmp_path, policy_dir, "parts", *sync, "resume=true")
    assert resumed[1][-1]["rollout/replayed_tokens_total"] == kept
    since_last_step = ("rollout/reward_mean", "rollout/episodes")
    assert same_run(whole, resumed, [k for k in METRIC_KEYS if k not in since_last_step]) <= WEIGHT_ATOL
