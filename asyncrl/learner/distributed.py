"""Data-parallel sharding of the learner over the ranks of one ``torch.distributed``
process group (``learner.world_size`` > 1).

Each rank holds its policy (RL's :class:`~asyncrl.learner.Learner`, or an ``asyncrl sft``
rank) — with ``fsdp2``, read straight into its own shards where it can be
(``sharded_load.py``), else whole and then wrapped here: ``fsdp2`` shards parameters, gradients and
optimizer state across the ranks (``fully_shard`` per decoder layer, then the root, which
keeps the tied embedding and LM head in one unit); ``ddp`` keeps full replicas and
all-reduces gradients. The step's math stays with its loss (``Learner.train_step``, the
SFT run), its passes in the training core's one micro-batch loop
(``core.MicroBatchLoop``); this module gives them the few collective operations that
make N ranks take the same step as one:

- every rank takes its own contiguous rows of the step's batch (:meth:`Sharding.rows`);
- token and sequence counts are summed over ranks, so each micro-batch is weighted by its
  share of the *whole* batch, as on one rank;
- both wrappers average gradients over ranks (a division by N); the loss is multiplied by
  N (:attr:`Sharding.loss_scale`) so the synchronised gradient is the whole batch's;
- every rank runs the same number of forward and backward passes (:meth:`Sharding.count`):
  FSDP gathers parameters in each, DDP reduces gradients in the last, so a rank with fewer
  rows runs zero-weight filler micro-batches rather than leave the others waiting.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

Strategy = Literal["fsdp2", "ddp"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host``: rank 0's rendezvous store binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device rank ``local_rank`` of this machine trains on: its own GPU under CUDA."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        index = local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


def default_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(*, rank: int, world_size: int, init_method: str, backend: str, timeout_s: float) -> None:
    """Join the learner's process group. ``timeout_s`` bounds every collective: a rank
    left waiting for one that died or hangs raises instead of waiting forever."""
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def row_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous rows of ``size``: sizes differ by at most one row, and a
    rank may get none when the batch has fewer rows than ranks."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass
class Sharding:
    """This rank's place in the learner's process group, and the collectives the step needs."""

    strategy: Strategy
    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def current(cls, strategy: Strategy, device: torch.device) -> Sharding:
        """For the process group this process has joined."""
        return cls(strategy, dist.get_rank(), dist.get_world_size(), device)

    # ------------------------------------------------------------ the model
    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as this rank trains it. Every rank must pass identical weights (they
        all load ``model.path``): FSDP keeps this rank's shard of its own copy, DDP
        broadcasts rank 0's. A model already sharded as it loaded (``sharded_load.py``)
        is returned as it is."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return model
        model = model.to(self.device)
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # buffers (RoPE frequencies) are equal everywhere; broadcasting them per forward buys nothing
            return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)
        return self.shard(model)

    def shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 over ``model``, in place: ``fully_shard`` per decoder layer, then the root.
        Mixed precision (bf16 compute, fp32 gradient reduction and master weights) only on
        CUDA; CPU stays fp32. ``model`` may be on the meta device (``sharded_load.py``
        then allocates and reads only this rank's pieces)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.device.type == "cuda" else MixedPrecisionPolicy())
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The Hugging Face model inside (DDP wraps it; FSDP2 changes it in place)."""
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights, gathered to CPU on rank 0 (other ranks get ``{}``); a
        collective: every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast("dict[str, torch.Tensor]", state)  # a model's state holds tensors only

    def load_full_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Every rank passes the same full weights and keeps its part (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, ValueType, set_model_state_dict

        # torch annotates the dict it only reads as dict[str, ValueType], which dict[str, Tensor] is not (invariance)
        set_model_state_dict(model, cast("dict[str, ValueType]", state), options=StateDictOptions(full_state_dict=True))

    # ------------------------------------------------------------ the step
    def rows(self, size: int) -> tuple[int, int]:
        return row_range(size, self.rank, self.world_size)

    @property
    def loss_scale(self) -> float:
        """FSDP's reduce-scatter and DDP's all-reduce both average over ranks; the losses
        are already weighted by the whole batch, so the mean must become a sum."""
        return float(self.world_size)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over ranks (a new tensor, same device)."""
        out = values.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """``values``' elementwise maximum over ranks (a new tensor, same device)."""
        out = values.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    def count(self, n: int) -> int:
        """The largest ``n`` over ranks: how many passes every rank makes."""
        out = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return int(out.item())

    @contextlib.contextmanager
    def grad_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        """DDP: reduce gradients only on the last micro-batch (``no_sync`` before). FSDP2
        reduce-scatters after every backward, as by default: keeping unsharded gradients
        until the last would cost the full gradient's memory that sharding saves."""
        if self.strategy == "ddp" and not enabled:
            with cast(nn.parallel.DistributedDataParallel, model).no_sync():  # ddp: wrapped by DDP
                yield
        else:
            yield

    @staticmethod
    def norm_value(norm: Any) -> float:
        """``clip_grad_norm_`` over FSDP's sharded gradients returns a DTensor holding the
        global norm; its full value is the same on every rank."""
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)

    def barrier(self) -> None:
        if dist.get_backend() == "nccl":  # NCCL's barrier must be told this rank's GPU
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: a Hugging Face decoder's ``layers``."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"learner.strategy=fsdp2 needs a decoder with a `model.layers` list; "
                         f"{type(model).__name__} has none (use learner.strategy=ddp)")
    return list(layers)


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, counted from
    the tensors' local shards (a DTensor counts only its own piece)."""

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(v) for v in state)}
