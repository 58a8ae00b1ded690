"""Published weights from a learner rank process to this one through shared memory.

A pickled state dict crosses a pipe slowly: torch pickles each tensor's storage as a small
``torch.save`` of its own, and the bytes then pass the pipe in 64 KiB pieces, each read
taking the GIL from the engine's thread. For the shipped 0.8M-parameter policy that was
~15 ms of every weight sync (measured 2026-11-24, beside a decoding engine). So rank 0
copies the weights into one shared-memory block it owns (:class:`WeightBlock`) and replies
with a :class:`SharedSnapshot` — a name and a layout, a few hundred bytes — and the
driver copies the block out in one ``copy_`` (:class:`WeightReader`) before it answers the
call. The driver's tensors are its own: the block is written again at the next publish,
which cannot start before this one's reply has been read (a transport serialises calls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

ALIGN = 64
"""Each tensor starts at a multiple of this many bytes, so every dtype views it in place."""


@dataclass(frozen=True)
class Layout:
    """Where each tensor lies in a block: names, shapes, dtypes and byte offsets."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor]) -> Layout:
        offsets, end = [], 0
        for t in weights.values():
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return cls(tuple(weights), tuple(tuple(t.shape) for t in weights.values()),
                   tuple(t.dtype for t in weights.values()), tuple(offsets), end)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view of ``flat`` (bytes, uint8) laid out this way."""
        return {name: flat[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for name, shape, dtype, offset in zip(self.names, self.shapes, self.dtypes, self.offsets)}


@dataclass(frozen=True)
class SharedSnapshot:
    """What rank 0 replies to ``publish``: the block's name and its layout."""

    block: str
    layout: Layout


class WeightBlock:
    """Rank 0's side: the block it copies each publish into; made on the first publish and
    again whenever the layout changes; unlinked by :meth:`close` (at the rank's exit)."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self._layout: Layout | None = None

    def write(self, weights: dict[str, torch.Tensor]) -> SharedSnapshot:
        layout = Layout.of(weights)
        if layout != self._layout:
            self.close()
            self._shm = shared_memory.SharedMemory(create=True, size=max(1, layout.nbytes))
            self._layout = layout
        assert self._shm is not None
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=layout.nbytes) if layout.nbytes else None
        if flat is not None:
            for name, view in layout.views(flat).items():
                view.copy_(weights[name].detach().to("cpu"))
        del flat  # no view may outlive the call: an exported buffer cannot be closed
        return SharedSnapshot(self._shm.name, layout)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm, self._layout = None, None


class WeightReader:
    """The driver's side: attaches to rank 0's block (once per block) and copies each
    snapshot out into tensors of its own."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None

    def read(self, snapshot: SharedSnapshot) -> dict[str, torch.Tensor]:
        if self._shm is None or self._shm.name != snapshot.block:
            self.close()
            self._shm = shared_memory.SharedMemory(name=snapshot.block)
        nbytes = snapshot.layout.nbytes
        flat = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            block = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
            flat.copy_(block)
            del block
        return snapshot.layout.views(flat)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
