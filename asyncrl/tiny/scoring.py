"""How the supervised warm-up scores its policy: through the project's own evaluation.

The numbers written to ``base_policy.json`` should mean what RL will later see, so they
are measured the way rollouts and ``asyncrl eval`` are: the built-in engine decodes, the
client renders the chat template, ``SingleTurnWorkflow`` scores with ``countdown_reward``
and ``evaluate`` aggregates. No second generation loop to drift from the engine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.config import RolloutConfig
from asyncrl.engine.factory import torch_engine
from asyncrl.rollout.eval_scoring import EvalResult, evaluate
from asyncrl.tasks import Task, countdown_reward
from asyncrl.types import Episode, SamplingParams
from asyncrl.rollout.workflows import SingleTurnWorkflow, run_episode

MAX_NEW_TOKENS = 24  # room to spare: canonical 3-number answers are at most 7 characters + EOS


async def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    *,
    temperature: float,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = 0,
    max_batch_size: int | None = None,
    timeout_s: float = 600.0,
) -> EvalResult:
    """One episode per task on a private ``TorchEngine`` (``temperature == 0``: greedy,
    token for token what ``model.generate`` answers).

    Sampled scores are reproducible for a ``seed`` only if every row of every step is
    fixed: so by default all tasks share one batch (``max_batch_size=None``; fine for the
    few hundred tasks of the warm-up), and the engine stays paused until every prompt is
    queued, making one prefill admit them all in task order. With a smaller batch,
    continuous batching lets thread timing decide which rows share a step's noise.
    The engine thread inherits the caller's torch thread count, and ``model``'s
    train/eval mode is restored (the engine switches it to eval). A failed episode
    raises here instead of scoring 0, which would read as a worse policy.
    """
    tasks = list(tasks)
    batch = max_batch_size or max(1, len(tasks))
    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                              stop_token_ids=stop_token_ids(tokenizer))
    workflow = SingleTurnWorkflow(countdown_reward, use_chat_template=True)
    was_training = model.training
    num_done = 0

    async def one(task: Task) -> Episode:
        return await run_episode(workflow, task, lambda: LLMClient(engine, tokenizer, sampling),
                                 timeout_s=timeout_s, max_retries=0)

    def count(_: Episode) -> None:
        nonlocal num_done
        num_done += 1

    async def start_when_queued() -> None:
        # Paused, nothing finishes in the engine: every runner has had its turn once each
        # one's request is in flight or its episode failed before reaching the engine.
        while engine.num_in_flight + num_done < min(batch, len(tasks)):
            await asyncio.sleep(0)
        await engine.resume()

    engine = torch_engine(model, RolloutConfig(max_batch_size=batch), seed=seed, num_threads=torch.get_num_threads())
    try:
        await engine.pause()
        async with asyncio.TaskGroup() as group:
            group.create_task(start_when_queued())
            result = await evaluate(one, tasks, samples_per_task=1, max_concurrent=batch, on_episode=count)
    finally:
        await engine.shutdown()
        model.train(was_training)
    failed = [e for e in result.episodes if e.status == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(result.episodes)} evaluation episodes failed; first:\n"
                           f"{failed[0].error}")
    return result


def greedy_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tasks: Sequence[Task],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Fraction of tasks whose greedy answer is exactly correct: pass@1 at temperature 0."""
    result = asyncio.run(evaluate_policy(model, tokenizer, tasks, temperature=0.0, max_new_tokens=max_new_tokens))
    return result.pass_at[1]


def mean_reward(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tasks: Sequence[Task], *,
    temperature: float = 1.0, seed: int = 0, max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Mean ``countdown_reward`` of one answer per task sampled at ``temperature``
    (no top-k/top-p: what an RL rollout at that temperature sees)."""
    result = asyncio.run(evaluate_policy(model, tokenizer, tasks, temperature=temperature, seed=seed,
                                         max_new_tokens=max_new_tokens))
    return result.mean_reward
