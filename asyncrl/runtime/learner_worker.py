"""The learner's side of the runtime: a :class:`~asyncrl.learner.Learner` behind calls
that are plain values in, plain values out, so the same object serves in-process
(:class:`LocalLearner` runs its calls on a worker thread) and as a Ray actor."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import Config
from asyncrl.heap import HeapTrimmer
from asyncrl.learner import Learner, TrainBatch
from asyncrl.learner.distributed import Sharding
from asyncrl.policy import load_policy
from asyncrl.runtime.protocol import SyncAddress
from asyncrl.runtime.weight_sync import WeightSender
from asyncrl.threads import UserThreads

T = TypeVar("T")


class LearnerWorker:
    def __init__(self, cfg: Config, *, model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, num_threads: int | None = None,
                 sharding: Sharding | None = None) -> None:
        """``sharding``: this worker is one rank of a sharded learner (``sharded_learner.py``)."""
        if model is None or tokenizer is None:
            model, tokenizer = load_policy(cfg.model)
        self.num_threads = num_threads
        self.learner = Learner(model, tokenizer, algorithm=cfg.algorithm, optim=cfg.optim,
                               total_steps=cfg.total_steps, temperature=cfg.sampling.temperature, sharding=sharding,
                               seed=cfg.seed)
        self._sender: WeightSender | None = None  # weight_sync.method: collective
        self._heap = HeapTrimmer()  # a step frees its activations: hand them back (asyncrl/heap.py)

    def _threads(self) -> None:
        if self.num_threads is not None:  # per OS thread in torch: set on whichever runs the call
            torch.set_num_threads(self.num_threads)

    def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        self._threads()
        metrics = self.learner.train_step(batch, on_policy=on_policy)
        self._heap.trim(force=True)
        return metrics

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.learner.export_weights()

    def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path:
        return self.learner.save_checkpoint(path, extra=extra, files=files)

    def load_checkpoint(self, path: Path) -> int:
        self._threads()
        self.learner.load_checkpoint(path)
        return self.learner.version

    # weight_sync.method: collective: this process is rank 0 (runtime/weight_sync.py). A
    # sharded learner's rank 0 hosts the group; every rank takes part in each send's gather.
    def open_weight_sync(self, receivers: int, bucket_mb: float, timeout_s: float, backend: str) -> SyncAddress:
        self.close_weight_sync()
        self._sender = WeightSender(receivers=receivers, bucket_mb=bucket_mb, timeout_s=timeout_s, backend=backend,
                                    device=self.learner.device if backend == "nccl" else torch.device("cpu"))
        return self._sender.address

    def connect_weight_sync(self) -> None:
        """The layout from the parameters' names, global shapes and dtypes (a sharded
        learner's DTensors report the full tensor's), so no gather is needed to plan it."""
        self._weight_sender().connect((name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
                                      for name, p in self.learner.module.named_parameters())

    def send_weights(self, version: int) -> None:
        """Broadcast the current weights as ``version``. Sharded, a collective of the
        learner's group: every rank gathers the full weights to rank 0 (``export_weights``),
        then rank 0 alone sends them; the other ranks return."""
        if self.learner.sharding is None:
            self._weight_sender().send(version, dict(self.learner.module.named_parameters()))
            return
        weights = self.learner.export_weights()
        if self.learner.is_main:
            self._weight_sender().send(version, weights)

    def close_weight_sync(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def _weight_sender(self) -> WeightSender:
        if self._sender is None:
            raise RuntimeError("the weight-sync group is not open (open_weight_sync first)")
        return self._sender


class LocalLearner:
    """The learner handle in-process: each call runs on a thread, so the event loop keeps
    feeding the engine while the learner computes (torch releases the GIL in its kernels).
    Daemon threads of its own, not asyncio's default pool: a user's loss that never returns
    must not keep the process alive after a second signal (that pool is joined at exit)."""

    def __init__(self, worker: LearnerWorker) -> None:
        self.worker = worker
        self._threads = UserThreads(None, name="asyncrl-learner")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._threads.call(fn, *args, what=f"learner {fn.__name__}")

    async def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        return await self._call(self.worker.train_step, batch, on_policy)

    async def publish(self) -> dict[str, torch.Tensor]:
        """A snapshot of the weights: the next step may start before every engine loads it."""
        return await self._call(self.worker.export_weights)

    async def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path:
        return await self._call(self.worker.save_checkpoint, path, extra, files)

    async def load_checkpoint(self, path: Path) -> int:
        return await self._call(self.worker.load_checkpoint, path)

    async def open_weight_sync(self, receivers: int, bucket_mb: float, timeout_s: float,
                               backend: str) -> SyncAddress:
        return await self._call(self.worker.open_weight_sync, receivers, bucket_mb, timeout_s, backend)

    async def connect_weight_sync(self) -> None:
        await self._call(self.worker.connect_weight_sync)

    async def send_weights(self, version: int) -> None:
        await self._call(self.worker.send_weights, version)

    async def close_weight_sync(self) -> None:
        self.worker.close_weight_sync()

    FINISH_S = 30.0
    """How long shutdown lets a learner call under way finish, unless a second signal ended the run."""

    async def shutdown(self) -> None:
        """The learner lives and dies with this process; only its idle threads end. A step
        under way when the run ends on an error (a non-finite advantage from the rollout
        side, say) is first let finish, up to :attr:`FINISH_S`: a daemon thread still inside
        torch when the interpreter finalizes is ended mid-C++ and aborts the process
        (SIGABRT, "terminate called without an active exception") instead of letting it exit
        with the run's status. Not while this task is being cancelled (a second signal):
        that exit must not wait for a loss that never returns."""
        task = asyncio.current_task()
        if task is None or not task.cancelling():
            await self._threads.settle(self.FINISH_S)
        self._threads.close()
