"""The shipped examples run end to end with the shipped model, as a user would start them;
names of user files (``path/to/file.py:attr``) resolve like modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from real_model import smollm2_dir  # noqa: F401 (a fixture)

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.plugins import load_named
from asyncrl.tasks import load_tasks

REPO = Path(__file__).resolve().parents[1]
# A few small steps: the examples' own sizes are for a real run, not for a test.
SMALL = ["total_steps=2", "batch_size=2", "group_size=4", "eval.num_tasks=4", "eval.samples_per_task=1",
         "algorithm.filter_zero_variance=false"]


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the examples name their files relative to the repository root


def train(config, out, *overrides):
    assert main(["train", config, f"output_dir={out}", *SMALL, *overrides]) == 0
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_jsonl_example_data_holds_out_a_small_validation_split(in_repo):
    cfg = load_config("examples/jsonl/train.yaml")
    splits = load_tasks("jsonl", path=cfg.task.path, seed=cfg.seed, num_train=cfg.task.num_train,
                        num_validation=cfg.task.num_validation)
    assert (len(splits.train), len(splits.validation)) == (168, 32)
    assert cfg.eval.num_tasks <= len(splits.validation)
    assert not {t.prompt for t in splits.train} & {t.prompt for t in splits.validation}
    score = load_named(cfg.task.reward_fn, key="task.reward_fn")
    rows = [json.loads(line) for line in Path(cfg.task.path).read_text().splitlines()]
    assert all(score(t, row["solution"]) == 1.0 for t, row in zip(splits.train + splits.validation, rows))
    task = splits.train[0]  # "4 9 3 -> 9"
    assert score(task, "9*(4-3)") == 1.0 and score(task, "9*(4-3)+0") == 0.0 and score(task, "nine") == 0.0


def test_jsonl_example_data_is_what_its_script_writes(tmp_path):
    out = tmp_path / "data.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples/jsonl/make_data.py"), "--out", str(out)],
                   check=True, capture_output=True)
    assert out.read_text() == (REPO / "examples/jsonl/data.jsonl").read_text()


def test_jsonl_example_trains(in_repo, tmp_path):
    samples = train("examples/jsonl/train.yaml", tmp_path / "jsonl")
    assert len(samples) == 2 * 2 * 4
    assert {s["reward"] for s in samples} <= {0.0, 1.0}  # examples/jsonl/reward.py:score
    assert all(s["task_id"].startswith("row-") for s in samples)
    assert all([seg["role"] for seg in s["response_segments"]] == ["model"] for s in samples)  # one turn


def test_retry_example_trains_and_marks_the_feedback(in_repo, tmp_path):
    samples = train("examples/retry/train.yaml", tmp_path / "retry")
    assert len(samples) == 2 * 2 * 4
    assert {s["reward"] for s in samples} <= {0.0, 0.5, 1.0}  # discount 0.5, two turns at most
    prompts = {t.id: t.prompt for t in load_tasks("jsonl", path="examples/jsonl/data.jsonl", seed=0,
                                                  num_train=0, num_validation=32).train}
    retried = [s for s in samples if len(s["response_segments"]) > 1]
    assert retried, "the shipped model answers some row wrongly on the first turn"
    for s in retried:
        segments = s["response_segments"]
        assert [seg["role"] for seg in segments] == ["model", "environment", "model"]
        assert "".join(seg["text"] for seg in segments) == s["response"]
        assert segments[1]["text"] == f"\nuser\nwrong, try again: {prompts[s['task_id']]}\nassistant\n"
        assert segments[0]["tokens"] + segments[2]["tokens"] == s["response_tokens"]
    # a first-turn solve has nothing of the environment's
    assert all(len(s["response_segments"]) == 1 for s in samples if s["reward"] == 1.0)


# ------------------------------------------------------------------ names of user files

def test_a_file_path_names_a_function_from_any_working_directory(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my-reward.py").write_text("def score(task, text):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    score = load_named("sub/my-reward.py:score", key="task.reward_fn")
    assert score(None, "") == 1.0
    assert load_named(str(tmp_path / "sub" / "my-reward.py") + ":score", key="k") is score  # loaded once
    assert score.__module__ in sys.modules  # pickling and dataclasses find it


def test_the_console_script_resolves_the_examples_file_paths(in_repo):
    """``asyncrl`` runs with its own directory on sys.path, not the working directory:
    ``examples.jsonl.reward:score`` would not import there, the file path does."""
    code = ("import sys; sys.path.remove('') if '' in sys.path else None; "
            "from asyncrl.plugins import load_named; "
            "print(load_named('examples/jsonl/reward.py:score', key='k').__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "score"


@pytest.mark.parametrize("spec, fragment", [
    ("nowhere/reward.py:score", "file not found"),
    ("examples/jsonl/reward.py:missing", "has no attribute 'missing'"),
    ("examples/jsonl/reward.py", "must look like"),
    ("examples/jsonl/reward.py:", "must look like"),
])
def test_a_bad_file_name_says_what_is_wrong(in_repo, spec, fragment):
    with pytest.raises(ValueError) as info:
        load_named(spec, key="task.reward_fn")
    assert str(info.value).startswith(f"task.reward_fn {spec!r}") and fragment in str(info.value)


def test_a_file_that_fails_to_import_is_not_kept_half_loaded(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_package_here\n")
    with pytest.raises(ValueError, match="cannot import file"):
        load_named(f"{path}:score", key="k")
    path.write_text("def score(task, text):\n    return 0.5\n")
    assert load_named(f"{path}:score", key="k")(None, "") == 0.5


def test_smollm2_example_data_and_reward(in_repo, tmp_path):
    """400 distinct questions, the held-out 64 asked in no training row; the reward takes
    the last number of the reply, whatever the words around it."""
    out = tmp_path / "data.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples/smollm2/make_data.py"), "--out", str(out)],
                   check=True, capture_output=True)
    assert out.read_text() == (REPO / "examples/smollm2/data.jsonl").read_text()
    cfg = load_config("examples/smollm2/train.yaml")
    splits = load_tasks("jsonl", path=cfg.task.path, seed=cfg.seed, num_train=cfg.task.num_train,
                        num_validation=cfg.task.num_validation)
    assert (len(splits.train), len(splits.validation)) == (336, 64) and cfg.eval.num_tasks == 64
    assert not {t.prompt for t in splits.train} & {t.prompt for t in splits.validation}
    score = load_named(cfg.task.reward_fn, key="task.reward_fn")
    task = next(t for t in splits.train if t.id == "add-8-11")
    for reply, reward in [("19", 1.0), ("8 + 11 = 19.", 1.0), ("The answer is 19", 1.0), ("1,019", 0.0),
                          ("19, no wait, 20", 0.0), ("nineteen", 0.0), ("", 0.0), ("8 + 11 = ", 0.0)]:
        assert score(task, reply) == reward, reply


@pytest.mark.slow
def test_smollm2_example_trains_on_the_real_model(in_repo, tmp_path, smollm2_dir):  # noqa: F811 (the fixture)
    """The example as shipped (model.path is the fetched model's name), one small step."""
    samples = train("examples/smollm2/train.yaml", tmp_path / "smollm2", "total_steps=1", "group_size=2",
                    "eval.num_tasks=2", "sampling.max_tokens=8")
    assert len(samples) == 2 * 2 and all(s["task_id"].startswith("add-") for s in samples)
    assert all(s["response_tokens"] <= 8 for s in samples)


@pytest.mark.slow
def test_smollm2_lora_example_ships_only_the_adapters(in_repo, tmp_path, smollm2_dir):  # noqa: F811 (the fixture)
    """examples/smollm2/lora.yaml as shipped, one small step: the sync carries A and B of the
    210 targeted layers (30 decoder layers x q, k, v, o, gate, up, down; r = 16) in float32
    (each one's scale and orientation travel as fields of the typed AdapterUpdate, not as
    tensors), the delivery check passes, the checkpoint is a PEFT adapter."""
    out = tmp_path / "lora"
    train("examples/smollm2/lora.yaml", out, "total_steps=1", "group_size=2", "eval.num_tasks=2",
          "sampling.max_tokens=8")
    # r x (in + out) per decoder layer: hidden 576, k/v 192 (3 of 9 heads), MLP 1536
    per_layer = 16 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_sync/bytes"] for r in rows if "weight_sync/bytes" in r] == [30 * per_layer * 4]
    assert all(r["weight_sync/probe_max_abs_diff"] <= 1e-4 for r in rows if "weight_sync/probe_max_abs_diff" in r)
    final = out / "checkpoints" / "step_1"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
