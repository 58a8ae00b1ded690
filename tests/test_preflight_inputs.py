"""Pre-flight's first phase (``asyncrl/orchestrator/inputs.py``): a mistake in the data, a
column, a reward or an agent path is refused with exit 2, naming the culprit, before the
trainer (and with it torch and the weights) is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.cli import main

JSONL = ["train", "examples/jsonl/train.yaml"]
AGENT = ["train", "examples/openai_agent/train.yaml"]


@pytest.fixture
def no_weights(monkeypatch):
    """The trainer and the eval command cannot be imported: a case that exits 2 here was
    refused before anything that loads torch or the model ran (it would exit 1)."""
    for name in ("asyncrl.orchestrator.trainer", "asyncrl.orchestrator.eval_command"):
        monkeypatch.setitem(sys.modules, name, None)


def refused(capsys, *args: str) -> str:
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


def test_a_missing_data_file_is_named(tmp_path, capsys, no_weights):
    err = refused(capsys, *JSONL, f"output_dir={tmp_path / 'o'}", f"task.path={tmp_path / 'nope.jsonl'}")
    assert "task file not found" in err and "nope.jsonl" in err


def test_a_row_without_its_prompt_is_named_with_file_and_line(tmp_path, capsys, no_weights):
    rows = Path("examples/jsonl/data.jsonl").read_text().splitlines()
    rows[3] = '{"id": "row-003", "numbers": [1, 2], "target": 3}'
    data = write(tmp_path / "data.jsonl", "\n".join(rows) + "\n")
    err = refused(capsys, *JSONL, f"output_dir={tmp_path / 'o'}", f"task.path={data}")
    assert "data.jsonl, line 4" in err and "'prompt'" in err


def test_a_trl_reward_column_the_jsonl_lacks_is_named(tmp_path, capsys, no_weights):
    reward = write(tmp_path / "r.py", """
        def needs_answer(completions, answer, **kwargs):
            return [0.0 for _ in completions]
        """)
    err = refused(capsys, *JSONL, f"output_dir={tmp_path / 'o'}", f"task.reward_fn={reward}:needs_answer")
    assert "task.reward_fn" in err and "'answer'" in err and "needs_answer" in err and "its columns:" in err


def test_an_hf_prompt_column_that_is_not_there_is_named(tmp_path, capsys, no_weights):
    pytest.importorskip("datasets")
    err = refused(capsys, "train", "examples/from_verl/train.yaml", f"output_dir={tmp_path / 'o'}",
                  "task.options.prompt_key=question")
    assert "train.parquet" in err and "no column 'question'" in err and "task.options.prompt_key" in err


def test_a_verl_reward_over_a_trl_dataset_names_the_missing_column(tmp_path, capsys, no_weights):
    pytest.importorskip("datasets")
    err = refused(capsys, "train", "examples/from_trl/train.yaml", f"output_dir={tmp_path / 'o'}",
                  "task.reward_fn=examples/from_verl/reward.py:compute_score")
    assert "compute_score" in err and "column 'reward_model'" in err


def test_a_reward_module_that_does_not_exist_is_named(tmp_path, capsys, no_weights):
    err = refused(capsys, *JSONL, f"output_dir={tmp_path / 'o'}", "task.reward_fn=nowhere_at_all:score")
    assert "task.reward_fn" in err and "cannot import module 'nowhere_at_all'" in err


def test_a_module_without_the_function_names_it_and_the_closest(tmp_path, capsys, no_weights):
    err = refused(capsys, *JSONL, f"output_dir={tmp_path / 'o'}", "task.reward_fn=examples/jsonl/reward.py:scor")
    assert "no attribute 'scor'" in err and "did you mean 'examples/jsonl/reward.py:score'" in err


def test_a_reward_with_a_wrong_signature_is_named_with_it(tmp_path, capsys, no_weights):
    reward = write(tmp_path / "r.py", """
        def grade(response):
            return 1.0
        """)
    err = refused(capsys, *JSONL, f"output_dir={tmp_path / 'o'}", f"task.reward_fn={reward}:grade")
    assert "grade(response)" in err and "none of the reward forms" in err


def test_a_wrong_agent_path_is_named(tmp_path, capsys, no_weights):
    err = refused(capsys, *AGENT, f"output_dir={tmp_path / 'o'}", "workflow.agent=examples/openai_agent/agent.py:rum")
    assert "workflow.agent" in err and "no attribute 'rum'" in err and "'examples/openai_agent/agent.py:run'" in err


def test_an_agent_that_cannot_take_task_and_base_url_is_named(tmp_path, capsys, no_weights):
    agent = write(tmp_path / "a.py", """
        async def run(task):
            return 1.0
        """)
    err = refused(capsys, *AGENT, f"output_dir={tmp_path / 'o'}", f"workflow.agent={agent}:run")
    assert "workflow.agent" in err and "run(task)" in err and "(task, base_url)" in err


def test_an_agent_class_is_checked_through_its_run_method(tmp_path, capsys, no_weights):
    agent = write(tmp_path / "a.py", """
        class Agent:
            def run(self, task, base_url, extra):
                return 1.0
        """)
    err = refused(capsys, *AGENT, f"output_dir={tmp_path / 'o'}", f"workflow.agent={agent}:Agent")
    assert "Agent.run(self, task, base_url, extra)" in err


def test_eval_checks_its_inputs_first_too(tmp_path, capsys, no_weights):
    err = refused(capsys, "eval", "examples/jsonl/train.yaml", f"output_dir={tmp_path / 'o'}",
                  "task.reward_fn=nowhere_at_all:score")
    assert "nowhere_at_all" in err


@pytest.mark.slow
def test_the_checks_import_no_torch():
    """Run in a fresh process: this one has torch loaded by other tests."""
    code = textwrap.dedent("""
        import sys
        from asyncrl.cli import main
        code = main(["train", "examples/jsonl/train.yaml", "output_dir=/nonexistent/o", "task.reward_fn=nowhere:f"])
        heavy = [m for m in ("torch", "transformers", "numpy") if m in sys.modules]
        print(code, heavy)
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.stdout.strip() == "2 []", result.stdout + result.stderr
