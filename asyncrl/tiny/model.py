"""Tiny randomly initialised Qwen2 policy for tests and CPU examples.

Qwen2 is used because it is the architecture real runs fine-tune, so code paths
(GQA, RoPE, tied embeddings, generation config) match production while the
model stays ~0.1M params and loads in milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

# SDPA works on CPU in transformers 5.x and matches eager numerically to ~1e-6.
ATTN_IMPLEMENTATION = "sdpa"


def tiny_qwen2_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **overrides: Any,
) -> Qwen2Config:
    """Small Qwen2 config; with `tokenizer`, pad/eos ids come from it so the
    saved model stops on the same token the tokenizer calls eos."""
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        bos_token_id=None,
    )
    if tokenizer is not None:
        kwargs.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, seed: int = 0, **config_overrides: Any
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]:
    """Fresh float32 `Qwen2ForCausalLM` sized to `tokenizer`, deterministic in `seed`.

    The vocab is ``len(tokenizer)`` (not ``tokenizer.vocab_size``) so added
    special tokens have embedding rows. The RNG state is forked so building a
    model does not perturb the caller's global torch RNG stream.
    """
    config_overrides.setdefault("attn_implementation", ATTN_IMPLEMENTATION)
    config = tiny_qwen2_config(len(tokenizer), tokenizer=tokenizer, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model.eval()
    return model, tokenizer


def save_tiny_policy(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> Path:
    """Write model (safetensors) + tokenizer into one directory loadable by
    `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(path)`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path
