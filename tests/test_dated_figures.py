"""No date in the code's prose: a figure written down with the day it was measured rots
there (the code changes under it, the date stays), so the code keeps the reason and the
docs keep the figure, dated (docs/design.md, "Measurements behind choices in the code").
Checked: every comment and every docstring under ``asyncrl/`` (a config field's docstring
is its description in docs/config.md, which is generated from them and checked too).
String values the code uses (a prompt, a test sentence) are data, not prose: not checked."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import asyncrl

ROOT = Path(asyncrl.__file__).parent
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
DATE = re.compile(rf"\b20\d\d-[01]\d(?:-[0-3]\d)?\b|\b{MONTH} (?:[0-3]?\d, )?20\d\d\b|\b[0-3]?\d {MONTH} 20\d\d\b")


def prose(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each comment and each line of each docstring (a string standing
    alone as a statement: a module's, a class's, a function's, an attribute's)."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return sorted(found)


def dated(source: str) -> list[tuple[int, str]]:
    return [(line, text.strip()) for line, text in prose(source) if DATE.search(text)]


def test_the_checker_sees_a_date_in_a_comment_or_a_docstring_and_not_in_data():
    source = ('"""Fast (2026-11-27: 3 s)."""\n'
              'X = 1  # measured 27 Nov 2026\n'
              'Y = 2\n'
              '"""Y: since Nov 2026."""\n'
              'PROMPT = "sold on 2024-03-05"\n'
              'def f():\n'
              '    """Two lines,\n    the second of 2026-11."""\n')
    assert [line for line, _ in dated(source)] == [1, 2, 4, 8]


def test_no_date_in_the_codes_comments_or_docstrings():
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {text}" for path in sorted(ROOT.rglob("*.py"))
             for line, text in dated(path.read_text())]
    assert found == [], "move the figure into the docs, dated; keep the reason in the code"


def test_no_date_in_the_generated_config_reference():
    text = (ROOT.parent / "docs" / "config.md").read_text()
    assert [line for line in text.splitlines() if DATE.search(line)] == []
