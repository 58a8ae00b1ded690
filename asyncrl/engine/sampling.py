"""Batched sampling with per-row parameters, and the logprob the learner reproduces.

A request with a ``seed`` draws its noise from a counter-based hash of (seed, position,
vocabulary index) instead of the engine's generator: the token at a position is then a
function of the logits and the seed alone, whatever else shares the batch, whenever it
runs, and across an abort-and-resume (the resumed request continues the positions).
"""

from __future__ import annotations

import torch

from asyncrl.types import SamplingParams


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without waiting for the device: on CUDA
    through pinned memory and a non-blocking copy (a plain copy from pageable memory
    synchronises the stream, a second host synchronisation in a step where rows came or went)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class RowParams:
    """Per-row sampling parameters of a decode batch as tensors, so one step samples every
    row with its own temperature / top-k / top-p without a Python loop."""

    def __init__(self, params: list[SamplingParams], device: torch.device) -> None:
        self.temperature = to_device([p.temperature for p in params], torch.float32, device)
        self.top_k = to_device([p.top_k for p in params], torch.long, device)
        self.top_p = to_device([p.top_p for p in params], torch.float32, device)
        self.any_greedy = any(p.temperature == 0 for p in params)
        self.any_truncation = any(p.top_k > 0 or p.top_p < 1 for p in params)
        self.seeds = to_device([-1 if p.seed is None else p.seed for p in params], torch.long, device)
        self.any_seeded = any(p.seed is not None for p in params)
        self.all_seeded = all(p.seed is not None for p in params)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 in int64, exact: split in 16-bit halves so no
    product overflows (int64 overflow is undefined in C++, so torch does not promise a wrap)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Wellons' "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _positions(positions: torch.Tensor | None) -> torch.Tensor:
    if positions is None:
        raise ValueError("seeded rows are sampled at their positions: pass positions=")
    return positions


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, V) floats in (0, 1), a pure function of each row's (seed, position) and the
    column: the same on any device, in any batch."""
    column = torch.arange(vocab_size, device=seeds.device, dtype=torch.long)[None, :]
    h = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    h = _mix32(h ^ (positions & _MASK32))  # (B,)
    h = _mix32(h[:, None] ^ column)  # (B, V)
    return (h.double() + 0.5).div(2.0**32).float().clamp(min=1e-20, max=1 - 2**-24)


def sample_tokens(
    logits: torch.Tensor, rows: RowParams, generator: torch.Generator | None, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits: (B, V); ``positions``: (B,) each row's position of
    the token being sampled (needed for seeded rows). Returns (tokens (B,), logprobs (B,)).

    The returned logprob is log softmax(logits / T) at the sampled token — the full
    temperature-scaled distribution, before top-k/top-p truncation (raw logits when
    greedy) — because that is what the learner recomputes from its own forward pass.
    """
    logits = logits.float()
    temperature = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature))
    logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)  # (B, V)

    masked = logprobs
    if rows.any_truncation:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        k = torch.where(rows.top_k > 0, rows.top_k, torch.full_like(rows.top_k, logits.shape[-1]))
        probs = sorted_lp.exp()
        mass_before = probs.cumsum(dim=-1) - probs  # the top token is always kept
        keep_sorted = (rank < k[:, None]) & (mass_before < rows.top_p[:, None])
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        masked = logprobs.masked_fill(~keep, float("-inf"))

    # Gumbel-max: argmax(log p + Gumbel) samples from p; one kernel, no renormalisation.
    if rows.all_seeded:
        uniform = seeded_uniform(rows.seeds, _positions(positions), masked.shape[-1])
    else:
        uniform = torch.rand(masked.shape, generator=generator, device=masked.device)
        if rows.any_seeded:  # a where, not a boolean index: no host synchronisation
            seeded = (rows.seeds >= 0)[:, None]
            uniform = torch.where(seeded, seeded_uniform(rows.seeds, _positions(positions), masked.shape[-1]), uniform)
    gumbel = -torch.log(-torch.log(uniform.clamp_(min=1e-20)))
    tokens = (masked + gumbel).argmax(dim=-1)
    if rows.any_greedy:
        tokens = torch.where(rows.temperature > 0, tokens, logits.argmax(dim=-1))
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
