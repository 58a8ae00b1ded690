"""A rollout worker: one engine replica and the workflows that drive it.

For ``runtime: local`` the trainer holds one in its own process; for ``runtime: ray``
each is the body of a Ray actor (``ray_runtime.py``). Either way the orchestrator asks
it for whole groups, evaluations and weight updates; the staleness gate stays with the
orchestrator and every token's version is stamped by the engine inside the worker.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.client import LLMClient, stop_token_ids
from asyncrl.config import Config
from asyncrl.engine import TorchEngine
from asyncrl.evaluation import EvalResult, evaluate
from asyncrl.policy import load_policy
from asyncrl.tasks.base import Task
from asyncrl.types import Episode, SamplingParams
from asyncrl.workflows.base import run_episode
from asyncrl.workflows.registry import build_workflow


class RolloutWorker:
    def __init__(self, cfg: Config, *, model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, weights: Mapping[str, torch.Tensor] | None = None,
                 version: int = 0, seed: int = 0, num_threads: int | None = None) -> None:
        """``model``/``tokenizer`` given: use them (in-process). Otherwise load ``model.path``
        here, in the worker's own process, and apply ``weights`` (the latest published)."""
        if model is None or tokenizer is None:
            model, tokenizer = load_policy(cfg.model)
        if weights is not None:
            model.load_state_dict(dict(weights), strict=False)  # tied weights appear once in the export
        self.cfg, self.tokenizer = cfg, tokenizer
        self.workflow = build_workflow(cfg)
        s = cfg.sampling
        self.sampling = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                       top_k=s.top_k, stop_token_ids=stop_token_ids(tokenizer))
        self.engine = TorchEngine(model.eval(), max_batch_size=cfg.rollout.max_batch_size, seed=seed,
                                  version=version, num_threads=num_threads)

    async def pid(self) -> int:
        return os.getpid()

    async def busy_s(self) -> float:
        """Seconds the engine spent decoding (for the idle ratios)."""
        return self.engine.stats.busy_s

    def _client(self, sampling: SamplingParams) -> LLMClient:
        return LLMClient(self.engine, self.tokenizer, sampling)

    async def run_group(self, task: Task, n: int) -> list[Episode]:
        """``n`` episodes of ``task`` at once; a failing episode comes back as an error episode."""
        w = self.cfg.workflow
        return list(await asyncio.gather(*[
            run_episode(self.workflow, task, lambda: self._client(self.sampling), timeout_s=w.timeout_s,
                        max_retries=w.max_retries) for _ in range(n)]))

    async def evaluate(self, tasks: list[Task]) -> EvalResult:
        e, s = self.cfg.eval, self.sampling
        sampling = SamplingParams(max_tokens=s.max_tokens, temperature=e.temperature, top_p=s.top_p, top_k=s.top_k,
                                  stop_token_ids=s.stop_token_ids)
        return await evaluate(self.engine, self.tokenizer, self.workflow, tasks, samples_per_task=e.samples_per_task,
                              sampling=sampling, timeout_s=self.cfg.workflow.timeout_s,
                              max_retries=self.cfg.workflow.max_retries, success_threshold=e.success_threshold)

    async def sync_weights(self, weights: Mapping[str, torch.Tensor], version: int, partial_rollout: str) -> None:
        """Load ``weights`` as ``version``. What happens to generation under way:
        ``continue``: it goes on with the new weights (in-flight update); ``abort``: it
        returns now and the client resumes it with prompt + partial tokens; ``off``: it
        finishes on the old weights first."""
        if partial_rollout == "continue":
            await self.engine.update_weights(weights, version)
            return
        await self.engine.pause("abort" if partial_rollout == "abort" else "wait")
        await self.engine.update_weights(weights, version)
        await self.engine.resume()

    async def shutdown(self) -> None:
        await self.engine.shutdown()
