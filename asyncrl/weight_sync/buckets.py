"""Buckets: parameters of one dtype packed back to back into flat tensors, so a sync is
a few large broadcasts instead of one per parameter; and a digest of weights to compare
two copies without moving them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Bucket:
    """Parameters packed back to back into one flat tensor of ``dtype``."""

    dtype: torch.dtype
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "names": self.names, "shapes": self.shapes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Bucket:
        return cls(getattr(torch, d["dtype"]), tuple(d["names"]), tuple(tuple(s) for s in d["shapes"]))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Group tensors by dtype (a flat bucket has one), in order, each bucket at most
    ``bucket_bytes``; a tensor larger than that goes alone rather than being split."""
    open_: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    size: dict[torch.dtype, int] = {}
    buckets: list[Bucket] = []

    def close(dtype: torch.dtype) -> None:
        entries = open_.pop(dtype, [])
        size.pop(dtype, None)
        if entries:
            buckets.append(Bucket(dtype, tuple(n for n, _ in entries), tuple(s for _, s in entries)))

    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if open_.get(tensor.dtype) and size[tensor.dtype] + nbytes > bucket_bytes:
            close(tensor.dtype)
        open_.setdefault(tensor.dtype, []).append((name, tuple(tensor.shape)))
        size[tensor.dtype] = size.get(tensor.dtype, 0) + nbytes
    for dtype in list(open_):
        close(dtype)
    return buckets


def pack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat tensor on ``device`` holding ``bucket``'s tensors back to back."""
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    offset = 0
    with torch.no_grad():
        for name, shape in zip(bucket.names, bucket.shapes):
            n = _numel(shape)
            flat[offset:offset + n].copy_(tensors[name].detach().reshape(-1))
            offset += n
    return flat


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into ``flat``, one per tensor of ``bucket`` (no copy)."""
    out, offset = {}, 0
    for name, shape in zip(bucket.names, bucket.shapes):
        n = _numel(shape)
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of names and exact bytes, to check two copies of the weights are equal
    without moving them (tests, ``bench sync``): a full pass over the weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        t = tensor.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
