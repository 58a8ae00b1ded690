"""Figures in the docs match the code that made them: each figure of a shipped command is
listed in docs/figures.yaml with the day and commit of its sitting and the files its
command reads; a figure whose command's config or example changed in a later commit has
drifted and must be measured again (a newcomer once found the OpenAI-SDK agent example
documented at 0.006 → 0.443 where the code of the day gave 0.035 → 0.2).

A drifted figure may stay only where the doc says so beside it: its entry's optional
``not_remeasured`` names that caveat's text (it must say "not re-measured" and stand within
a few lines of the figure's date and commit), so a reader knows the number is of older code.
An entry with the caveat whose files have not changed fails too: the caveat would be false."""

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
        assert {"doc", "command", "date", "commit", "says", "reads"} <= set(entry) <= {
            "doc", "command", "date", "commit", "says", "reads", "not_remeasured"}, entry
        text = (ROOT / entry["doc"]).read_text()
        assert entry["says"] in text, f"{entry['doc']} no longer says {entry['says']!r}"
        assert isinstance(entry["commit"], str), f"{entry}: quote the commit (YAML reads 7700020 as a number)"
        day = entry["date"] if isinstance(entry["date"], date) else date.fromisoformat(entry["date"])
        assert day.isoformat() in entry["says"] and entry["commit"] in entry["says"], entry
        assert re.fullmatch(r"[0-9a-f]{7,40}", entry["commit"]), entry
        for path in entry["reads"]:
            assert (ROOT / path).exists(), f"{entry['command']}: {path} does not exist"


CAVEAT = "not re-measured"  # what a `not_remeasured` text must say
NEAR = 400  # characters between a figure's `says` and its caveat, at most


def caveat_problem(entry: dict, text: str) -> str | None:
    """What is wrong with an entry's `not_remeasured` caveat in its doc's ``text``, if anything."""
    caveat = entry["not_remeasured"]
    if CAVEAT not in caveat:
        return f"its caveat {caveat!r} does not say {CAVEAT!r}"
    says = [m.start() for m in re.finditer(re.escape(entry["says"]), text)]
    if not any(abs(m.start() - at) <= NEAR for m in re.finditer(re.escape(caveat), text) for at in says):
        return f"{entry['doc']} does not say {caveat!r} beside {entry['says']!r}"
    return None


def problem(entry: dict, text: str) -> str | None:
    """Why an entry's figure cannot stand as the doc (``text``) shows it, or None: its commit
    is not in this history; its command's files changed since and the doc does not say so
    beside the figure; or the doc says so and they did not (a false caveat)."""
    name = f"{entry['doc']}: `{entry['command']}`"
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{entry['commit']}^{{commit}}"],
                      capture_output=True).returncode != 0:
        return f"{name}: commit {entry['commit']} is not in this history"
    changes = drift(entry)
    if "not_remeasured" in entry:
        if not changes:
            return (f"{name}: marked not re-measured, but nothing it reads changed since {entry['commit']}"
                    " — remove `not_remeasured` from its entry and its caveat from the doc")
        return caveat_problem(entry, text)
    if changes:
        return (f"{name} measured on {entry['commit']} ({entry['date']}), but {', '.join(entry['reads'])} "
                f"changed since: {changes[-1]} (+{len(changes) - 1} more) — measure it again and update the"
                " figure and docs/figures.yaml, or say beside the figure that it was not re-measured"
                " (`not_remeasured`)")
    return None


def test_no_figure_predates_a_change_to_what_its_command_reads():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the history that dates each figure is not here")
    if git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: the figures' commits are not in its history (git fetch --unshallow)")
    found = [problem(entry, (ROOT / entry["doc"]).read_text()) for entry in entries()]
    assert [p for p in found if p] == []


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


def test_a_drifted_figure_stands_only_with_its_caveat_and_a_caveat_only_on_drift():
    """Dated at the countdown example's first commit, a figure has drifted: it fails bare and
    passes with its caveat beside it; dated at the last, it passes bare and fails with one."""
    if git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: no history to date figures by")
    touched = git("log", "--format=%h", "--reverse", "--", "examples/countdown").splitlines()
    old, new = touched[0], touched[-1]
    doc = (f"0.2 → 0.4 (2026-11-21, recorded in commit {old}; its example changed since, not re-measured)\n"
           f"0.2 → 0.5 (2026-11-28 on commit {new})\n")
    base = {"doc": "x.md", "command": "asyncrl train examples/countdown/async.yaml", "date": "2026-11-21",
            "reads": ["examples/countdown"]}
    drifted = {**base, "commit": old, "says": f"2026-11-21, recorded in commit {old}"}
    fresh = {**base, "commit": new, "says": f"2026-11-28 on commit {new}"}
    caveat = {"not_remeasured": "its example changed since, not re-measured"}
    assert "measure it again" in problem(drifted, doc)
    assert problem({**drifted, **caveat}, doc) is None
    assert problem(fresh, doc) is None
    assert "remove `not_remeasured`" in problem({**fresh, **caveat}, doc)
    # the caveat must be in the doc, beside its figure, and say that it was not re-measured
    assert "does not say" in problem({**drifted, **caveat}, doc.split("\n")[0][:60])
    far = doc.replace("; its example", ")" + " " * NEAR + "(its example")
    assert "beside" in problem({**drifted, **caveat}, far)
    assert "does not say 'not re-measured'" in problem({**drifted, "not_remeasured": "its example changed"}, doc)
