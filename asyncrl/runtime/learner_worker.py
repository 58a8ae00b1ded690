"""The learner's worker: one rank of the learner, holding every call the orchestrator
makes of it, plain values in and out, so one class serves in this process, as a rank
process and as a Ray actor; the transport (``transport.py``) is all that differs.

It is built cheaply, then :meth:`join` loads the policy, joining the other ranks' process
group first when there are several (each then holds a shard: ``asyncrl/learner/
distributed.py``). Every call goes to every rank in the same order, because with several
ranks each is a collective: each takes its rows of the step's batch, the full weights
are gathered to rank 0, each writes its optimizer shard.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import Config, ConfigError
from asyncrl.weight_updates import WeightUpdate
from asyncrl.heap import HeapTrimmer
from asyncrl.learner import Learner, TrainBatch
from asyncrl.learner.distributed import (
    Sharding,
    default_backend,
    destroy_process_group,
    free_port,
    init_process_group,
    local_bytes,
    rank_device,
)
from asyncrl.learner.critic import build_critic
from asyncrl.learner.export import update_kind
from asyncrl.learner.sharded_load import WholeLoadNeeded, load_sharded
from asyncrl.policy import check_policy, load_policy
from asyncrl.weight_sync.delivery import forward_logprobs
from asyncrl.core_budget import ThreadBudget

T = TypeVar("T")
logger = logging.getLogger(__name__)


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LearnerWorker:
    def __init__(self, cfg: Config, *, rank: int = 0, world_size: int = 1, num_threads: int | None = None,
                 model: PreTrainedModel | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 thread_budget: ThreadBudget | None = None) -> None:
        """``model``/``tokenizer``: the policy already loaded in this process (one rank only).
        ``thread_budget``: the cores shared with the engine (``rollout.thread_sharing``); a
        training call then computes with every core while the engine is idle."""
        self.cfg, self.rank, self.world_size, self.num_threads = cfg, rank, world_size, num_threads
        self.thread_budget = thread_budget
        self._policy = (model, tokenizer) if model is not None and tokenizer is not None else None
        self._learner: Learner | None = None  # set by join()
        self.attached: dict[str, Any] = {}  # what ``apply`` installed (a weight sender); closed by leave()
        self._heap = HeapTrimmer()  # a step frees its activations: hand them back (asyncrl/heap.py)

    @property
    def learner(self) -> Learner:
        """This rank's learner, once :meth:`join` has built it."""
        if self._learner is None:
            raise RuntimeError("the learner worker has no learner before join()")
        return self._learner

    @learner.setter
    def learner(self, learner: Learner) -> None:
        self._learner = learner

    def _set_threads(self) -> None:
        # per OS thread in torch: set on whichever runs the call, never on the constructing one
        # (in this process that is the event loop's, which keeps one: asyncrl.runtime.start)
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)

    @contextmanager
    def _computing(self) -> Iterator[None]:
        """A training call: its threads set, and within the core budget working, then idle."""
        self._set_threads()
        if self.thread_budget is None:
            yield
            return
        self.thread_budget.working("learner")
        try:
            yield
        finally:
            self.thread_budget.idle("learner")

    # ------------------------------------------------------------ the group
    def rendezvous(self) -> str:
        """Where the ranks meet: a free port on this machine (asked of rank 0)."""
        return f"tcp://127.0.0.1:{free_port()}"

    def join(self, init_method: str | None = None, local_rank: int = 0) -> None:
        """Join the process group (when there is more than one rank), then load the policy,
        sharded. ``local_rank``: this rank's index on its machine (its GPU)."""
        self._set_threads()
        sharding = None
        if self.world_size > 1:
            device = rank_device(self.cfg.model.device, local_rank)
            backend = self.cfg.learner.backend or default_backend(device)
            if backend == "nccl" and device.type != "cuda":
                raise ConfigError(f"learner.backend=nccl, but rank {self.rank} has no GPU (device {device})")
            if init_method is None:
                raise ValueError(f"{self.world_size} learner ranks meet at an address: join(init_method=rendezvous())")
            init_process_group(rank=self.rank, world_size=self.world_size, init_method=init_method,
                               backend=backend, timeout_s=self.cfg.learner.timeout_s)
            sharding = Sharding.current(self.cfg.learner.effective_strategy, device)
        model, tokenizer = self._policy or self._load(sharding)
        self._policy = None
        c = self.cfg
        self.learner = Learner(model, tokenizer, algorithm=c.algorithm, optim=c.optim, total_steps=c.total_steps,
                               temperature=c.sampling.temperature, sharding=sharding, seed=c.seed,
                               share_prompts=c.learner.share_prompts, lora=c.model.lora, autocast=c.learner.autocast,
                               critic=build_critic(c, tokenizer, sharding),
                               update=update_kind(c.model.lora, engine=c.engine,
                                                  same_dtype=c.engine_dtype == c.model.dtype))
        self.learner.thread_budget = self.thread_budget

    def _load(self, sharding: Sharding | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """The policy: with FSDP2, straight into this rank's shards, no rank holding the whole
        model (``asyncrl/learner/sharded_load.py``); else whole, as one rank and DDP's
        replicas need it, and where the run keeps a full copy anyway (the KL reference) or
        the model cannot be read a slice at a time (said once, by rank 0)."""
        if sharding is not None and sharding.strategy == "fsdp2":
            why = ("algorithm.kl_coef > 0 keeps a full frozen reference on every rank"
                   if self.cfg.algorithm.kl_coef > 0 else None)
            if why is None:
                try:
                    return load_sharded(self.cfg.model, sharding), check_policy(self.cfg.model)
                except WholeLoadNeeded as exc:
                    why = str(exc)
            if self.rank == 0:
                logger.warning("learner ranks load the whole model before sharding it: %s", why)
        return load_policy(self.cfg.model)

    def leave(self) -> None:
        """Close what ``apply`` attached, then leave the process group."""
        for thing in reversed(list(self.attached.values())):
            thing.close()
        self.attached.clear()
        if self.world_size > 1:
            destroy_process_group()

    def apply(self, fn: Callable[..., T], *args: Any) -> T:
        with self._computing():  # fn may compute (the delivery check's forward pass), as a step does
            return fn(self, *args)

    # ------------------------------------------------------------ LearnerHandle's calls
    def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        """Every rank returns the same metrics (reduced over ranks)."""
        with self._computing():
            metrics = self.learner.train_step(batch, on_policy=on_policy)
        self._heap.trim()  # at most once a second: a trim beside the engine costs a share of a short step
        return metrics

    def accumulate(self, batch: TrainBatch, on_policy: bool) -> None:
        with self._computing():
            self.learner.accumulate(batch, on_policy=on_policy)
        self._heap.trim()  # at most once a second: parts come often

    def finish_step(self) -> dict[str, float]:
        with self._computing():
            metrics = self.learner.finish_step()
        self._heap.trim()
        return metrics

    def publish(self) -> WeightUpdate:
        """What the engines load (on rank 0; an empty ``FullWeights`` on the others): the
        run's one kind of update (``Learner.engine_weights``, ``asyncrl/learner/export.py``).
        Within the core budget like a step: the export touches every weight, and beside an
        engine that took every core once the step ended (``turns``: always, its groups
        queued) it was a second thread team on the cores, and weight syncs took many times
        longer (docs/scaling.md, `turns`)."""
        with self._computing():
            return self.learner.export_weights()

    def publish_into(self, write: Callable[[WeightUpdate], T]) -> T | WeightUpdate:
        """:meth:`publish` for a learner in its own process: ``write`` (its copy into shared
        memory, ``shared_weights.py``) of the update, within the core budget too; an empty
        update (the other ranks) as it is. ``write`` copies at once, before the learner
        trains again, so one rank hands it its parameters themselves (no snapshot of them
        to copy a second time)."""
        with self._computing():
            one_rank = self.learner.sharding is None
            update = self.learner.engine_weights() if one_rank else self.learner.export_weights()
            return write(update) if update else update

    def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path:
        return self.learner.save_checkpoint(path, extra=extra, files=files)

    def load_checkpoint(self, path: Path) -> int:
        self._set_threads()
        self.learner.load_checkpoint(path)
        return self.learner.version

    # ------------------------------------------------------------ the delivery check's
    def probe_logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The delivery check's forward on this rank (``weight_sync/delivery.forward_logprobs``)."""
        return forward_logprobs(self.learner, sequences)

    def engine_update_bytes(self) -> int:
        """The bytes of what one engine is sent per sync (``Learner.engine_weights``)."""
        return self.learner.engine_weights().nbytes

    # ------------------------------------------------------------ for asyncrl bench learner
    def timed_train_step(self, batch: TrainBatch, on_policy: bool) -> tuple[dict[str, float], float]:
        """A step and its seconds on this rank, from a barrier to the end of the optimizer
        step (what ``asyncrl bench learner`` reports, without the transport's cost)."""
        if self.learner.sharding is not None:
            self.learner.sharding.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = self.train_step(batch, on_policy)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return metrics, time.perf_counter() - start

    def memory(self) -> dict[str, Any]:
        """Bytes of parameters, gradients and optimizer state this rank holds (its shards,
        counted exactly), its peak RSS, and on CUDA the allocator's peak."""
        learner = self.learner
        out: dict[str, Any] = {"rank": self.rank, **local_bytes(learner.model, learner.optimizer),
                               "peak_rss": peak_rss()}
        if learner.device.type == "cuda":
            out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(learner.device)
        return out

    def pid(self) -> int:
        return os.getpid()
