"""User callbacks at the moments a run changes: a new policy is served
(``on_policy_updated``, rLLM's name), a step is logged (``on_step_end``), a train epoch
has been handed out (``on_epoch_end``).

A hook is ``module:function`` in the config's ``hooks`` section, a plain or ``async``
function of one :class:`HookEvent`. It runs on the trainer's event loop, between two
steps, so what it sees is consistent; an ``async`` hook can ``await event.run.save()``
or ``await event.run.evaluate()``. A hook that raises fails the run (exit 1) with its
traceback: a hook that uploads checkpoints or gates a deployment must not fail quietly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from asyncrl.config import ConfigError, HooksConfig
from asyncrl.plugins import load_named

HookName = Literal["on_policy_updated", "on_step_end", "on_epoch_end"]


class RunControl(Protocol):
    """What a hook may do to the run it is called from."""

    output_dir: Path

    async def save(self) -> Path:
        """Checkpoint now (the step just finished); returns the checkpoint's path."""
        ...

    async def evaluate(self) -> dict[str, float]:
        """Score the current version on the validation tasks now; returns ``eval/*`` metrics."""
        ...

    def stop(self) -> None:
        """Finish this step, checkpoint and end the run (as a first Ctrl-C does)."""
        ...


@dataclass(frozen=True)
class HookEvent:
    name: HookName
    step: int  # optimizer steps done
    version: int  # the learner's policy version (engines serve it after on_policy_updated)
    metrics: Mapping[str, Any]  # on_policy_updated: the step's actor/* stats; else the step's row
    run: RunControl
    epoch: int | None = None  # on_epoch_end: the train epoch just handed out (0-based)


class HookError(RuntimeError):
    """A user hook raised; the run stops with its traceback chained."""


@dataclass
class Hooks:
    callbacks: dict[HookName, tuple[str, Callable[[HookEvent], Any]]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: HooksConfig) -> Hooks:
        """Each named hook loaded now, so a typo fails before any work (exit 2)."""
        hooks = cls()
        for name, spec in cfg.model_dump().items():  # HooksConfig's fields: the hook names
            if spec is not None:
                try:
                    hooks.callbacks[cast(HookName, name)] = (spec, load_named(spec, key=f"hooks.{name}"))
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
        return hooks

    async def call(self, event: HookEvent) -> None:
        if event.name not in self.callbacks:
            return
        spec, fn = self.callbacks[event.name]
        try:
            result = fn(event)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            raise HookError(f"hooks.{event.name} ({spec}) raised at step {event.step}, version {event.version}: "
                            f"{type(exc).__name__}: {exc}") from exc


