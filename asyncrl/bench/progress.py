"""Progress of a benchmark: a line when each phase starts and one when it ends, with its
duration and headline figure, and a bar over a phase's countable units.

    [bench engine] uniform ...
    [bench engine] uniform: model.generate 3,412 tok/s, TorchEngine 9,876 tok/s (12.3 s)

Lines go to stdout beside the suite's table; bars go to stderr, as the trainer's
``train[mode]`` bar does. Neither may run inside a timed region: a phase's bar advances
between timed runs, never per token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


class Phase:
    """What a phase body reports: ``advance()`` after each unit, ``figure`` before it ends."""

    def __init__(self, bar: tqdm | None) -> None:
        self.bar = bar
        self.figure = "done"

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)


@contextmanager
def phase(suite: str, name: str, *, total: int | None = None, unit: str = "run") -> Iterator[Phase]:
    """Print ``[bench SUITE] NAME ...``, run the body, print its figure and duration.

    With ``total``, the body gets a bar of ``total`` units; it disappears when the phase
    ends, leaving the end line. A phase that raises ends with ``failed`` and its duration.
    """
    prefix = f"[bench {suite}] {name}"
    print(f"{prefix} ...", flush=True)
    bar = (tqdm(total=total, desc=prefix, unit=unit, dynamic_ncols=True, leave=False)
           if total is not None else None)
    current = Phase(bar)
    start = time.perf_counter()
    try:
        yield current
    except BaseException:
        current.figure = "failed"
        raise
    finally:
        if bar is not None:
            bar.close()
        print(f"{prefix}: {current.figure} ({time.perf_counter() - start:.1f} s)", flush=True)
