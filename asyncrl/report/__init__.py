"""``asyncrl report RUN_DIR``: one self-contained HTML page about a training run.

Everything is computed from the files ``asyncrl train`` writes (``config.yaml``,
``metrics.jsonl``, ``samples.jsonl``, ``timeline.jsonl``, ``errors.jsonl``), so a report
can be made after the fact, on another machine, for a run that was killed.

``run`` parses a run directory, ``summary`` computes its numbers, ``figures`` and
``timeline`` draw it, ``page`` writes ``report.html``. Only drawing needs matplotlib:
without it this package still imports, and ``write_report`` raises ImportError.
"""

from asyncrl.report.page import write_report
from asyncrl.report.run import Run, load_run
from asyncrl.report.summary import format_value, overlap_fraction, summarize

__all__ = ["Run", "format_value", "load_run", "overlap_fraction", "summarize", "write_report"]
