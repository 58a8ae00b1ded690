"""``asyncrl models untie``: a copy of a model whose LM head is a tensor of its own.

A model that ties its LM head to its input embeddings (``tie_word_embeddings``: SmolLM2,
the tiny policies) keeps one tensor for both. vLLM's CPU build computes the head from a
packed copy of that tensor made at load, and a reload over HTTP (``engine: remote``'s
``reload_weights``) refreshes the embeddings but not the packed head: the servers go on
sampling from the old head, and the delivery check (``weight_sync.check_every``) stops
the run. The in-process ``engine: vllm`` repacks the head itself (``vllm_engine.py``); a
client over HTTP cannot, so it refuses such servers at connect (``engine/remote.py``) and
this command makes the copy they can serve.

Invariants of the copy: the same logits as the source for every input (the head starts
as an exact copy of the embeddings), ``tie_word_embeddings: false``, the tokenizer and
generation config beside it. Trained from there, the head and the embeddings move apart:
that is the untied model, the one the trainer and the servers then share.
"""

from __future__ import annotations

import shutil
from pathlib import Path

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.index.json", "*.pt")
"""A source's weight files, which the copy writes anew (the other files are copied)."""


def ties_head(model_dir: str | Path) -> bool:
    """Whether the model at ``model_dir`` ties its LM head to its input embeddings (its
    config as transformers resolves it: an absent key takes the architecture's default)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def model_path_ties_head(model_path: str) -> bool:
    """:func:`ties_head` of ``model.path`` as a run resolves it; False where it cannot be
    read on this machine (the servers' machines may hold it): the checks that ask then
    stay silent rather than refuse."""
    from asyncrl.config import ConfigError
    from asyncrl.policy import resolve_model_path

    try:
        return ties_head(resolve_model_path(model_path))
    except (ConfigError, OSError, ValueError):
        return False


def untie(src: Path, out: Path) -> Path:
    """Write ``src`` to ``out`` with its LM head untied; ``ValueError`` naming the source
    when it is not tied (nothing to do) and when ``out`` exists (never overwritten)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not ties_head(src):
        raise ValueError(f"{src} does not tie its LM head (tie_word_embeddings is false): serve it as it is")
    if out.exists():
        raise ValueError(f"{out} exists: give another --out, or remove it")
    hf_logging.disable_progress_bar()
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its report would call the head "newly initialized": it is copied next
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", tie_word_embeddings=False)
    finally:
        hf_logging.set_verbosity(level)
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    with torch.no_grad():
        head.weight.copy_(embeddings.weight)  # loaded untied, the head started from nothing: now the embeddings
    if head.weight.data_ptr() == embeddings.weight.data_ptr():
        raise RuntimeError(f"{src}: the head is still the embeddings' tensor after loading it untied")
    model.config.tie_word_embeddings = False
    model.save_pretrained(out)
    for file in src.iterdir():  # the tokenizer, its template, anything else beside the weights
        if file.is_file() and not any(file.match(p) for p in WEIGHT_FILES) and not (out / file.name).exists():
            shutil.copy2(file, out / file.name)
    return out


def default_out(src: Path) -> Path:
    """``<src>-untied`` beside the source (a fetched model's beside it in the cache)."""
    return src.with_name(src.name + "-untied")
