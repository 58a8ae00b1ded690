"""Loading a policy — a Hugging Face causal LM and its tokenizer — with errors that name
the culprit, before any work starts."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.model_store import KNOWN_MODELS, cached_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weights_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype a config's ``model.dtype`` / ``rollout.dtype`` names (a dtype as is)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


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
    """``model.path``'s model and tokenizer; a PEFT adapter directory (a LoRA run's
    checkpoint) is loaded as its base with the adapters merged: a plain model."""
    tokenizer = check_policy(cfg)
    path = resolve_model_path(cfg.path)
    base = adapter_base(path)
    model = (merged_adapters(path, base, weights_dtype(cfg.dtype)) if base is not None
             else AutoModelForCausalLM.from_pretrained(path, dtype=weights_dtype(cfg.dtype)))
    return model.to(resolve_device(cfg.device)).eval(), tokenizer


ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(path: Path) -> Path | None:
    """The base model a PEFT adapter directory (``adapter_config.json``, no ``config.json``:
    a LoRA run's checkpoint) holds adapters for, resolved as ``model.path`` is; None for a
    plain model directory."""
    config = path / ADAPTER_CONFIG
    if not config.is_file() or (path / "config.json").is_file():
        return None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{path} holds LoRA adapters but names no base model (base_model_name_or_path in "
                          f"{ADAPTER_CONFIG})")
    try:
        return resolve_model_path(base)
    except ConfigError as exc:
        raise ConfigError(f"{path} holds LoRA adapters on the base model {base!r}, which is not here: {exc}") from None


@contextlib.contextmanager
def peft_reads_deprecated() -> Iterator[None]:
    """Around building a ``PeftModel`` (``get_peft_model``, ``PeftModel.from_pretrained``):
    peft 0.21.2's ``PeftModel.__init__`` reads ``model.is_gradient_checkpointing``, which
    transformers 5.24 deprecates (a FutureWarning each time). peft's call, not ours; only
    that one warning is silenced, so any other deprecation still fails the tests."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def merged_adapters(path: Path, base: Path, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """``base`` with the adapters of the PEFT directory ``path`` merged in: a plain model
    computing the policy the adapters were trained to (``dtype``: the base's, as loaded)."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"{path} holds LoRA adapters; loading them needs peft: pip install 'asyncrl[lora]' "
                          "(or peft>=0.17)") from None
    model = AutoModelForCausalLM.from_pretrained(base, **({"dtype": dtype} if dtype is not None else {}))
    with peft_reads_deprecated():
        return peft.PeftModel.from_pretrained(model, path).merge_and_unload()


def check_policy(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """Everything about ``model.path`` that can be checked without loading the weights
    (what a process that only orchestrates needs); returns the tokenizer. A PEFT adapter
    directory is checked as its base model, with the tokenizer it holds (else the base's)."""
    path = resolve_model_path(cfg.path)
    base = adapter_base(path)
    if base is not None and not (path / "tokenizer_config.json").is_file():
        path = base  # adapters saved without a tokenizer: the base's
    try:
        hf_config = AutoConfig.from_pretrained(base or path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path {cfg.path!r} is not a Hugging Face model directory: {exc}") from None
    if not any(arch.endswith("ForCausalLM") for arch in hf_config.architectures or []):
        raise ConfigError(f"model.path {cfg.path!r} is not a causal LM (architectures: {hf_config.architectures})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path {cfg.path!r} has no loadable tokenizer: {exc}") from None
    return tokenizer
