"""Group prefill: requests with the same prompt share one prefill (and a prefix cache keeps
it for later ones), invisibly: every fork samples exactly what a prefill of its own would
have, whatever happens to the other forks, and never from weights that have been replaced."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import make_model, reference_logprobs
from tolerances import assert_within, chain_terms, logprob_atol

from asyncrl.engine import TorchEngine
from asyncrl.types import Completion, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]]  # two groups, ragged: exercises left padding
N = 4
CHAIN = chain_terms(make_model().config, tokens=max(map(len, PROMPTS)) + 60)  # the longest request here
"""A fork's logprobs against an own prefill's (or a reference forward's): the same sums in
other batches, within ``logprob_atol`` of this chain (tests/tolerances.py)."""


def group_requests(max_tokens: int = 24, seeded: bool = True, **extra) -> list[tuple[list[int], SamplingParams]]:
    """N samples of each prompt, each with its own seed, as GRPO sends them."""
    return [(p, SamplingParams(max_tokens=max_tokens, seed=100 * g + i if seeded else None, **extra))
            for g, p in enumerate(PROMPTS) for i in range(N)]


async def submit_together(engine: TorchEngine, requests) -> list[asyncio.Task[Completion]]:
    """Queue every request while the engine is paused, so one step admits them all."""
    await engine.pause()
    tasks = [asyncio.create_task(engine.generate(p, s)) for p, s in requests]
    while engine.num_in_flight < len(tasks):  # each task has posted its request
        await asyncio.sleep(0)
    await engine.resume()
    return tasks


def run(model, requests, *, group_prefill: bool, seed: int = 0) -> tuple[list[Completion], TorchEngine]:
    async def main():
        engine = TorchEngine(model, max_batch_size=16, seed=seed, group_prefill=group_prefill)
        done = await asyncio.gather(*await submit_together(engine, requests))
        await engine.shutdown()
        return done, engine

    return asyncio.run(main())


def assert_same(got: Completion, want: Completion) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    want_logprobs = torch.tensor(want.logprobs)
    assert_within(torch.tensor(got.logprobs), want_logprobs, logprob_atol(want_logprobs, CHAIN), "logprobs")


async def wait_for_tokens(engine: TorchEngine, n: int) -> None:
    while engine.stats.tokens < n:
        await asyncio.sleep(0.001)


@pytest.mark.equivalence
@pytest.mark.parametrize("seeded", [True, False], ids=["own-seeds", "engine-generator"])
def test_forks_sample_what_separate_prefills_sample(model, device, seeded):
    model = model.to(device)  # the device's kernels where there is a GPU (conftest's `device`)
    requests = group_requests(seeded=seeded, top_k=40)
    forked, on = run(model, requests, group_prefill=True)
    separate, off = run(model, requests, group_prefill=False)
    for got, want in zip(forked, separate, strict=True):
        assert_same(got, want)
    assert (on.stats.prefill_rows, on.stats.prefill_reused) == (len(PROMPTS), len(requests) - len(PROMPTS))
    assert (off.stats.prefill_rows, off.stats.prefill_reused) == (len(requests), 0)
    assert on.stats.prefills == off.stats.prefills == 1
    for g, prompt in enumerate(PROMPTS):  # each fork drew its own sample ...
        samples = forked[g * N:(g + 1) * N]
        assert len({tuple(c.token_ids) for c in samples}) == N
        for c in samples:  # ... and reports the model's own logprobs
            reference = reference_logprobs(model, prompt, c.token_ids)
            assert_within(torch.tensor(c.logprobs), reference, logprob_atol(reference, CHAIN), "logprobs")


@pytest.mark.equivalence
def test_a_fork_finishing_early_leaves_the_others_as_they_were(model):
    free = run(model, group_requests(), group_prefill=False)[0]
    requests = group_requests()
    requests[1] = (PROMPTS[0], SamplingParams(max_tokens=2, seed=1))  # ends after two steps
    stop = free[2].token_ids[5]  # ends on its sixth token (or sooner)
    requests[2] = (PROMPTS[0], SamplingParams(max_tokens=24, seed=2, stop_token_ids=(stop,)))
    forked = run(model, requests, group_prefill=True)[0]
    reference = run(model, requests, group_prefill=False)[0]
    assert forked[1].finish_reason == "length" and len(forked[1].token_ids) == 2
    assert forked[2].finish_reason == "stop" and len(forked[2].token_ids) <= 6
    for got, want in zip(forked, reference, strict=True):
        assert_same(got, want)
    for i in (0, 3):  # the forks that ran to the end: as without their finished siblings
        assert_same(forked[i], free[i])


@pytest.mark.equivalence
def test_a_cancelled_fork_leaves_the_others_as_they_were(model):
    requests = group_requests(max_tokens=60)
    reference = run(model, requests, group_prefill=False)[0]

    async def main():
        engine = TorchEngine(model, max_batch_size=16)
        tasks = await submit_together(engine, requests)
        await wait_for_tokens(engine, 5 * len(requests))
        tasks[1].cancel()  # one fork of the first group leaves mid-decode
        done = await asyncio.gather(*tasks, return_exceptions=True)
        await engine.shutdown()
        return done, engine

    done, engine = asyncio.run(main())
    assert isinstance(done[1], asyncio.CancelledError)
    assert engine.stats.prefill_rows == len(PROMPTS) and engine.num_in_flight == 0
    for i, (got, want) in enumerate(zip(done, reference, strict=True)):
        if i != 1:
            assert_same(got, want)


@pytest.mark.equivalence
def test_aborted_forks_resume_to_the_uninterrupted_samples(model):
    requests = group_requests(max_tokens=40)
    reference = run(model, requests, group_prefill=False)[0]

    async def main():
        engine = TorchEngine(model, max_batch_size=16)
        tasks = await submit_together(engine, requests)
        await wait_for_tokens(engine, 6 * len(requests))
        await engine.pause("abort")
        partial = await asyncio.gather(*tasks)
        await engine.resume()
        rest = await asyncio.gather(*[  # what the client does: prompt + partial tokens, the remaining budget
            engine.generate(p + c.token_ids, SamplingParams(max_tokens=40 - len(c.token_ids), seed=s.seed))
            for (p, s), c in zip(requests, partial, strict=True)])
        await engine.shutdown()
        return partial, rest

    partial, rest = asyncio.run(main())
    assert {c.finish_reason for c in partial} == {"abort"}
    for a, b, want in zip(partial, rest, reference, strict=True):
        assert a.token_ids + b.token_ids == want.token_ids
        want_logprobs = torch.tensor(want.logprobs)
        assert_within(torch.tensor(a.logprobs + b.logprobs), want_logprobs, logprob_atol(want_logprobs, CHAIN),
                      "logprobs")


@pytest.mark.equivalence
def test_one_prefill_per_group_and_later_requests_reuse_it(model):
    group = [(PROMPTS[0], SamplingParams(max_tokens=16, seed=i)) for i in range(8)]
    late = (PROMPTS[0], SamplingParams(max_tokens=16, seed=8))  # a sample of the group admitted later
    newcomer = ([20, 21], SamplingParams(max_tokens=16, seed=9))  # another prompt, admitted with it
    alone = {}
    for key, (p, s) in {"late": late, "newcomer": newcomer}.items():
        alone[key] = run(model, [(p, s)], group_prefill=False)[0][0]

    async def main():
        engine = TorchEngine(model, max_batch_size=16)
        first = await asyncio.gather(*await submit_together(engine, group))
        counts = [(engine.stats.prefills, engine.stats.prefill_rows, engine.stats.prefill_reused)]
        later = await asyncio.gather(*await submit_together(engine, [late, newcomer]))
        counts.append((engine.stats.prefills, engine.stats.prefill_rows, engine.stats.prefill_reused))
        await engine.shutdown()
        return first, later, counts

    first, later, counts = asyncio.run(main())
    assert counts[0] == (1, 1, 7)  # one prefill step, one prompt through the model, seven forks
    assert counts[1] == (2, 2, 8)  # the late sample forked the cached prefill; only the newcomer ran
    assert len({tuple(c.token_ids) for c in first}) == 8
    assert_same(later[0], alone["late"])
    assert_same(later[1], alone["newcomer"])


def test_prefix_cache_is_bounded():
    model = make_model()

    async def main():
        engine = TorchEngine(model, max_batch_size=4, prefix_cache_size=1)
        for prompt in (PROMPTS[0], PROMPTS[1], PROMPTS[0]):  # the second evicts the first
            await engine.generate(prompt, SamplingParams(max_tokens=2, seed=0))
        await engine.shutdown()
        return engine.stats

    stats = asyncio.run(main())
    assert (stats.prefill_rows, stats.prefill_reused) == (3, 0)


@pytest.mark.equivalence
def test_a_weight_update_invalidates_cached_prefills(model):
    torch.manual_seed(1)
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in model.named_parameters()}
    updated = make_model()
    updated.load_state_dict(new_weights, strict=False)
    request = (PROMPTS[0], SamplingParams(max_tokens=16, seed=7))
    want = run(updated, [request], group_prefill=False)[0][0]

    async def main():
        engine = TorchEngine(model, max_batch_size=16)
        old = await asyncio.gather(*await submit_together(engine, group_requests(max_tokens=16)))
        rows = engine.stats.prefill_rows
        await engine.update_weights(new_weights, version=1)
        got = await engine.generate(*request)  # its prompt's prefill, on the old weights, is cached
        await engine.shutdown()
        return old, got, rows, engine.stats

    old, got, rows, stats = asyncio.run(main())
    assert stats.prefill_rows == rows + 1 and stats.prefill_reused == len(old) - len(PROMPTS)
    assert set(got.versions) == {1}
    assert_same(got, want)  # first token included: sampled from the new weights' logits
    stale = reference_logprobs(make_model(), PROMPTS[0], got.token_ids)
    assert abs(stale[0].item() - got.logprobs[0]) > 1e-3  # the old prefill would have been told apart


@pytest.mark.equivalence
def test_a_weight_update_mid_decode_then_a_new_fork_uses_the_new_weights(model):
    new_weights = {k: v.clone() * 1.02 for k, v in model.named_parameters()}
    updated = make_model()
    updated.load_state_dict(new_weights, strict=False)
    request = (PROMPTS[1], SamplingParams(max_tokens=8, seed=3))
    want = run(updated, [request], group_prefill=False)[0][0]

    async def main():
        engine = TorchEngine(model, max_batch_size=16)
        tasks = await submit_together(engine, group_requests(max_tokens=200))
        await wait_for_tokens(engine, 3 * len(tasks))
        await engine.pause("keep")  # the group's forks hold their KV rows across the update
        await engine.update_weights(new_weights, version=1)
        await engine.resume()
        got = await engine.generate(*request)
        running = await asyncio.gather(*tasks)
        await engine.shutdown()
        return got, running

    got, running = asyncio.run(main())
    assert_same(got, want)
    for c in running:
        assert len(c.token_ids) == 200 and c.versions[0] == 0 and c.versions[-1] == 1


@pytest.mark.equivalence
def test_a_training_run_samples_the_same_with_and_without_group_prefill(tmp_path, monkeypatch):
    """Through the whole trainer (``rollout.group_prefill``): every group's samples share a
    prompt, and each sample is seeded on its own, so the fork changes nothing they write."""
    import json
    from pathlib import Path

    from asyncrl.cli import main as cli

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    runs = {}
    for on in (True, False):
        out = tmp_path / f"prefill-{on}"
        assert cli(["train", "examples/addition/sync.yaml", f"output_dir={out}", "total_steps=3", "batch_size=4",
                    "group_size=8", "eval_every=0", "eval.num_tasks=4", "eval.samples_per_task=1",
                    f"rollout.group_prefill={str(on).lower()}"]) == 0
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        runs[on] = [(r["step"], r["task_id"], r["episode"], r["response"], r["reward"]) for r in rows]
    assert len(runs[True]) == 3 * 4 * 8 and len({r[3] for r in runs[True]}) > 1
    assert runs[True] == runs[False]
