"""Loading a policy — a Hugging Face causal LM and its tokenizer — with errors that name
the culprit, before any work starts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import ConfigError, ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_policy(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = check_policy(cfg)
    model = AutoModelForCausalLM.from_pretrained(Path(cfg.path), dtype=_DTYPES[cfg.dtype])
    return model.to(resolve_device(cfg.device)).eval(), tokenizer


def check_policy(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """Everything about ``model.path`` that can be checked without loading the weights
    (what a process that only orchestrates needs); returns the tokenizer."""
    path = Path(cfg.path)
    if not path.is_dir():
        raise ConfigError(f"model.path {cfg.path!r} is not a directory (nothing is downloaded; "
                          "give a local Hugging Face model directory)")
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path {cfg.path!r} is not a Hugging Face model directory: {exc}") from None
    if not any(arch.endswith("ForCausalLM") for arch in hf_config.architectures or []):
        raise ConfigError(f"model.path {cfg.path!r} is not a causal LM (architectures: {hf_config.architectures})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path {cfg.path!r} has no loadable tokenizer: {exc}") from None
    return tokenizer
