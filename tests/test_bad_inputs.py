"""Every bad input and fault of the reliability table in docs/faults.md ("Bad inputs and
faults, tried"; it moved there from the README, which links it), run as a user would (a
fresh ``asyncrl train`` process): its exit code, its message, a bound on its time; and
the table itself lists exactly these cases with these codes and messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bad_inputs import CASES, ROOT, Case, run_case

TABLE_START = "<!-- bad-input table: python tests/bad_inputs.py -->"
TABLE_PAGE = ROOT / "docs" / "faults.md"


def table_rows() -> dict[str, tuple[int, str]]:
    """what was tried -> (exit, what it says) from the table in docs/faults.md."""
    text = TABLE_PAGE.read_text()
    assert TABLE_START in text, "docs/faults.md lost its bad-input table"
    rows = {}
    for line in text.split(TABLE_START, 1)[1].lstrip().splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0]] = (int(cells[1]), cells[2])
    return rows


def test_the_faults_page_table_lists_every_case_as_the_tests_see_it():
    rows = table_rows()
    assert list(rows) == [c.tried for c in CASES]
    for case in CASES:
        code, says = rows[case.tried]
        assert code == case.exit_code, case.tried
        assert case.says in says.replace("\\|", "|"), f"{case.tried}: docs/faults.md quotes {says!r}"


@pytest.mark.parametrize("case", CASES, ids=[c.tried for c in CASES])
@pytest.mark.slow
def test_bad_input(case: Case, tmp_path: Path):
    code, err, seconds = run_case(case, tmp_path)
    tail = "\n".join(err.splitlines()[-12:])
    assert code == case.exit_code, tail
    assert case.says in err, tail
    assert seconds < case.within_s, f"{case.tried}: {seconds:.1f} s"
    assert "Traceback" not in err or case.exit_code == 1  # a config error is a message, not a traceback
