"""The README's promises that a test can keep: CI runs exactly its test command, and the
files and keys it names exist."""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.config import Config, all_keys

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_after(heading: str) -> str:
    rest = README[README.index(heading):]
    return re.search(r"```bash\n(.*?)\n```", rest, re.S).group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = code_after("Run the tests")
    assert command.endswith("python -m pytest")
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_design_document_is_in_the_repository_and_linked():
    assert "(docs/design.md)" in README and (ROOT / "docs" / "design.md").is_file()
    assert "DESIGN.md" not in README


def test_config_keys_the_readme_names_exist():
    keys = set(all_keys(Config))
    named = set(re.findall(r"`((?:rollout|watchdog|hooks|eval|logging|workflow)\.[a-z_]+)(?:=[^`]*)?`", README))
    named = {k for k in named if k.rsplit(".", 1)[1] not in ("py", "json", "yaml", "jsonl")}  # files, not keys
    assert named and named <= keys, named - keys
