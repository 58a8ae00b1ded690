"""When a run checkpoints, and which of its checkpoints it keeps.

A step's checkpoint is *kept* every ``save_every`` steps and at the run's end; between
those, one is *interim* once ``save_every_minutes`` of real time have passed since the
last save (the run's start counts as one), and is removed as soon as a later checkpoint
is written (``rotate``). The clock is the real one, not the event loop's: the setting
bounds what a kill costs in real time, and a plan's virtual clock jumps.

Invariants: a step is saved at most once (the end of a run whose last step was saved as
interim marks that one kept, :meth:`RunCheckpoints.mark_kept`); what a checkpoint holds is
gathered (``contents``) only after the step's rows are on disk, inside the timed save.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.config.engine_kinds import engine_kind
from asyncrl.orchestrator.checkpoint import (
    IN_FLIGHT_FILE,
    RUN_STATE_FILE,
    RunState,
    SaveKind,
    encode_in_flight,
    mark_kept,
    rotate,
    save_due,
)
from asyncrl.runtime import LearnerHandle

Contents = Callable[[int, bool], Awaitable[tuple[RunState, list[dict[str, Any]]]]]  # (step, interim) -> saved


class RunCheckpoints:
    def __init__(self, cfg: Config, output_dir: Path, last: Path | None) -> None:
        """``last``: the checkpoint the run resumes from, None for a fresh start."""
        self.cfg, self.dir, self.last = cfg, output_dir / "checkpoints", last
        self.saved_step: int | None = None
        self.saved_at = time.monotonic()  # when the last checkpoint was written, or the run began
        self.seconds: dict[int, float] = {}  # each save's time on the loop's clock, by step (off a benchmark's)

    def restart_clock(self) -> None:
        """The run begins now: the model load and the runtime's start count toward no save."""
        self.saved_at = time.monotonic()

    def due(self, step: int) -> SaveKind | None:
        """``save_due``'s answer; and on a run whose rollouts live outside this process (a
        fleet of servers, vLLM's own processes: lost on their own), periodic saves on and no
        checkpoint yet, an interim one after the first step: a lost fleet then costs at most
        ``save_every_minutes``, never the whole run."""
        kind = save_due(step, self.cfg.total_steps, self.cfg.save_every, self.cfg.save_every_minutes,
                        time.monotonic() - self.saved_at)
        periodic = self.cfg.save_every > 0 or self.cfg.save_every_minutes > 0
        if (kind is None and periodic and self.last is None and step < self.cfg.total_steps
                and engine_kind(self.cfg.engine).placement != "process"):
            return "interim"
        return kind

    async def save(self, step: int, learner: LearnerHandle, contents: Contents, interim: bool = False) -> None:
        """``step``'s checkpoint: the learner's state and what ``contents(step, interim)``
        gathers (the run state, the journals of the episodes under way)."""
        start = asyncio.get_running_loop().time()
        state, in_flight = await contents(step, interim)
        self.last = await learner.save_checkpoint(
            self.dir / f"step_{step}", {"step": step},
            {RUN_STATE_FILE: state.to_json(), IN_FLIGHT_FILE: encode_in_flight(in_flight)})
        self.saved_step, self.saved_at = step, time.monotonic()
        rotate(self.dir, self.cfg.keep_last, newest=self.last)
        self.seconds[step] = asyncio.get_running_loop().time() - start

    def mark_kept(self, step: int) -> bool:
        """Where ``step``'s checkpoint is saved already (as interim: the run ended on a step
        saved by time), mark it kept and say so; False where ``step`` is not saved yet."""
        if self.saved_step != step:
            return False
        if self.last is not None:
            mark_kept(self.last)
        return True
