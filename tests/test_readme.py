"""The README's promises that a test can keep: CI runs exactly its test command, it links
the design document, and the config keys it and the pages under docs/ name exist (the
README is the front page; most of what it used to say moved to docs/*.md, where these
checks follow it; tests/test_docs.py checks the links and the generated config page)."""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.config import Config, all_keys

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The front page and every page it leads to, but the generated key reference (which names
# every key by construction: tests/test_docs.py checks it against the schema).
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if path.name != "config.md"}
# `section.word` spans in those pages that are not config keys: files, the transformers
# method, and the fields of the task an agent is handed (docs/agents.md).
NOT_KEYS = {"model.generate", "task.id", "task.prompt", "task.data"}
FILE_SUFFIXES = ("py", "json", "yaml", "jsonl")


def code_after(heading: str) -> str:
    rest = README[README.index(heading):]
    return re.search(r"```bash\n(.*?)\n```", rest, re.DOTALL).group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = code_after("Run the tests")
    assert command.endswith("python -m pytest")
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


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
