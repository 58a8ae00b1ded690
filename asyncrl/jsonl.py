"""Reading JSONL files — a run's logs and users' task files — in one way, and the row logs
that are written a row at a time (``asyncrl sft``'s ``metrics.jsonl``).

Errors name the file and the 1-based line, so a user with a 100k-line file can fix it
without bisecting. A broken *last* line is what a process killed mid-write leaves behind:
readers of our own logs pass ``torn_tail="drop"`` to skip it (with a warning); a broken
line anywhere else means the file is not what the caller thinks it is.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal


class JsonlError(ValueError):
    """A JSONL file that cannot be read as asked; the message names the file and line."""


def iter_jsonl(path: str | Path, *, torn_tail: Literal["raise", "drop"] = "raise",
               objects: bool = True) -> Iterator[tuple[int, Any]]:
    """``(line_number, value)`` for each non-blank line of ``path``.

    ``objects``: every value must be a JSON object. Lines are split on ``\\n`` only:
    JSON strings may hold a raw U+2028, which ``splitlines()`` would treat as a break.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JsonlError(f"file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JsonlError(f"cannot read {path}: {exc}") from None
    lines = text.split("\n")
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    for line_no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            if torn_tail == "drop" and line_no == last:
                warnings.warn(f"{path}: skipping the truncated last line {line_no} (was the writer killed "
                              f"mid-line?): {exc.msg}", stacklevel=2)
                return
            raise JsonlError(f"{path}, line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if objects and not isinstance(value, dict):
            raise JsonlError(f"{path}, line {line_no}: expected a JSON object, got {type(value).__name__}")
        yield line_no, value


def read_jsonl(path: str | Path, *, torn_tail: Literal["raise", "drop"] = "drop") -> list[dict[str, Any]]:
    """Every row of one of our own logs (``metrics.jsonl``, ``samples.jsonl``, ...)."""
    return [row for _, row in iter_jsonl(path, torn_tail=torn_tail)]


def last_row(path: Path) -> dict[str, Any] | None:
    """The last row of one of our own logs, None when it has none (or there is no file)."""
    rows = read_jsonl(path) if path.is_file() else []
    return rows[-1] if rows else None


@contextlib.contextmanager
def row_log(path: Path, *, append: bool = False, write: bool = True) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A row log at ``path``: one JSON object a line, flushed as written (a crash loses no
    row), each with ``time/elapsed`` since the file was opened; ``append``: after a resume;
    ``write`` false (a rank but the first): rows go nowhere."""
    start = time.monotonic()
    if not write:
        yield lambda row: None
        return
    with path.open("a" if append else "w") as f:
        def log(row: dict[str, Any]) -> None:
            f.write(json.dumps({**row, "time/elapsed": round(time.monotonic() - start, 3)}) + "\n")
            f.flush()

        yield log


def keep_rows(path: Path, *, through: int) -> None:
    """A row log cut back to the rows of steps ``through`` and before: the steps a resumed
    run takes again are logged again, once."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= through]
    path.write_text("".join(row + "\n" for row in rows))
