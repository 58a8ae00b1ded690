"""Config errors exit 2 naming the key; `asyncrl eval` end to end on a tiny saved policy."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config
from asyncrl.tiny import build_tiny_model, save_tiny_policy


def write(tmp_path, data, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("override, fragment", [
    ("sampling.temprature=0.5", "unknown config key 'sampling.temprature'; did you mean 'sampling.temperature'?"),
    ("eval.samples_per_tsk=3", "did you mean 'eval.samples_per_task'?"),
    ("sampling.max_tokens=many", "config key 'sampling.max_tokens'"),
    ("eval.samples_per_task=0", "config key 'eval.samples_per_task'"),
    ("sampling.top_p=1.5", "config key 'sampling.top_p'"),
    ("model=3", "config key 'model'"),
    ("engine=tensorflow", "config key 'engine'"),
    ("noequals", "not of the form key=value"),
])
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert fragment in str(info.value)


def test_yaml_and_overrides_merge(tmp_path):
    path = write(tmp_path, {"seed": 3, "sampling": {"temperature": 0.5}})
    cfg = load_config(path, ["sampling.max_tokens=7", "task.name=arithmetic"])
    assert (cfg.seed, cfg.sampling.temperature, cfg.sampling.max_tokens, cfg.task.name) == (3, 0.5, 7, "arithmetic")
    assert isinstance(cfg.sampling.temperature, float)


def test_unknown_key_in_file_exits_2(tmp_path, capsys):
    path = write(tmp_path, {"sampling": {"temprature": 0.5}})
    assert main(["eval", str(path)]) == 2
    err = capsys.readouterr().err
    assert "sampling.temprature" in err and "sampling.temperature" in err


@pytest.mark.parametrize("content, fragment", [("a: [1, 2", "not valid YAML"), ("- 1\n- 2\n", "must hold a mapping")])
def test_malformed_files_exit_2(tmp_path, capsys, content, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert main(["eval", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_missing_config_and_model_exit_2(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    path = write(tmp_path, {"model": {"path": str(tmp_path / "no-model")}})
    assert main(["eval", str(path)]) == 2
    assert "model.path" in capsys.readouterr().err


def test_non_causal_lm_exits_2(tmp_path, capsys):
    from transformers import BertConfig

    BertConfig(architectures=["BertModel"]).save_pretrained(tmp_path / "bert")
    path = write(tmp_path, {"model": {"path": str(tmp_path / "bert")}})
    assert main(["eval", str(path)]) == 2
    assert "not a causal LM" in capsys.readouterr().err


def test_bad_reward_fn_exits_2(tmp_path, char_tokenizer, capsys):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=0)
    save_tiny_policy(model, tokenizer, tmp_path / "policy")
    path = write(tmp_path, {"model": {"path": str(tmp_path / "policy")}, "task": {"reward_fn": "nosuchmod:fn"}})
    assert main(["eval", str(path)]) == 2
    assert "task.reward_fn" in capsys.readouterr().err


def test_eval_end_to_end(tmp_path, char_tokenizer):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=0)
    save_tiny_policy(model, tokenizer, tmp_path / "policy")
    out = tmp_path / "run"
    path = write(tmp_path, {"model": {"path": str(tmp_path / "policy")}, "output_dir": str(out),
                            "task": {"name": "arithmetic", "num_train": 20, "num_validation": 10},
                            "sampling": {"max_tokens": 4}, "eval": {"num_tasks": 5, "samples_per_task": 3}})
    assert main(["eval", str(path), "eval.temperature=1.0"]) == 0
    scores = json.loads((out / "eval.json").read_text())
    assert {"mean_reward", "pass@1", "pass@3", "num_tasks", "samples_per_task"} <= set(scores)
    assert scores["num_tasks"] == 5 and scores["samples_per_task"] == 3
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 15
    assert sum(r["reward"] for r in rows) / 15 == pytest.approx(scores["mean_reward"])
    assert all(len(r["trajectories"][0]["response_ids"]) <= 4 for r in rows)
    assert yaml.safe_load((out / "config.yaml").read_text())["eval"]["samples_per_task"] == 3


def test_bad_dataset_row_exits_2_naming_the_line(tmp_path, char_tokenizer, capsys):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=0)
    save_tiny_policy(model, tokenizer, tmp_path / "policy")
    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": 5}\n')
    path = write(tmp_path, {"model": {"path": str(tmp_path / "policy")},
                            "task": {"name": "jsonl", "path": str(data),
                                     "reward_fn": "asyncrl.tasks:arithmetic_reward"}})
    assert main(["eval", str(path)]) == 2
    err = capsys.readouterr().err
    assert "mine.jsonl" in err and "line 2" in err


@pytest.mark.parametrize("overrides, fragment", [
    (["mode=sync", "partial_rollout=abort"], "set partial_rollout=off"),
    (["mode=sync", "sync_every=2"], "use sync_every <= 1"),
    (["mode=async", "max_staleness=-1"], "config key 'max_staleness'"),
    (["mode=async", "max_staleness=1", "sync_every=3"], "use sync_every <= 2"),
    (["batch_size=3", "group_size=4", "optim.micro_batch_size=5"], "optim.micro_batch_size=5 does not divide"),
    (["engine=vllm", "sampling.top_k=5"], "set sampling.top_k=0"),
])
def test_contradictions_are_refused(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert fragment in str(info.value)


def test_yaml_off_means_off(tmp_path):
    cfg = load_config(write(tmp_path, {"mode": "one_step_off", "partial_rollout": False}))
    assert cfg.partial_rollout == "off" and cfg.effective_max_staleness == 1


def test_the_schedule_keys_read_the_same_at_the_top_level_or_in_a_schedule_block(tmp_path, capsys):
    top, block = tmp_path / "top.yaml", tmp_path / "block.yaml"
    top.write_text("mode: one_step_off\npartial_rollout: continue\nsync_every: 2\n")
    block.write_text("schedule:\n  mode: one_step_off\n  partial_rollout: continue\n  sync_every: 2\n")
    a, b = load_config(top), load_config(block)
    assert a.schedule == b.schedule and (a.mode, a.sync_every, a.effective_max_staleness) == ("one_step_off", 2, 1)
    assert a.model_dump() == b.model_dump() and "schedule" not in a.model_dump()  # config.yaml keeps the names
    assert load_config(block, ["mode=async", "schedule.max_staleness=4"]).effective_max_staleness == 4
    both = tmp_path / "both.yaml"
    both.write_text("mode: async\nschedule:\n  mode: sync\n")
    assert main(["train", str(both)]) == 2
    assert "'mode' is given twice, as mode and as schedule.mode; keep one" in capsys.readouterr().err


def test_unknown_algorithm_exits_2(tmp_path, char_tokenizer, capsys):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=0)
    save_tiny_policy(model, tokenizer, tmp_path / "policy")
    path = write(tmp_path, {"model": {"path": str(tmp_path / "policy")}, "algorithm": {"advantage": "grpoo"}})
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "algorithm.advantage" in err and "grpo" in err


def test_tokenizer_without_chat_template_is_refused(tmp_path, char_tokenizer, capsys):
    model, tokenizer = build_tiny_model(char_tokenizer, seed=0)
    save_tiny_policy(model, tokenizer, tmp_path / "policy")
    config = tmp_path / "policy" / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    (tmp_path / "policy" / "chat_template.jinja").unlink(missing_ok=True)
    path = write(tmp_path, {"model": {"path": str(tmp_path / "policy")}})
    for command in ("train", "eval"):
        assert main([command, str(path)]) == 2
        assert "no chat template" in capsys.readouterr().err
    assert main(["eval", str(path), "workflow.use_chat_template=false", "eval.num_tasks=2",
                 "eval.samples_per_task=1", f"output_dir={tmp_path / 'raw'}"]) == 0


def test_vllm_engine_without_vllm_exits_2(tmp_path, policy_dir, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    path = write(tmp_path, {"model": {"path": str(policy_dir)}, "engine": "vllm"})
    assert main(["train", str(path), f"output_dir={tmp_path / 'run'}"]) == 2
    assert "engine=vllm needs vLLM" in capsys.readouterr().err


def test_scientific_notation_is_a_float(tmp_path):
    """YAML 1.1 would read 3e-4 as a string and the config would refuse it."""
    assert load_config(None, ["optim.lr=3e-4"]).optim.lr == 3e-4
    assert load_config(write(tmp_path, {}, "x.yaml").parent / "x.yaml", []).optim.lr == 1e-3
    path = tmp_path / "lr.yaml"
    path.write_text("optim:\n  lr: 5e-4\n  micro_batch_size: 8\n")
    cfg = load_config(path, [])
    assert cfg.optim.lr == 5e-4 and cfg.optim.micro_batch_size == 8


def test_a_bad_key_fails_before_torch_loads():
    """Checked in a fresh interpreter: the config is read and refused before torch (or
    transformers) is imported, so a typo costs well under the import of torch alone."""
    import subprocess
    import sys
    import time

    probe = ("import sys; from asyncrl.cli import main; "
             "code = main(['train', 'examples/countdown/async.yaml', 'task.num_validaton=3']); "
             "sys.exit(10 + code if 'torch' in sys.modules or 'transformers' in sys.modules else code)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    bad_key_s = time.perf_counter() - start
    assert done.returncode == 2, done.stderr  # 12 would mean: refused, but only after torch loaded
    assert "'task.num_validaton'; did you mean 'task.num_validation'?" in done.stderr
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    assert bad_key_s < time.perf_counter() - start


def test_keys_are_listed_with_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--keys"])
    assert info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "task.num_validation = 128" in lines and "watchdog.stall_s = 300.0" in lines


def test_task_options_reach_the_generator_and_typos_exit_2(tmp_path, policy_dir, capsys):
    from asyncrl.rollout.workflows.registry import build_tasks

    cfg = load_config(None, ["task.options={num_numbers: 4}", "task.num_train=5", "task.num_validation=2"])
    assert all(len(t.data["numbers"]) == 4 for t in build_tasks(cfg).train)
    code = main(["eval", "examples/countdown/eval.yaml", f"model.path={policy_dir}", f"output_dir={tmp_path}",
                 "task.options={num_numbrs: 4}"])
    assert code == 2 and "num_numbrs" in capsys.readouterr().err
