"""Figures in the docs match the code that made them: each figure of a shipped command is
listed in docs/figures.yaml with the day and commit of its sitting and the files its
command reads; a figure whose command's config or example changed in a later commit has
drifted and must be measured again (a newcomer once found the OpenAI-SDK agent example
documented at 0.006 → 0.443 where the code of the day gave 0.035 → 0.2)."""

from __future__ import annotations

import re
import subprocess
from datetime import date
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "docs" / "figures.yaml"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def entries() -> list[dict]:
    return yaml.safe_load(MANIFEST.read_text())


def substantive(diff: str) -> bool:
    """A diff that changes more than comments and blank lines (a binary file's always does)."""
    for line in diff.splitlines():
        if line.startswith(("+++", "---")) or not line.startswith(("+", "-")):
            if line.startswith("Binary files"):
                return True
            continue
        text = line[1:].strip()
        if text and not text.startswith("#"):
            return True
    return False


def drift(entry: dict) -> list[str]:
    """The commits after the figure's that changed a file its command reads beyond its
    comments (newest first): a comment says things, it does not change what the command does."""
    changed = []
    for line in git("log", "--format=%h %s", f"{entry['commit']}..HEAD", "--", *entry["reads"]).splitlines():
        commit = line.split()[0]
        if substantive(git("show", "--format=", "-U0", commit, "--", *entry["reads"])):
            changed.append(line)
    return changed


def test_each_figure_says_its_date_and_commit_where_the_doc_shows_it():
    for entry in entries():
        assert set(entry) >= {"doc", "command", "date", "commit", "says", "reads"}, entry
        text = (ROOT / entry["doc"]).read_text()
        assert entry["says"] in text, f"{entry['doc']} no longer says {entry['says']!r}"
        day = entry["date"] if isinstance(entry["date"], date) else date.fromisoformat(entry["date"])
        assert day.isoformat() in entry["says"] and entry["commit"] in entry["says"], entry
        assert re.fullmatch(r"[0-9a-f]{7,40}", entry["commit"]), entry
        for path in entry["reads"]:
            assert (ROOT / path).exists(), f"{entry['command']}: {path} does not exist"


def test_no_figure_predates_a_change_to_what_its_command_reads():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the history that dates each figure is not here")
    if git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: the figures' commits are not in its history (git fetch --unshallow)")
    drifted = []
    for entry in entries():
        if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{entry['commit']}^{{commit}}"],
                          capture_output=True).returncode != 0:
            drifted.append(f"{entry['doc']}: `{entry['command']}`: commit {entry['commit']} is not in this history")
            continue
        if changes := drift(entry):
            drifted.append(f"{entry['doc']}: `{entry['command']}` measured on {entry['commit']} ({entry['date']}), "
                           f"but {', '.join(entry['reads'])} changed since: {changes[-1]} (+{len(changes) - 1} more)"
                           " — measure it again and update the figure and docs/figures.yaml")
    assert drifted == []


def test_the_check_sees_a_drifted_figure():
    """A figure dated at the first commit that touched the countdown example predates the
    example's later changes; one dated at the last does not."""
    if git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: no history to date figures by")
    touched = git("log", "--format=%h", "--reverse", "--", "examples/countdown").splitlines()
    assert len(touched) >= 2
    assert drift({"commit": touched[0], "reads": ["examples/countdown"]})
    assert not drift({"commit": touched[-1], "reads": ["examples/countdown"]})
    assert not substantive("--- a/x.yaml\n+++ b/x.yaml\n@@ -1 +1 @@\n-# old figure\n+# new words\n+\n")
    assert substantive("@@ -3 +3 @@\n-total_steps: 50\n+total_steps: 60\n")
