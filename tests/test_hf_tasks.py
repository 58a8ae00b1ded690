"""``task.name: hf``: a local dataset read through ``datasets`` (``asyncrl/tasks/hf.py``), in
TRL's and verl's schemas, with its held-out split, and rows that do not fit refused by
file, row and column."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")

from asyncrl.config import Config, ConfigError
from asyncrl.rollout.workflows.registry import build_tasks
from asyncrl.tasks import TaskDataError, load_tasks


def verl_rows(n):
    """Rows in verl's schema: prompt as chat messages, the answer in reward_model.ground_truth."""
    return [{"data_source": "countdown", "ability": "math",
             "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i} 1 -> {i + 1}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def trl_rows(n):
    """Rows as a TRL user has them: a text prompt and the columns their reward reads."""
    return [{"prompt": f"{i} 1 -> {i + 1}", "target": i + 1, "numbers": [i, 1]} for i in range(n)]


def hf(path, **kwargs):
    kwargs.setdefault("num_validation", 2)
    return load_tasks("hf", path=str(path), seed=0, num_train=kwargs.pop("num_train", 0), **kwargs)


def test_verl_parquet_gives_chat_prompts_and_its_columns_reach_the_reward(tmp_path):
    datasets.Dataset.from_list(verl_rows(6)).to_parquet(tmp_path / "train.parquet")
    datasets.Dataset.from_list(verl_rows(3)).to_parquet(tmp_path / "test.parquet")
    splits = hf(tmp_path / "train.parquet", validation_path=str(tmp_path / "test.parquet"), num_validation=8)
    assert (len(splits.train), len(splits.validation)) == (6, 3)
    task = splits.train[2]
    assert task.messages == verl_rows(6)[2]["prompt"] and task.id == "train-train-2"
    assert task.data["reward_model"]["ground_truth"] == "3" and task.data["extra_info"]["index"] == 2
    assert {"data_source", "ability"} <= set(task.data) and "prompt" not in task.data
    assert splits.validation[0].id == "test-train-0"  # the file's stem keeps train and validation ids apart


def test_trl_dataset_directory_with_a_test_split_and_text_prompts(tmp_path):
    datasets.DatasetDict(train=datasets.Dataset.from_list(trl_rows(10)),
                         test=datasets.Dataset.from_list(trl_rows(4))).save_to_disk(tmp_path / "set")
    splits = hf(tmp_path / "set", validation_split="test", num_validation=3)
    assert (len(splits.train), len(splits.validation)) == (10, 3)
    assert splits.train[0].messages is None and splits.train[0].prompt == "0 1 -> 1"
    assert splits.train[0].data == {"target": 1, "numbers": [0, 1]}


def test_a_slice_of_the_train_split_is_held_out_and_never_trained_on(tmp_path):
    datasets.Dataset.from_list(trl_rows(10)).save_to_disk(tmp_path / "one")
    splits = hf(tmp_path / "one", validation_split="train[-3:]", num_validation=100)
    assert [t.prompt for t in splits.validation] == ["7 1 -> 8", "8 1 -> 9", "9 1 -> 10"]
    assert len(splits.train) == 7 and not {t.id for t in splits.train} & {t.id for t in splits.validation}
    splits = hf(tmp_path / "one", split="train[:50%]", validation_split="train[50%:]", num_validation=100)
    assert (len(splits.train), len(splits.validation)) == (5, 5)
    splits = hf(tmp_path / "one", num_validation=2, num_train=3)  # neither given: the tail, as jsonl holds out
    assert [t.id for t in splits.validation] == ["one-train-8", "one-train-9"] and len(splits.train) == 3


def test_jsonl_and_arrow_files_and_an_id_column(tmp_path):
    rows = [dict(r, id=f"q{i}") for i, r in enumerate(trl_rows(5))]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [t.id for t in hf(tmp_path / "d.jsonl").validation] == ["q3", "q4"]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "arrowdir")
    arrow = next((tmp_path / "arrowdir").glob("*.arrow"))
    assert [t.prompt for t in hf(arrow).train] == ["0 1 -> 1", "1 1 -> 2", "2 1 -> 3"]


@pytest.mark.parametrize("bad, column, expected", [
    ({"prompt": ""}, "prompt", "found an empty string"),
    ({"prompt": [{"role": "user"}]}, "prompt", "list of chat messages"),
    ({"reward_model": {"style": "rule"}}, "reward_model", "verl's {'ground_truth': ...}"),
])
def test_a_row_that_does_not_fit_names_the_file_row_and_column(tmp_path, bad, column, expected):
    rows = verl_rows(6)
    rows[4] = {**rows[4], **bad}
    rows[5] = {**rows[5], **bad}
    if column == "prompt" and isinstance(bad["prompt"], str):  # one column type for the whole file
        rows = [{**r, "prompt": r["prompt"][1]["content"]} if i < 4 else r for i, r in enumerate(rows)]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "v.parquet")
    with pytest.raises(TaskDataError) as refused:
        hf(tmp_path / "v.parquet")
    message = str(refused.value)
    assert f"v.parquet (split 'train'), row 4, column {column!r}" in message and expected in message
    assert "(1 more rows fail the same way: 5)" in message and "nothing was skipped" in message


def test_what_is_not_there_is_named_and_nothing_is_downloaded(tmp_path):
    with pytest.raises(TaskDataError, match="reads local datasets only and downloads nothing.*save_to_disk"):
        hf("openai/gsm8k")
    datasets.Dataset.from_list(trl_rows(5)).save_to_disk(tmp_path / "one")
    with pytest.raises(TaskDataError, match="has no split 'test'; its splits: train"):
        hf(tmp_path / "one", validation_split="test")
    with pytest.raises(TaskDataError, match="no column 'question'.*its columns: prompt, target, numbers"):
        hf(tmp_path / "one", options={"prompt_key": "question"})
    with pytest.raises(TaskDataError, match="expected a split name with an optional slice"):
        hf(tmp_path / "one", validation_split="train[1:2:3]")


def test_the_config_refuses_chat_prompts_without_the_chat_template(tmp_path):
    datasets.Dataset.from_list(verl_rows(4)).to_parquet(tmp_path / "v.parquet")
    cfg = Config.model_validate({"task": {"name": "hf", "path": str(tmp_path / "v.parquet"), "num_validation": 1},
                                 "workflow": {"use_chat_template": False}})
    with pytest.raises(ConfigError, match="use_chat_template=false, but task 'v-train-0' .*chat messages"):
        build_tasks(cfg)


def test_verl_s_prompt_key_names_another_column_and_split_keys_belong_to_hf(tmp_path):
    rows = [{"question": r["prompt"], "target": r["target"]} for r in trl_rows(4)]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "q.parquet")
    splits = hf(tmp_path / "q.parquet", options={"prompt_key": "question"}, num_validation=1)
    assert splits.train[0].prompt == "0 1 -> 1" and splits.train[0].data == {"target": 1}
    with pytest.raises(TaskDataError, match="unknown task.options \\['prompt'\\]; it takes prompt_key"):
        hf(tmp_path / "q.parquet", options={"prompt": "question"})
    with pytest.raises(ValueError, match="`split`/`validation_split` only apply to 'hf'"):
        load_tasks("countdown", seed=0, num_train=4, num_validation=2, validation_split="test")
