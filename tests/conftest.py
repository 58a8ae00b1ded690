"""Shared fixtures: tiny models built from a config, nothing downloaded."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(2)


def make_model(seed: int = 0, vocab_size: int = 96, max_positions: int = 512) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=max_positions,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture
def model() -> Qwen2ForCausalLM:
    return make_model()


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of ``tokens`` from one plain forward pass: what a learner computes."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
