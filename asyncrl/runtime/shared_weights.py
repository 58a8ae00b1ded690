"""Published weights from a learner rank process to this one through shared memory.

A pickled state dict crosses a pipe slowly: torch pickles each tensor's storage as a small
``torch.save`` of its own, and the bytes then pass the pipe in 64 KiB pieces, each read
taking the GIL from the engine's thread (docs/design.md gives the figures). So rank 0
copies the weights into one shared-memory block (:class:`WeightBlock`) and replies with a
:class:`SharedSnapshot` — a layout, a few hundred bytes — and the driver copies the block
out in one ``copy_`` (:class:`WeightReader`) before it answers the call. The driver's
tensors are its own: the block is written again at the next publish, which cannot start
before this one's reply has been read (a transport serialises calls).

The block is an anonymous memory file (``memfd_create``), not a named ``/dev/shm`` entry:
rank 0 passes its descriptor to the driver over the rank's socket once, and each side
maps it. Nothing has a name to unlink, so no kill — of one process, or of the whole
process group at once — leaves a block behind: the kernel frees it with the last process
that maps it. Its size is reserved when it is made (``posix_fallocate``), so too little
memory is an error at that moment, naming the size, and never a SIGBUS mid-copy; rank 0
then sends the weights through the pipe instead and says so once.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.weight_updates import WeightUpdate, as_update, flatten_update, unflatten_update

ALIGN = 64
"""Each tensor starts at a multiple of this many bytes, so every dtype views it in place."""


class BlockUnavailable(OSError):
    """A block of the size needed could not be made; the message names the size and why."""


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
    """What rank 0 replies to ``publish``: which block (a count of the blocks it made), the
    layout, and the kind of update the tensors make (``engine.protocol.flatten_update``'s
    header). ``new``: the block's descriptor follows this reply on the rank's socket."""

    block: int
    layout: Layout
    new: bool
    kind: Any = ("full",)


class _Mapped:
    """One block, mapped: the memory file's descriptor and its mapping."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes
        self.map = mmap.mmap(fd, max(1, nbytes))

    def flat(self) -> torch.Tensor:
        """The block as bytes; no view of it may outlive the caller's use (an exported
        buffer cannot be closed)."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=self.nbytes)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class WeightBlock:
    """Rank 0's side: the block it copies each publish into; made on the first publish and
    again whenever the layout changes (the old one is freed once the driver drops it too)."""

    def __init__(self) -> None:
        self._block: _Mapped | None = None
        self._layout: Layout | None = None
        self._made = 0

    def write(self, update: WeightUpdate | dict[str, torch.Tensor]) -> SharedSnapshot:
        """Copy ``update``'s tensors in. Raises :class:`BlockUnavailable` when a new block is
        needed and cannot be made; the caller sends the weights another way."""
        kind, weights = flatten_update(as_update(update))
        layout = Layout.of(weights)
        new = layout != self._layout
        if new:
            self.close()
            self._block = _Mapped(_memory_file(layout.nbytes), layout.nbytes)
            self._layout, self._made = layout, self._made + 1
        assert self._block is not None
        if layout.nbytes:
            flat = self._block.flat()
            for name, view in layout.views(flat).items():
                view.copy_(weights[name].detach().to("cpu"))
        return SharedSnapshot(self._made, layout, new, kind)

    def descriptor(self) -> int:
        """The current block's file descriptor, to pass to the driver after a new snapshot."""
        assert self._block is not None
        return self._block.fd

    def close(self) -> None:
        if self._block is not None:
            self._block.close()
            self._block, self._layout = None, None


def _memory_file(nbytes: int) -> int:
    """An anonymous memory file of ``nbytes``, its pages reserved now."""
    if not hasattr(os, "memfd_create"):
        raise BlockUnavailable("this system has no memfd_create (Linux only)")
    fd = os.memfd_create("asyncrl-weights", os.MFD_CLOEXEC)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, 1)
    except OSError as exc:
        os.close(fd)
        raise BlockUnavailable(f"a shared-memory block of {nbytes / 2**20:.1f} MiB for the weights could not be "
                               f"reserved: {exc.strerror or exc}") from exc
    return fd


class WeightReader:
    """The driver's side: maps each block rank 0 passes it (once per block) and copies each
    snapshot out into tensors of its own."""

    def __init__(self) -> None:
        self._block: _Mapped | None = None
        self._id: int | None = None

    def attach(self, snapshot: SharedSnapshot, fd: int) -> None:
        """The descriptor of a new block (``snapshot.new``), received from rank 0."""
        self.close()
        self._block, self._id = _Mapped(fd, snapshot.layout.nbytes), snapshot.block

    def read(self, snapshot: SharedSnapshot) -> WeightUpdate:
        if self._block is None or self._id != snapshot.block:
            raise RuntimeError(f"weights published in block {snapshot.block}, whose descriptor never arrived")
        nbytes = snapshot.layout.nbytes
        flat = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            block = self._block.flat()
            flat.copy_(block)
            del block
        return unflatten_update(snapshot.kind, snapshot.layout.views(flat))

    def close(self) -> None:
        if self._block is not None:
            self._block.close()
            self._block, self._id = None, None
