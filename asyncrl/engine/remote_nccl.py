"""``remote.weight_transfer=nccl``: the trainer's side of vLLM's native weight transfer, the
one part of ``engine: remote`` that moves tensors outside HTTP.

vLLM's NCCL backend (``vllm/distributed/weight_transfer/nccl_engine.py``) puts the trainer
at rank 0 of one NCCL group with every inference worker of every server: a server's
workers take ranks ``rank_offset .. rank_offset + its world size - 1`` (its world size is
``GET /get_world_size``: TP × PP × DP), so the group is 1 + the sum of the servers'. Each
server joins when it is sent ``POST /init_weight_transfer_engine`` with its own
``rank_offset`` while the trainer opens the rendezvous; an update is
``POST /update_weights`` on every server (its names, dtypes and shapes) while the trainer
broadcasts the tensors in that order. The HTTP choreography is the client's
(``RemoteEngine._nccl_update``); the tensors are moved by a :class:`WeightBroadcast`, by
default :class:`VLLMBroadcast`, vLLM's own trainer-side helpers (imported only here, only
when ``nccl`` is chosen: a trainer without vLLM never imports them). Tests inject another
broadcast to check the protocol on machines with no GPU.
"""

from __future__ import annotations

import socket
from typing import Any, Protocol
from urllib.parse import urlsplit

import torch


class WeightBroadcast(Protocol):
    """The trainer's end of the NCCL group. Every method blocks (the client runs each on
    a thread of its own, under ``remote.weight_load_timeout_s``)."""

    def wire(self) -> dict[str, Any]:
        """The wire fields every worker must agree on, sent in each server's ``init_info``
        (vLLM's ``packed``, ``packed_buffer_size_bytes``, ``packed_num_buffers``)."""
        ...

    def join(self, address: str, port: int, world_size: int) -> None:
        """Open the rendezvous at ``address:port`` as rank 0 of ``world_size`` ranks;
        returns once every worker joined."""
        ...

    def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast ``tensors`` from rank 0, in this order (the order of ``update_info``)."""
        ...

    def close(self) -> None: ...


class VLLMBroadcast:
    """:class:`WeightBroadcast` through vLLM's trainer-side helpers: ``trainer_init``
    (a ``StatelessProcessGroup`` rendezvous, then a ``PyNcclCommunicator``) and the packed
    broadcast its ``NCCLTrainerWeightTransferEngine`` uses. Needs CUDA and vLLM."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("remote.weight_transfer=nccl broadcasts from this process's GPU, and CUDA is not "
                               "available here: use remote.weight_transfer=files")
        try:
            from vllm.distributed.weight_transfer import nccl_common, packed_tensor
        except ImportError as exc:
            raise RuntimeError(f"remote.weight_transfer=nccl joins vLLM's NCCL group through vLLM's own helpers, "
                               f"which do not import here ({exc}): pip install vllm in the trainer's environment, "
                               "or use remote.weight_transfer=files") from None
        self._common, self._packed = nccl_common, packed_tensor
        self._group: Any = None

    def wire(self) -> dict[str, Any]:
        return {"packed": True, "packed_buffer_size_bytes": self._packed.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                "packed_num_buffers": self._packed.DEFAULT_PACKED_NUM_BUFFERS}

    def join(self, address: str, port: int, world_size: int) -> None:
        self._group = self._common.trainer_init(
            {"master_address": address, "master_port": port, "world_size": world_size}, rank=0)

    def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        self._packed.packed_nccl_broadcast_producer(
            iterator=((name, t.to(device, non_blocking=True).contiguous()) for name, t in tensors),
            group=self._group, src=0, post_iter_func=lambda item: item[1],
            buffer_size_bytes=self._packed.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            num_buffers=self._packed.DEFAULT_PACKED_NUM_BUFFERS)
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self._group is not None:
            self._group.destroy()
            self._group = None


def update_info(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
    """vLLM's ``NCCLWeightTransferUpdateInfo``: the names, dtype names (``float32``) and
    shapes the workers allocate before they receive, in the broadcast's order."""
    return {"names": [name for name, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}


def local_address(url: str) -> str:
    """The address this machine reaches ``url``'s host from: one that server can reach
    back (no packet is sent: a UDP socket's connect only picks the route)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
        except OSError:
            return "127.0.0.1"
        return s.getsockname()[0]


def free_port(address: str) -> int:
    """A port free at ``address`` now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]
