"""The built-in engine: exact logprobs, continuous batching, weight updates, failures."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import make_model, reference_logprobs
from tolerances import assert_same_logprobs

from asyncrl.engine import EngineClosedError, TorchEngine
from asyncrl.types import SamplingParams

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]  # ragged: exercises left padding


async def wait_for_tokens(engine: TorchEngine, n: int) -> None:
    while engine.stats.tokens < n:
        await asyncio.sleep(0.001)


@pytest.mark.equivalence
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_equal_model_log_softmax(model, device, temperature):
    model = model.to(device)  # the device's kernels where there is a GPU (conftest's `device`)

    async def main():
        engine = TorchEngine(model, max_batch_size=8)
        # top-k/top-p change which tokens may be drawn, not the reported distribution
        sampling = SamplingParams(max_tokens=30, temperature=temperature, top_k=20, top_p=0.9)
        done = await asyncio.gather(*[engine.generate(p, sampling) for p in PROMPTS])
        await engine.shutdown()
        return done

    for prompt, completion in zip(PROMPTS, asyncio.run(main())):
        assert len(completion.token_ids) == 30 and completion.finish_reason == "length"
        ref = reference_logprobs(model, prompt, completion.token_ids, temperature)
        assert_same_logprobs(completion.logprobs, ref, model, len(prompt) + len(completion.token_ids))


def test_greedy_matches_argmax(model):
    async def main():
        engine = TorchEngine(model)
        c = await engine.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0))
        await engine.shutdown()
        return c

    c = asyncio.run(main())
    ids = PROMPTS[1] + c.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(PROMPTS[1]) - 1:-1]
    assert c.token_ids == logits.argmax(-1).tolist()


def test_short_request_submitted_later_finishes_first(model):
    async def main():
        engine = TorchEngine(model, max_batch_size=8)
        long = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=300)))
        await wait_for_tokens(engine, 5)  # the long one is decoding
        short = asyncio.create_task(engine.generate(PROMPTS[1], SamplingParams(max_tokens=5)))
        done, _ = await asyncio.wait({long, short}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {short}
        assert not long.done()  # it did not wait for the long one, nor the long one for it
        assert len((await long).token_ids) == 300
        await engine.shutdown()

    asyncio.run(main())


def test_stop_token_ends_sequence_and_is_kept(model):
    async def main():
        engine = TorchEngine(model)
        free = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0))
        stop = free.token_ids[10]
        stopped = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0,
                                                                   stop_token_ids=(stop,)))
        await engine.shutdown()
        return free, stopped, stop

    free, stopped, stop = asyncio.run(main())
    first = free.token_ids.index(stop)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first + 1]


def test_abort_returns_partial_tokens_and_update_changes_version(model):
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()
                   if k in dict(model.named_parameters())}

    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        task = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=300)))
        await wait_for_tokens(engine, 10)
        await engine.pause("abort")
        partial = await task
        await engine.update_weights(new_weights, version=1)
        await engine.resume()
        after = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5))
        await engine.shutdown()
        return partial, after, engine.version

    partial, after, version = asyncio.run(main())
    assert partial.finish_reason == "abort"
    assert 10 <= len(partial.token_ids) < 300
    assert set(partial.versions) == {0} and set(after.versions) == {1} and version == 1
    torch.testing.assert_close(model.state_dict()["model.norm.weight"], new_weights["model.norm.weight"])


def test_pause_keep_holds_sequences_and_continue_updates_in_flight(model):
    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        task = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=200)))
        await wait_for_tokens(engine, 10)
        await engine.pause("keep")
        held = engine.stats.tokens
        await asyncio.sleep(0.05)
        assert engine.stats.tokens == held and not task.done()
        weights = {k: v.clone() for k, v in model.named_parameters()}
        await engine.update_weights(weights, version=3)
        await engine.resume()
        completion = await task
        await engine.shutdown()
        return completion

    c = asyncio.run(main())
    assert c.finish_reason == "length" and len(c.token_ids) == 200
    switch = c.versions.index(3)
    assert 10 <= switch and c.versions == [0] * switch + [3] * (200 - switch)


def test_update_weights_rejects_unknown_names(model):
    async def main():
        engine = TorchEngine(model)
        try:
            with pytest.raises(KeyError, match="not.a.param"):
                await engine.update_weights({"not.a.param": torch.zeros(1)}, version=1)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_cancelled_request_leaves_and_others_finish(model):
    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        doomed = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=400)))
        other = asyncio.create_task(engine.generate(PROMPTS[1], SamplingParams(max_tokens=50)))
        await wait_for_tokens(engine, 6)
        doomed.cancel()
        assert len((await other).token_ids) == 50
        assert engine.num_in_flight == 0
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_fails_pending_requests(model):
    async def main():
        engine = TorchEngine(model)
        await engine.pause("keep")
        pending = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=5)))
        await asyncio.sleep(0.01)
        await engine.shutdown()
        with pytest.raises(EngineClosedError):
            await pending
        with pytest.raises(EngineClosedError):
            await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5))

    asyncio.run(main())


def test_engine_thread_failure_is_surfaced():
    model = make_model()

    def broken_forward(*args, **kwargs):
        raise RuntimeError("boom in forward")

    model.forward = broken_forward

    async def main():
        engine = TorchEngine(model)
        with pytest.raises(EngineClosedError) as info:
            await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5))
        assert "boom in forward" in str(info.value)
        await engine.shutdown()

    asyncio.run(main())


def test_many_concurrent_callers_all_served(model):
    async def main():
        engine = TorchEngine(model, max_batch_size=5)  # fewer slots than requests: queueing
        lengths = [3 + (i * 7) % 40 for i in range(23)]
        done = await asyncio.gather(*[engine.generate([4 + i % 50, 7], SamplingParams(max_tokens=n))
                                      for i, n in enumerate(lengths)])
        await engine.shutdown()
        return lengths, done

    lengths, done = asyncio.run(main())
    assert [len(c.token_ids) for c in done] == lengths
    assert all(len(c.logprobs) == len(c.versions) == len(c.token_ids) for c in done)


def test_pause_wait_drains_in_flight_on_old_weights(model):
    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        running = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=60)))
        await wait_for_tokens(engine, 5)
        pause = asyncio.create_task(engine.pause("wait"))
        await asyncio.sleep(0.01)
        queued = asyncio.create_task(engine.generate(PROMPTS[1], SamplingParams(max_tokens=5)))
        await pause  # returns only once the running sequence is done
        assert running.done() and not queued.done()
        await engine.update_weights({k: v.clone() for k, v in model.named_parameters()}, version=1)
        await engine.resume()
        done = await running, await queued
        await engine.shutdown()
        return done

    old, new = asyncio.run(main())
    assert old.finish_reason == "length" and set(old.versions) == {0}
    assert set(new.versions) == {1}


def test_a_seeded_request_samples_the_same_tokens_alone_batched_and_resumed(model):
    """With a per-request seed a sample depends on the weights, the prompt and the seed only:
    not on the engine's generator, the batch around it, nor an abort-and-resume."""
    seeded = SamplingParams(max_tokens=40, seed=1234)

    async def alone(seed_engine: int, sampling: SamplingParams = seeded):
        engine = TorchEngine(model, max_batch_size=8, seed=seed_engine)
        c = await engine.generate(PROMPTS[1], sampling)
        await engine.shutdown()
        return c

    async def batched():
        engine = TorchEngine(model, max_batch_size=8, seed=99)
        others = [engine.generate(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, (7, 50, 3), strict=True)]
        done = await asyncio.gather(engine.generate(PROMPTS[1], seeded), *others)
        await engine.shutdown()
        return done[0]

    async def resumed():
        engine = TorchEngine(model, max_batch_size=8, seed=5)
        task = asyncio.create_task(engine.generate(PROMPTS[1], seeded))
        await wait_for_tokens(engine, 12)
        await engine.pause("abort")
        partial = await task
        await engine.resume()
        rest = await engine.generate(PROMPTS[1] + partial.token_ids,
                                     SamplingParams(max_tokens=40 - len(partial.token_ids), seed=1234))
        await engine.shutdown()
        return partial.token_ids + rest.token_ids

    reference = asyncio.run(alone(0))
    assert asyncio.run(alone(7)).token_ids == reference.token_ids  # the engine's own seed plays no part
    assert asyncio.run(batched()).token_ids == reference.token_ids
    assert asyncio.run(resumed()) == reference.token_ids
    other = asyncio.run(alone(0, SamplingParams(max_tokens=40, seed=1235)))
    assert other.token_ids != reference.token_ids  # another seed, another sample


def test_a_call_whose_caller_gave_up_while_it_waited_is_not_run(model):
    """``call_between_steps`` from a caller that is cancelled while its call waits behind
    another (a served teacher's scoring whose client hung up) never runs on the engine's thread."""
    import threading

    release = threading.Event()
    ran: list[str] = []

    async def main():
        engine = TorchEngine(model, seed=0)
        try:
            first = asyncio.create_task(engine.call_between_steps(lambda: (release.wait(60), ran.append("first"))))
            await asyncio.sleep(0.05)  # the engine's thread is now inside the first call
            second = asyncio.create_task(engine.call_between_steps(lambda: ran.append("second")))
            await asyncio.sleep(0.05)
            second.cancel()
            release.set()
            await first
            with pytest.raises(asyncio.CancelledError):
                await second
            await engine.call_between_steps(lambda: ran.append("third"))  # the thread goes on serving
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert ran == ["first", "third"]
