"""Target logprobs from a causal LM with its vocabulary-sized logits made a chunk at a time.

A forward that returns ``.logits`` holds a (B, T, V) tensor, and its log-softmax and gradient
two more of the same size: for a 49k-token vocabulary that is 0.8 GB of float32 each per 4096
positions, far more than the model (135M parameters) or the rest of its activations. Here the
model body runs once (its hidden states are (B, T, H), H ≪ V), and the LM head and the
log-softmax run over at most :func:`chunk_rows` positions at a time:

- positions that need a gradient (those ``grad`` marks) are checkpointed chunks
  (``torch.utils.checkpoint``): the forward keeps only each chunk's hidden rows, the backward
  recomputes one chunk's logits at a time, so no logits outlive their chunk;
- every other real position is computed without a graph, a chunk at a time.

Invariant: the result equals ``token_logprobs(model(ids).logits, targets)`` at every real
position (up to the float rounding of a matmul cut into rows), and the gradient is the same
wherever the caller's loss has a gradient only at the ``grad`` positions. Models whose logits
are not ``lm_head(last hidden state)`` (a soft cap, a scale: :func:`splits_head` finds out) are
run whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from asyncrl.algorithms import token_logprobs

LOGITS_CHUNK_FLOATS = 1 << 22
"""Logits a chunk may hold: 16 MiB of float32 (85 positions of a 49,152-token vocabulary; the
chunk's log-softmax and its gradient are as large again). Still a matmul of dozens of rows, so
the head runs at its speed."""


def chunk_rows(vocab: int) -> int:
    """Positions a chunk of logits holds for a vocabulary of ``vocab`` (at least one)."""
    return max(1, LOGITS_CHUNK_FLOATS // vocab)


def _piece(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor) -> Tensor:
    return token_logprobs(head(hidden), targets)


def chunked_logprobs(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, *, rows: int) -> Tensor:
    """``token_logprobs(head(hidden), targets)`` for hidden (N, H), targets (N,) -> (N,), ``rows``
    positions at a time. With gradients on, each chunk is checkpointed: its logits are made
    again in the backward, one chunk at a time, instead of being kept from the forward."""
    pieces = []
    for start in range(0, hidden.shape[0], rows):
        part, wanted = hidden[start:start + rows], targets[start:start + rows]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_piece, head, part, wanted, use_reentrant=False))
        else:
            pieces.append(_piece(head, part, wanted))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def splits_head(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logits are its output embedding applied to its decoder's last hidden
    state (checked on a few tokens, so a model that scales or caps its logits is found out)."""
    causal = cast(PreTrainedModel, model)  # a causal LM; typed as the module the engine holds
    head, body = causal.get_output_embeddings(), getattr(causal, "get_decoder", lambda: None)()
    if head is None or body is None:
        return False
    device = next(model.parameters()).device
    ids = torch.arange(4, device=device)[None] % int(head.weight.shape[0])
    with torch.no_grad():
        whole = model(input_ids=ids).logits.float()
        split = head(body(input_ids=ids).last_hidden_state).float()
    return whole.shape == split.shape and torch.allclose(whole, split, rtol=1e-4, atol=1e-5)


def position_logprobs(model: torch.nn.Module, ids: Tensor, mask: Tensor, targets: Tensor, grad: Tensor, *,
                      split: bool) -> Tensor:
    """log p(targets) at each position, (B, T) float32, 0 where ``mask`` (B, T) is off; the
    gradient flows from the positions ``grad`` (B, T) marks only (those a loss weighs). With
    ``split`` (:func:`splits_head`) the logits are made in chunks (module docstring); without,
    from the whole forward's logits."""
    if not split:
        lps = token_logprobs(model(input_ids=ids, attention_mask=mask.long()).logits, targets)  # (B, T, V) held
        return torch.where(mask, lps, torch.zeros_like(lps))
    causal = cast(PreTrainedModel, model)
    head, body = causal.get_output_embeddings(), causal.get_decoder()
    hidden = body(input_ids=ids, attention_mask=mask.long(), use_cache=False).last_hidden_state  # (B, T, H)
    rows = chunk_rows(int(head.weight.shape[0]))
    trained = grad & mask if torch.is_grad_enabled() else torch.zeros_like(mask)
    scored = mask & ~trained
    with torch.no_grad():
        values = chunked_logprobs(head, hidden[scored], targets[scored], rows=rows)
    lps = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device).masked_scatter(scored, values)
    if trained.any():  # a CPU-GPU sync point
        lps = lps.masked_scatter(trained, chunked_logprobs(head, hidden[trained], targets[trained], rows=rows))
    return lps
