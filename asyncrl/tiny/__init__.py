"""Tiny locally built policy (char tokenizer + small Qwen2) for tests and CPU runs."""

from asyncrl.tiny.model import build_tiny_model, save_tiny_policy, tiny_qwen2_config
from asyncrl.tiny.tokenizer import (
    CHARSET,
    CHAT_TEMPLATE,
    EOT,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    UNK,
    build_char_tokenizer,
    char_vocab,
    chat_prompt_ids,
    save_char_tokenizer,
)

__all__ = [
    "CHARSET",
    "CHAT_TEMPLATE",
    "EOT",
    "IM_END",
    "IM_START",
    "PAD",
    "SPECIAL_TOKENS",
    "UNK",
    "build_char_tokenizer",
    "build_tiny_model",
    "char_vocab",
    "chat_prompt_ids",
    "save_char_tokenizer",
    "save_tiny_policy",
    "tiny_qwen2_config",
]
