"""What a run does with transformers prints no deprecation: a deprecation on every forward
pass (transformers 5.24's `past_key_values` → `cache`) broke the gateway's one-line logs and
names an API that a release within the range `pyproject.toml` allows will remove.

transformers announces a removal two ways: `warnings.warn(..., FutureWarning)`, which
pyproject's `filterwarnings` turns into an error in every test, and its logger's
`warning_once`, which no warning filter sees and which prints once per process (a test that
ran earlier would hide it). `heard()` takes both, the second with `warning_once`'s memory
cleared, and the workload below goes through every call of ours into transformers that a
run makes: loading the shipped policy, its chat template, the engine's prefill, group fork
and decode, the learner's step with and without shared prompts, and `model.generate` (the
baseline `asyncrl bench engine` compares against)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging
from transformers.utils.deprecation import deprecate_kwarg

from asyncrl.config import AlgorithmConfig, ModelConfig, OptimConfig
from asyncrl.engine import TorchEngine
from asyncrl.engine.hf_cache import CACHE_ARGUMENTS, cache_argument, forward_with_cache
from asyncrl.learner import Learner, pack_batch
from asyncrl.learner.shared_prompts import prompt_index
from asyncrl.policy import load_policy
from asyncrl.types import SamplingParams, Trajectory

ROOT = Path(__file__).resolve().parents[1]


class _Said(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"[{record.name}] {record.getMessage()}")


@contextlib.contextmanager
def heard() -> Iterator[list[str]]:
    """Every warning raised and every transformers log line at WARNING or above inside the
    block, one string each (filled in when the block ends)."""
    lines: list[str] = []
    logger = hf_logging.get_logger("transformers")
    level, handler = logger.level, _Said(lines)
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process memory
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # a TRANSFORMERS_VERBOSITY=error would otherwise hide them
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines.extend(f"{w.category.__name__} ({w.filename}:{w.lineno}): {w.message}" for w in caught)


def _batch(tokenizer) -> object:
    """Two groups sharing their prompts (so the learner takes the shared-prompt path)."""
    trajectories, advantages = [], []
    for g, prompt in enumerate(["Use 3 5 7 to make 15 with + - * /, one line: =", "Use 12 4 to make 3, one line: ="]):
        prompt_ids = tokenizer.encode(prompt)
        for i, answer in enumerate(["3+5+7", "15", "5*3"]):
            ids = tokenizer.encode(answer)
            trajectories.append(Trajectory(prompt_ids, ids, [1] * len(ids), [-1.5] * len(ids), [0] * len(ids)))
            advantages.append((-1) ** (g + i) * 0.5)
    return pack_batch(trajectories, advantages, tokenizer.pad_token_id)


def _workload() -> dict[str, object]:
    """Everything a run asks of transformers, on the shipped policy; returns what it made,
    so the test can check the work was done."""
    model, tokenizer = load_policy(ModelConfig(path=str(ROOT / "models" / "countdown-tiny"), device="cpu"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3 5 7 -> 15"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer.encode(prompt)

    async def rollouts():
        engine = TorchEngine(model, max_batch_size=8)
        try:  # the same prompt twice: one prefill, forked; a second prompt: a ragged batch
            return await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=6, seed=i))
                                          for i, p in enumerate([ids, ids, ids[:-3]])])
        finally:
            await engine.shutdown()

    completions = asyncio.run(rollouts())
    batch = _batch(tokenizer)
    steps = [Learner(model, tokenizer, algorithm=AlgorithmConfig(), optim=OptimConfig(lr=1e-3), total_steps=2,
                     temperature=1.0, share_prompts=share).train_step(batch) for share in (True, False)]
    with torch.no_grad():
        generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=4, min_new_tokens=4, do_sample=False)
    return {"completions": completions, "shared": prompt_index(batch) is not None, "steps": steps,
            "generated": generated.shape[1] - len(ids)}


def test_a_run_through_transformers_says_nothing():
    with heard() as said:
        made = _workload()
    assert said == [], "\n".join(said)
    assert [len(c.token_ids) for c in made["completions"]] == [6, 6, 6]
    assert made["shared"] and all(step["actor/grad_norm"] > 0 for step in made["steps"])
    assert made["generated"] == 4


def test_heard_catches_both_ways_transformers_warns_even_once_printed():
    logger = hf_logging.get_logger("transformers.models.qwen2")
    message = "`old` is deprecated and will be removed in version 9.0. Use `new` instead."
    logger.warning_once(message)  # printed once already in this process: heard() must still see it
    with heard() as said:
        logger.warning_once(message)
        warnings.warn("`other` is going away", FutureWarning, stacklevel=1)
    assert said[0] == f"[transformers.models.qwen2] {message}"
    assert said[1].startswith("FutureWarning (") and said[1].endswith("`other` is going away")
    assert len(said) == 2


@pytest.mark.skipif("cache" not in inspect.signature(Qwen2ForCausalLM.forward).parameters,
                    reason="this transformers has no `cache` argument: `past_key_values` is its only name")
def test_the_old_cache_name_is_heard_where_a_new_one_exists(model):
    """The failure the issue reported, caught by `heard()`: the old argument's warning and its
    log line, the log line again for the old output attribute."""
    ids = torch.tensor([[5, 6, 7]])
    with heard() as said, torch.no_grad():
        out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        assert out.past_key_values is not None
    assert any("FutureWarning" in line and "past_key_values" in line for line in said), said
    assert any(line.startswith("[transformers") and "deprecated" in line for line in said), said


def test_pyproject_turns_transformers_deprecations_into_errors():
    """The filter in [tool.pytest.ini_options] matches what transformers' own deprecation
    decorator says, on the installed version: every test fails on one, not only this file."""

    @deprecate_kwarg("old_name", version="99.0", new_name="new_name")
    def f(new_name: int = 0) -> int:
        return new_name

    assert f(new_name=3) == 3
    with pytest.raises(FutureWarning, match="old_name"):
        f(old_name=3)


def test_the_cache_goes_in_under_the_name_the_models_forward_declares():
    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None, use_cache=False):
            return cache, past_key_values, use_cache

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return past_key_values, use_cache

    class NoCache(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    cache = object()
    assert (cache_argument(New), cache_argument(Old)) == CACHE_ARGUMENTS
    assert forward_with_cache(New(), cache, input_ids=None) == (cache, None, True)
    assert forward_with_cache(Old(), cache, input_ids=None) == (cache, True)
    with pytest.raises(TypeError, match=r"NoCache\.forward takes no KV cache .*learner\.share_prompts=false"):
        forward_with_cache(NoCache(), cache, input_ids=None)


def test_the_forward_extends_the_cache_it_was_handed(model):
    """The invariant the call sites rely on instead of reading the cache back from the output."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        forward_with_cache(model, cache, input_ids=torch.tensor([[5, 6, 7]]))
        assert cache.get_seq_length() == 3
        out = forward_with_cache(model, cache, input_ids=torch.tensor([[8]]))
    assert cache.get_seq_length() == 4
    whole = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits[:, -1]
    torch.testing.assert_close(out.logits[:, -1], whole, atol=1e-5, rtol=1e-5)
