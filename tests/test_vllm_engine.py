"""VLLMEngine keeps the engine contract: exact logprobs, versions, pause modes, weight updates.

Needs vLLM (skipped without it). One engine serves the whole module, on one event loop,
because vLLM takes ~20 s to start; the tests that change weights keep ``h.model`` (the
Hugging Face reference) equal to what the engine holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

pytest.importorskip("vllm")

import torch
from conftest import reference_logprobs
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.engine import EngineClosedError
from asyncrl.engine.vllm_engine import VLLMEngine
from asyncrl.types import SamplingParams

T = TypeVar("T")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]


def make_vllm_model(seed: int = 0, *, tied: bool = True, vocab_size: int = 96) -> Qwen2ForCausalLM:
    """conftest's model has head_dim 16, which vLLM's CPU attention does not support (>= 32).
    ``vocab_size``: the char tokenizer's (261) where a run tokenizes text for it."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=128, max_position_embeddings=1024,
                         tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config).eval()


@dataclass
class Harness:
    engine: VLLMEngine
    loop: asyncio.AbstractEventLoop
    model: Qwen2ForCausalLM  # holds the weights the engine holds

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 120))

    async def wait_for_tokens(self, n: int) -> None:
        target = self.engine.stats.tokens + n
        while self.engine.stats.tokens < target:
            await asyncio.sleep(0.005)

    def perturbed(self, scale: float = 0.05) -> dict[str, torch.Tensor]:
        return {k: v.detach() + scale * torch.randn_like(v) for k, v in self.model.named_parameters()}

    def mirror(self, weights: dict[str, torch.Tensor]) -> None:
        """Apply an update the engine got to the reference model too."""
        self.model.load_state_dict(weights, strict=False)


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    model = make_vllm_model()
    path = tmp_path_factory.mktemp("vllm-model")
    model.save_pretrained(path)
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(VLLMEngine.start(path, max_batch_size=8, seed=0))
    harness = Harness(engine, loop, model)
    yield harness
    loop.run_until_complete(engine.shutdown())
    loop.close()


def assert_logprobs_match(model, prompt, completion, temperature):
    ref = reference_logprobs(model, prompt, completion.token_ids, temperature)
    torch.testing.assert_close(torch.tensor(completion.logprobs), ref, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_equal_model_log_softmax(h, temperature):
    async def main():
        sampling = SamplingParams(max_tokens=30, temperature=temperature)
        return await asyncio.gather(*[h.engine.generate(p, sampling) for p in PROMPTS])

    for prompt, completion in zip(PROMPTS, h.run(main())):
        assert len(completion.token_ids) == 30 and completion.finish_reason == "length"
        assert completion.versions == [h.engine.version] * 30
        assert_logprobs_match(h.model, prompt, completion, temperature)


def test_greedy_matches_argmax_with_raw_logprobs(h):
    c = h.run(h.engine.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0)))
    ids = PROMPTS[1] + c.token_ids
    with torch.no_grad():
        logits = h.model(torch.tensor([ids])).logits[0, len(PROMPTS[1]) - 1:-1]
    assert c.token_ids == logits.argmax(-1).tolist()
    assert_logprobs_match(h.model, PROMPTS[1], c, 1.0)


def test_stop_token_ends_sequence_and_is_kept(h):
    async def main():
        free = await h.engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0))
        stop = free.token_ids[10]
        stopped = await h.engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0,
                                                                     stop_token_ids=(stop,)))
        return free, stopped, stop

    free, stopped, stop = h.run(main())
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


def test_truncated_sampling_and_unknown_weights_are_refused(h):
    with pytest.raises(ValueError, match="top-k/top-p"):
        h.run(h.engine.generate(PROMPTS[0], SamplingParams(top_p=0.9)))
    with pytest.raises(KeyError, match="not.a.param"):
        h.run(h.engine.update_weights({"not.a.param": torch.zeros(1)}, version=99))
    assert h.engine.version == 0


def test_abort_returns_partial_tokens(h):
    async def main():
        tasks = [asyncio.create_task(h.engine.generate(p, SamplingParams(max_tokens=900))) for p in PROMPTS]
        await h.wait_for_tokens(10)
        await h.engine.pause("abort")
        partial = await asyncio.gather(*tasks)
        await h.engine.resume()
        return partial

    for prompt, c in zip(PROMPTS, h.run(main())):
        assert c.finish_reason == "abort"
        assert len(c.token_ids) < 900 and len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert set(c.versions) <= {0}
        assert_logprobs_match(h.model, prompt, c, 1.0)


def test_pause_keep_holds_sequences_until_resume(h):
    async def main():
        task = asyncio.create_task(h.engine.generate(PROMPTS[0], SamplingParams(max_tokens=150)))
        await h.wait_for_tokens(5)
        await h.engine.pause("keep")
        held, busy = h.engine.stats.tokens, h.engine.stats.busy_s
        await asyncio.sleep(0.3)
        assert h.engine.stats.tokens == held and not task.done()
        assert h.engine.stats.busy_s == busy  # a paused engine is not busy
        await h.engine.resume()
        return await task

    c = h.run(main())
    assert c.finish_reason == "length" and len(c.token_ids) == 150
    assert_logprobs_match(h.model, PROMPTS[0], c, 1.0)


def test_pause_wait_lets_in_flight_finish_and_holds_newcomers(h):
    async def main():
        running = asyncio.create_task(h.engine.generate(PROMPTS[1], SamplingParams(max_tokens=60)))
        await h.wait_for_tokens(3)
        await h.engine.pause("wait")
        assert running.done()
        late = asyncio.create_task(h.engine.generate(PROMPTS[0], SamplingParams(max_tokens=5)))
        await asyncio.sleep(0.3)
        assert not late.done()
        await h.engine.resume()
        return await running, await late

    running, late = h.run(main())
    assert running.finish_reason == "length" and len(running.token_ids) == 60
    assert late.finish_reason == "length" and len(late.token_ids) == 5


def test_update_weights_while_paused_changes_logprobs_and_version(h):
    new = h.perturbed()

    async def main():
        await h.engine.pause("abort")
        await h.engine.update_weights(new, version=1)
        await h.engine.resume()
        return await h.engine.generate(PROMPTS[2], SamplingParams(max_tokens=30))

    old_model = make_vllm_model()
    old_model.load_state_dict(h.model.state_dict())
    c = h.run(main())
    h.mirror(new)
    assert h.engine.version == 1 and c.versions == [1] * 30
    assert_logprobs_match(h.model, PROMPTS[2], c, 1.0)
    old = reference_logprobs(old_model, PROMPTS[2], c.token_ids)
    assert (torch.tensor(c.logprobs) - old).abs().max() > 1e-2  # the update did change the model


def test_update_weights_in_flight_switches_version_mid_sequence(h):
    new = h.perturbed()
    before = make_vllm_model()
    before.load_state_dict(h.model.state_dict())

    async def main():
        task = asyncio.create_task(h.engine.generate(PROMPTS[0], SamplingParams(max_tokens=120)))
        await h.wait_for_tokens(10)
        await h.engine.update_weights(new, version=2)  # no pause by the caller: pauses itself
        return await task

    c = h.run(main())
    h.mirror(new)
    switch = c.versions.index(2)
    assert c.finish_reason == "length" and 10 <= switch < 120
    assert c.versions == [1] * switch + [2] * (120 - switch)
    # tokens before the switch come from the old weights; after it from the new ones, on a
    # KV cache vLLM recomputed with them
    old_ref = reference_logprobs(before, PROMPTS[0], c.token_ids)
    new_ref = reference_logprobs(h.model, PROMPTS[0], c.token_ids)
    logprobs = torch.tensor(c.logprobs)
    torch.testing.assert_close(logprobs[:switch], old_ref[:switch], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(logprobs[switch:], new_ref[switch:], atol=2e-3, rtol=1e-3)


def test_cancelled_request_leaves_and_others_finish(h):
    async def main():
        doomed = asyncio.create_task(h.engine.generate(PROMPTS[0], SamplingParams(max_tokens=900)))
        other = asyncio.create_task(h.engine.generate(PROMPTS[1], SamplingParams(max_tokens=40)))
        await h.wait_for_tokens(6)
        doomed.cancel()
        assert len((await other).token_ids) == 40
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert h.engine.num_in_flight == 0

    h.run(main())


def test_many_concurrent_callers_all_served(h):
    async def main():
        lengths = [3 + (i * 7) % 40 for i in range(20)]  # more requests than max_batch_size=8
        done = await asyncio.gather(*[h.engine.generate([4 + i % 50, 7], SamplingParams(max_tokens=n))
                                      for i, n in enumerate(lengths)])
        return lengths, done

    lengths, done = h.run(main())
    assert [len(c.token_ids) for c in done] == lengths


def test_context_limit_ends_with_length(h):
    c = h.run(h.engine.generate(PROMPTS[0], SamplingParams(max_tokens=5000)))
    assert c.finish_reason == "length" and len(PROMPTS[0]) + len(c.token_ids) == 1024


def test_shutdown_refuses_new_requests(h):
    """Last in the module: it shuts the shared engine down (the fixture's shutdown is a no-op then)."""
    async def main():
        await h.engine.shutdown()
        with pytest.raises(EngineClosedError):
            await h.engine.generate(PROMPTS[0], SamplingParams(max_tokens=5))

    h.run(main())


def test_trainer_runs_async_with_the_vllm_engine(tmp_path):
    """``engine=vllm`` end to end: the shipped policy (head size 32), abort at each sync."""
    import json

    from asyncrl.cli import main

    out = tmp_path / "run"
    assert main(["train", "examples/countdown/async.yaml", "engine=vllm", f"output_dir={out}", "total_steps=4",
                 "batch_size=2", "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=1", "eval_every=0",
                 "task.num_train=64", "task.num_validation=8", "algorithm.filter_zero_variance=false"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 2 * 4
    assert max(s["trained_version"] - s["behavior_version_min"] for s in samples) <= 2
    assert (out / "checkpoints" / "step_4" / "model.safetensors").exists()


def test_an_sdk_agent_trains_with_the_vllm_engine(tmp_path):
    """``engine=vllm`` under the gateway: an OpenAI-SDK agent's two calls in one session,
    sampled by vLLM, recorded as one trajectory (the shipped policy, as above)."""
    import json

    from asyncrl.cli import main

    out = tmp_path / "agent"
    assert main(["train", "examples/openai_agent/train.yaml", "engine=vllm", f"output_dir={out}",
                 "workflow.agent=tests/agent_two_calls.py:run", "total_steps=2", "batch_size=2", "group_size=2",
                 "eval.num_tasks=2", "eval.samples_per_task=1", "task.num_train=16", "task.num_validation=4",
                 "algorithm.filter_zero_variance=false"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 2  # steps × groups × samples: one trajectory per episode
    for s in samples:  # the model, the agent's own user turn (mask 0), the model
        assert [seg["role"] for seg in s["response_segments"]] == ["model", "environment", "model"]
