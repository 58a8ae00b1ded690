"""Loading a policy — a Hugging Face causal LM and its tokenizer — with errors that name
the culprit, before any work starts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.model_store import KNOWN_MODELS, cached_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_model_path(path: str) -> Path:
    """The directory ``model.path`` names: a directory as given; a model ``asyncrl models
    get`` knows, from its cache; a Hugging Face id, from the local Hugging Face cache.
    Nothing is downloaded here: a run never waits on a network it may not have."""
    if Path(path).expanduser().is_dir():
        return Path(path).expanduser()
    if path in KNOWN_MODELS:
        cached = cached_model(path)
        if cached is None:
            raise ConfigError(f"model.path {path!r} is not fetched yet: run `asyncrl models get {path}` once "
                              "(or give a Hugging Face model directory)")
        return cached
    if path.count("/") == 1 and not path.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(path, local_files_only=True))
        except (OSError, ValueError):  # not in the local cache, or not a valid id: said below
            pass
    raise ConfigError(f"model.path {path!r} is not a directory, a fetched model ({', '.join(KNOWN_MODELS)}; "
                      "`asyncrl models get NAME`) or a Hugging Face id in the local cache (nothing is downloaded)")


def load_policy(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = check_policy(cfg)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.path), dtype=_DTYPES[cfg.dtype])
    return model.to(resolve_device(cfg.device)).eval(), tokenizer


def check_policy(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """Everything about ``model.path`` that can be checked without loading the weights
    (what a process that only orchestrates needs); returns the tokenizer."""
    path = resolve_model_path(cfg.path)
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
