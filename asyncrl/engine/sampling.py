"""Batched sampling with per-row parameters, and the logprob the learner reproduces."""

from __future__ import annotations

import torch

from asyncrl.types import SamplingParams


class RowParams:
    """Per-row sampling parameters of a decode batch as tensors, so one step samples every
    row with its own temperature / top-k / top-p without a Python loop."""

    def __init__(self, params: list[SamplingParams], device: torch.device) -> None:
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.any_greedy = any(p.temperature == 0 for p in params)
        self.any_truncation = any(p.top_k > 0 or p.top_p < 1 for p in params)


def sample_tokens(
    logits: torch.Tensor, rows: RowParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits: (B, V). Returns (tokens (B,), logprobs (B,)).

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
    uniform = torch.rand(masked.shape, generator=generator, device=masked.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_(min=1e-20)))
    tokens = (masked + gumbel).argmax(dim=-1)
    if rows.any_greedy:
        tokens = torch.where(rows.temperature > 0, tokens, logits.argmax(dim=-1))
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
