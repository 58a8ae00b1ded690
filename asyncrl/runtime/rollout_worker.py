"""A rollout worker: one engine replica and the workflows that drive it.

For ``runtime: local`` the trainer holds one in its own process; for ``runtime: ray``
each is the body of a Ray actor (``ray_runtime.py``). Either way the orchestrator asks
it for whole groups, evaluations and weight updates; the staleness gate stays with the
orchestrator and every token's version is stamped by the engine inside the worker.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.client import LLMClient, stop_token_ids
from asyncrl.config import Config
from asyncrl.engine import RolloutEngine, TorchEngine
from asyncrl.evaluation import EvalResult, evaluate
from asyncrl.policy import check_policy, load_policy
from asyncrl.tasks.base import Task
from asyncrl.types import Episode, SamplingParams
from asyncrl.workflows.base import run_episode
from asyncrl.workflows.registry import build_workflow


class RolloutWorker:
    def __init__(self, cfg: Config, *, model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, weights: Mapping[str, torch.Tensor] | None = None,
                 version: int = 0, seed: int = 0, num_threads: int | None = None) -> None:
        """``model``/``tokenizer`` given: use them (in-process). Otherwise load them from
        ``model.path`` here, in the worker's own process. ``weights``: the latest published,
        loaded over ``model.path``'s. The engine itself is built by :meth:`start`."""
        if tokenizer is None:
            tokenizer = check_policy(cfg.model)
        self.cfg, self.tokenizer = cfg, tokenizer
        self._model, self._weights, self._version = model, weights, version
        self._seed, self._num_threads = seed, num_threads
        self.workflow = build_workflow(cfg)
        s = cfg.sampling
        self.sampling = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                       top_k=s.top_k, stop_token_ids=stop_token_ids(tokenizer))
        self.engine: RolloutEngine | None = None
        self._ready = asyncio.Event()
        self._start_error: BaseException | None = None

    async def start(self) -> None:
        """Build the engine (vLLM starts its own processes, hence async and separate). A
        failure here is raised to every call that waits for the engine, not just this one."""
        try:
            await self._build_engine()
        except BaseException as exc:
            self._start_error = exc
            raise
        finally:
            self._model = self._weights = None  # the engine holds what it needs
            self._ready.set()

    async def _build_engine(self) -> None:
        if self.cfg.engine == "vllm":
            from asyncrl.engine.vllm_engine import VLLMEngine

            self.engine = await VLLMEngine.start(self.cfg.model.path, seed=self._seed, version=self._version,
                                                 max_batch_size=self.cfg.rollout.max_batch_size,
                                                 dtype=self.cfg.model.dtype)
            applied = None
            while self._weights is not None and self._weights is not applied:  # newer ones may come meanwhile
                applied = self._weights
                await self.engine.update_weights(applied, self._version)
        else:
            model = self._model if self._model is not None else load_policy(self.cfg.model)[0]
            if self._weights is not None:
                model.load_state_dict(dict(self._weights), strict=False)  # tied weights appear once in an export
            self.engine = TorchEngine(model.eval(), max_batch_size=self.cfg.rollout.max_batch_size, seed=self._seed,
                                      version=self._version, num_threads=self._num_threads)

    async def _engine(self) -> RolloutEngine:
        await self._ready.wait()
        if self._start_error is not None:
            raise RuntimeError(f"the rollout engine failed to start: {self._start_error!r}") from self._start_error
        return self.engine

    async def pid(self) -> int:
        return os.getpid()

    async def busy_s(self) -> float:
        """Seconds the engine spent decoding (for the idle ratios); 0 while it starts."""
        return self.engine.stats.busy_s if self._ready.is_set() and self.engine is not None else 0.0

    async def run_group(self, task: Task, n: int) -> list[Episode]:
        """``n`` episodes of ``task`` at once; a failing episode comes back as an error episode."""
        engine, w = await self._engine(), self.cfg.workflow
        return list(await asyncio.gather(*[
            run_episode(self.workflow, task, lambda: LLMClient(engine, self.tokenizer, self.sampling),
                        timeout_s=w.timeout_s, max_retries=w.max_retries) for _ in range(n)]))

    async def evaluate(self, tasks: list[Task], on_episode: Callable[[Episode], None] | None = None) -> EvalResult:
        e, s = self.cfg.eval, self.sampling
        sampling = SamplingParams(max_tokens=s.max_tokens, temperature=e.temperature, top_p=s.top_p, top_k=s.top_k,
                                  stop_token_ids=s.stop_token_ids)
        return await evaluate(await self._engine(), self.tokenizer, self.workflow, tasks, samples_per_task=e.samples_per_task,
                              sampling=sampling, timeout_s=self.cfg.workflow.timeout_s,
                              max_retries=self.cfg.workflow.max_retries, success_threshold=e.success_threshold,
                              on_episode=on_episode)

    async def sync_weights(self, weights: Mapping[str, torch.Tensor], version: int, partial_rollout: str) -> None:
        """Load ``weights`` as ``version``. What happens to generation under way:
        ``continue``: it goes on with the new weights (in-flight update); ``abort``: it
        returns now and the client resumes it with prompt + partial tokens; ``off``: it
        finishes on the old weights first."""
        if not self._ready.is_set():  # still starting: it loads these when it is up
            self._weights, self._version = weights, version
            return
        engine = await self._engine()
        if partial_rollout == "continue":
            await engine.update_weights(weights, version)
            return
        await engine.pause("abort" if partial_rollout == "abort" else "wait")
        await engine.update_weights(weights, version)
        await engine.resume()

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
