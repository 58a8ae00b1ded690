"""The built-in engine's static decode path (``static_kv.py``, ``step_capture.py``) keeps the
engine's promises: the same tokens as the dynamic cache for seeded requests, logprobs equal to
the learner's, pauses and per-token versions, and weight updates copied into the parameters a
captured step reads. The CUDA-graph tests need a GPU (``cuda`` marker, skipped without one)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from conftest import make_model, reference_logprobs
from tolerances import assert_same_logprobs

from asyncrl.engine import TorchEngine
from asyncrl.engine.static_kv import bucket
from asyncrl.types import SamplingParams

RNG = random.Random(0)
# ragged prompts, short and long answers, more requests than rows: rows join (a longer prompt
# moves the running rows right), leave (the kept rows compact) and outgrow the first buffers
REQUESTS = [([RNG.randrange(4, 90) for _ in range(RNG.randint(1, 30))], RNG.choice([3, 8, 20, 120]))
            for _ in range(16)]


def run(model, requests, bucketed: bool = False, **engine_kwargs):
    async def main():
        engine = TorchEngine(model, max_batch_size=5, **engine_kwargs)
        if bucketed:  # the padded shapes a captured step replays, run eagerly: checkable on the CPU
            engine._decoder.kv.bucketed = True
        done = await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=n, seed=i))
                                      for i, (p, n) in enumerate(requests)])
        await engine.shutdown()
        return done

    return asyncio.run(main())


def test_bucket_is_the_next_power_of_two_within_the_cap():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert bucket(40, 48) == 48


def test_the_engine_names_its_decode_path(model):
    async def main():
        static, dynamic = TorchEngine(model, kv_cache="static"), TorchEngine(model, kv_cache="dynamic")
        names = (static.kv_cache, static.capture, dynamic.kv_cache, dynamic.capture, static.max_context)
        await static.shutdown()
        await dynamic.shutdown()
        return names

    assert asyncio.run(main()) == ("static", "off", "dynamic", "off", 512)


def test_cuda_graphs_are_refused_off_cuda(model):
    if torch.cuda.is_available():
        model = model.to("cpu")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        TorchEngine(model, kv_cache="static", capture="graphs")
    with pytest.raises(ValueError, match="needs the static KV cache"):
        TorchEngine(model, kv_cache="dynamic", capture="compile")


def test_a_model_the_static_path_cannot_serve_is_named():
    model = make_model()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation 'flash_attention_2'.*kv_cache='dynamic'"):
        TorchEngine(model, kv_cache="static")


@pytest.mark.equivalence
@pytest.mark.parametrize("bucketed", [False, True])
def test_static_decodes_the_dynamic_caches_tokens_and_the_learners_logprobs(model, bucketed):
    """Seeded requests sample the same tokens whatever the cache (a token depends on the
    weights, the prompt and the seed only), and each logprob is the learner's."""
    dynamic = run(model, REQUESTS, kv_cache="dynamic")
    static = run(model, REQUESTS, bucketed=bucketed, kv_cache="static")
    assert [c.token_ids for c in static] == [c.token_ids for c in dynamic]
    for (prompt, _), completion in zip(REQUESTS, static):
        ref = reference_logprobs(model, prompt, completion.token_ids)
        assert_same_logprobs(completion.logprobs, ref, model, len(prompt) + len(completion.token_ids))


def test_update_weights_copies_into_the_parameters_and_the_next_token_uses_them(model):
    """A captured step reads the parameters at their addresses: an update must write into
    them (never rebind them), and the very next token must come from the new weights."""
    new_model = make_model(seed=1)
    new_weights = {name: p.detach().clone() for name, p in new_model.named_parameters()}
    prompt = [5, 6, 7, 8]

    async def main():
        engine = TorchEngine(model, max_batch_size=4, kv_cache="static")
        addresses = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_tokens=60, temperature=0)))
        while engine.stats.tokens < 5:
            await asyncio.sleep(0.001)
        await engine.pause("keep")
        await engine.update_weights(new_weights, version=1)
        await engine.resume()
        held = await task
        after = await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
        await engine.shutdown()
        return addresses, {name: p.data_ptr() for name, p in engine.model.named_parameters()}, held, after

    before, now, held, after = asyncio.run(main())
    assert now == before
    switch = held.versions.index(1)
    assert held.versions == [0] * switch + [1] * (60 - switch)
    # the first token after the update is the new model's greedy choice over the same context
    context = prompt + held.token_ids[:switch]
    with torch.no_grad():
        assert held.token_ids[switch] == int(new_model(torch.tensor([context])).logits[0, -1].argmax())
        expected = new_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert after.token_ids == expected[0, len(prompt):].tolist()


def test_an_aborted_seeded_request_resumes_to_the_uninterrupted_sample_on_the_static_path(model):
    """pause("abort") ends the rows with their partial tokens and drops the batch (the buffers
    stay); resumed as prompt + partial with the same seed, it samples what it would have."""
    prompt, seeded = REQUESTS[1][0], SamplingParams(max_tokens=40, seed=1234)

    async def main():
        engine = TorchEngine(model, max_batch_size=4, kv_cache="static")
        whole = await engine.generate(prompt, seeded)
        task = asyncio.create_task(engine.generate(prompt, seeded))
        others = [asyncio.create_task(engine.generate(p, SamplingParams(max_tokens=n))) for p, n in REQUESTS[:2]]
        while engine.stats.tokens < len(whole.token_ids) + 12:
            await asyncio.sleep(0.001)
        assert await engine.pause("abort") >= 1
        partial = await task
        await engine.resume()
        rest = await engine.generate(prompt + partial.token_ids,
                                     SamplingParams(max_tokens=40 - len(partial.token_ids), seed=1234))
        await asyncio.gather(*others)
        await engine.shutdown()
        return whole, partial, rest

    whole, partial, rest = asyncio.run(main())
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 40
    assert partial.token_ids + rest.token_ids == whole.token_ids


def test_group_prefill_and_the_prefix_cache_on_the_static_path(model):
    """A group's samples share one prefill and a later sample of it forks the cached rows;
    the tokens are those of separate prefills on the dynamic cache."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    group = [(prompt, i) for i in range(6)]

    def sample(kv_cache: str, group_prefill: bool):
        async def main():
            engine = TorchEngine(model, max_batch_size=8, kv_cache=kv_cache, group_prefill=group_prefill)
            await engine.pause()  # queue the group together: one prefill step admits it all
            tasks = [asyncio.create_task(engine.generate(p, SamplingParams(max_tokens=20, seed=i))) for p, i in group]
            while engine.num_in_flight < len(tasks):
                await asyncio.sleep(0)
            await engine.resume()
            while engine.stats.tokens < 3 * len(tasks):
                await asyncio.sleep(0.001)
            late = await engine.generate(prompt, SamplingParams(max_tokens=20, seed=99))  # admitted later
            done = await asyncio.gather(*tasks)
            await engine.shutdown()
            return [c.token_ids for c in done] + [late.token_ids], engine.stats

        return asyncio.run(main())

    static, stats = sample("static", group_prefill=True)
    separate, _ = sample("dynamic", group_prefill=False)
    assert static == separate
    assert (stats.prefill_rows, stats.prefill_reused) == (1, len(group))


def test_lora_adapters_load_into_the_static_engines_parameters(model):
    """An AdapterUpdate is merged and copied into the parameters in place: the same
    addresses, and the tokens of a dynamic-cache engine given the same adapters."""
    from asyncrl.engine.protocol import AdapterUpdate, LayerAdapter

    torch.manual_seed(3)
    name = "model.layers.0.self_attn.q_proj.weight"
    out_features, in_features = dict(model.named_parameters())[name].shape
    update = AdapterUpdate({name: LayerAdapter(torch.randn(4, in_features), torch.randn(out_features, 4), 0.5)},
                           rank=4, alpha=2.0)

    def sample(kv_cache: str):
        engine_model = make_model()

        async def main():
            engine = TorchEngine(engine_model, max_batch_size=4, kv_cache=kv_cache)
            address = dict(engine.model.named_parameters())[name].data_ptr()
            await engine.update_weights(update, version=1)
            assert dict(engine.model.named_parameters())[name].data_ptr() == address
            done = await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=16, seed=i))
                                          for i, (p, _) in enumerate(REQUESTS[:4])])
            await engine.shutdown()
            return [c.token_ids for c in done]

        return asyncio.run(main())

    assert sample("static") == sample("dynamic")


@pytest.mark.slow
@pytest.mark.equivalence
def test_a_compiled_step_decodes_the_eager_steps_tokens(model):
    """``capture="compile"`` (torch.compile, bucketed shapes) on the CPU: the same tokens.
    Two short requests: each new bucket compiles anew, and compiling is minutes on two cores."""
    requests = [([5, 6, 7], 6), ([9, 10, 11, 12, 13], 10)]
    eager = run(model, requests, kv_cache="static")
    compiled = run(model, requests, kv_cache="static", capture="compile")
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]


# ------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.equivalence
def test_captured_engine_matches_the_learner_on_cuda():
    model = make_model().to("cuda")
    graphs = run(model, REQUESTS, kv_cache="static", capture="graphs")
    eager = run(model, REQUESTS, kv_cache="dynamic")
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager]
    for (prompt, _), completion in zip(REQUESTS, graphs):
        ref = reference_logprobs(model, prompt, completion.token_ids)
        assert_same_logprobs(completion.logprobs, ref, model, len(prompt) + len(completion.token_ids))


@pytest.mark.cuda
def test_a_weight_update_reaches_the_captured_graphs():
    model, new_model = make_model().to("cuda"), make_model(seed=1).to("cuda")
    prompt = [5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=12, temperature=0)

    async def main():
        engine = TorchEngine(model, max_batch_size=4, kv_cache="static", capture="graphs")
        await engine.generate(prompt, greedy)  # captures the buckets this prompt uses
        assert engine.capture == "graphs"
        await engine.update_weights({n: p.detach().clone() for n, p in new_model.named_parameters()}, version=1)
        after = await engine.generate(prompt, greedy)
        await engine.shutdown()
        return after

    after = asyncio.run(main())
    with torch.no_grad():
        expected = new_model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
    assert after.token_ids == expected[0, len(prompt):].tolist() and set(after.versions) == {1}
