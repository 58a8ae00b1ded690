"""The README's promises that a test can keep: CI runs its test command as written, it links
the design document, its commands run top to bottom after the main one, and the config
keys it and the pages under docs/ name exist (the
README is the front page; most of what it used to say moved to docs/*.md, where these
checks follow it; tests/test_docs.py checks the links and the generated config page)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from asyncrl.config import Config, all_keys, load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The front page and every page it leads to, but the generated key reference (which names
# every key by construction: tests/test_docs.py checks it against the schema).
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if path.name != "config.md"}
# `section.word` spans in those pages that are not config keys: files, the transformers
# method, the fields of the task an agent is handed (docs/agents.md), and verl's own key in
# docs/usage.md's table of TRL / verl / asyncrl keys.
NOT_KEYS = {"model.generate", "task.id", "task.prompt", "task.data", "algorithm.adv_estimator"}
FILE_SUFFIXES = ("py", "json", "yaml", "jsonl", "safetensors")


def code_after(heading: str) -> str:
    rest = README[README.index(heading):]
    return re.search(r"```bash\n(.*?)\n```", rest, re.DOTALL).group(1).strip()


FAST_TIER = 'python -m pytest -m "not slow"'
SECOND_TIER = "python -m pytest -m slow"


def test_ci_runs_the_readme_test_command_then_the_second_tier_it_names():
    """The README's test command is the fast tier; CI runs it as written, then the second
    tier, which the README names (with its time) so that a newcomer knows what CI adds."""
    command = code_after("Run the tests")
    assert command.endswith(f"&& {FAST_TIER}")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci and SECOND_TIER in ci
    assert ci.index(SECOND_TIER) > ci.index(command)
    assert f"`{SECOND_TIER}`" in README


def test_the_design_document_is_in_the_repository_and_linked():
    assert "(docs/design.md)" in README and (ROOT / "docs" / "design.md").is_file()
    assert "DESIGN.md" not in README


def test_config_keys_the_pages_name_exist():
    keys = set(all_keys(Config))
    sections = sorted({key.split(".")[0] for key in keys if "." in key})
    assert {"rollout", "watchdog", "hooks", "eval", "logging", "workflow", "optim", "vllm"} <= set(sections)
    pattern = re.compile(rf"`((?:{'|'.join(sections)})\.[a-z_]+)(?:=[^`]*)?`")
    for page, text in PAGES.items():
        named = {k for k in pattern.findall(text) if k.rsplit(".", 1)[1] not in FILE_SUFFIXES} - NOT_KEYS
        assert named <= keys, f"{page} names config keys that do not exist: {sorted(named - keys)}"
    named_anywhere = {k for text in PAGES.values() for k in pattern.findall(text)}
    assert len(named_anywhere & keys) >= 40, "the pages stopped naming config keys: is the pattern broken?"


def checkpoints_kept(cfg: Config, start: int, kept: list[int]) -> list[int]:
    """The checkpoint steps on disk after a run from ``start`` to ``cfg.total_steps``."""
    saved = [s for s in range(start + 1, cfg.total_steps) if cfg.save_every and s % cfg.save_every == 0]
    return [*kept, *saved, cfg.total_steps][-cfg.keep_last:]


def check_in_order(lines: list[str]) -> int:
    """Follow the commands' output directories as if run top to bottom; returns how many ran."""
    runs: dict[Path, tuple[int, list[int]]] = {}  # output_dir -> (steps done, checkpoint steps on disk)
    checked = 0
    for line in lines:
        words = shlex.split(line.split("#")[0])
        if words[:2] not in (["asyncrl", "train"], ["asyncrl", "eval"]):
            continue
        cfg, checked = load_config(ROOT / words[2], words[3:]), checked + 1
        out = Path(cfg.output_dir)
        if words[1] == "eval" and Path(cfg.model.path).parent.name == "checkpoints":
            step, run = int(Path(cfg.model.path).name.removeprefix("step_")), Path(cfg.model.path).parent.parent
            assert step in runs.get(run, (0, []))[1], f"{line}: no command before it leaves that checkpoint"
        if cfg.resume:
            assert out in runs, f"{line}: resumes {out}, which no command before it wrote"
            done, kept = runs[out]
            assert cfg.total_steps > done, f"{line}: {out} is finished at step {done}; this resume trains nothing"
            runs[out] = (cfg.total_steps, checkpoints_kept(cfg, done, kept))
        else:
            assert out not in runs, f"{line}: {out} is the output_dir of a command before it (a used one is refused)"
            runs[out] = (cfg.total_steps, checkpoints_kept(cfg, 0, []) if words[1] == "train" else [])
    return checked


def test_the_commands_run_top_to_bottom_after_the_main_command():
    """Each `asyncrl train` and `asyncrl eval` of "Using it" (and of docs/usage.md's list, which
    opens with the main command) writes an output_dir no command before it wrote — a used one
    is refused, and an evaluation's would overwrite a run's config.yaml — unless it resumes a
    run that one of them made, with a larger total_steps than that run has done; a checkpoint
    evaluated is still on disk (keep_last) when its command runs."""
    main = code_after("Set-up: two commands").split("&& ")[-1]
    assert main == "asyncrl train examples/countdown/async.yaml"
    assert check_in_order([main, *code_after("## Using it").splitlines()]) >= 7
    usage = re.search(r"```bash\n(.*?)\n```", (ROOT / "docs" / "usage.md").read_text(), re.DOTALL).group(1)
    assert usage.splitlines()[0].startswith(f"{main} ")
    assert check_in_order(usage.splitlines()) >= 8


def test_the_order_checker_sees_a_collision_and_a_resume_of_a_finished_run():
    main = "asyncrl train examples/countdown/async.yaml"
    with pytest.raises(AssertionError, match="output_dir of a command before it"):
        check_in_order([main, f"{main} optim.lr=1e-4"])
    with pytest.raises(AssertionError, match="finished at step 600"):
        check_in_order([main, f"{main} save_every=50 resume=true"])
    with pytest.raises(AssertionError, match="no command before it leaves that checkpoint"):
        check_in_order([main, f"{main} resume=true total_steps=800 save_every=50",
                        "asyncrl eval examples/countdown/eval.yaml "
                        "model.path=runs/countdown-async/checkpoints/step_600"])
