"""The two handles the orchestrator holds: one learner, one rollout side.

Both runtimes (``local``: this process; ``ray``: actors) implement them, so the trainer
reads the same whichever runs underneath. The learner handle is one class for every
runtime (``LearnerGroup`` in ``transport.py``): each call of :class:`LearnerHandle` in
``LEARNER_CALLS`` is the worker's method of the same name (:class:`LearnerRank`, which every
learner kind's worker implements), run on every rank. Adding a learner call is one method
on each worker, its line here and its line in ``LearnerGroup``.

Published weights are opaque to the orchestrator: a ``WeightUpdate`` in-process
(``asyncrl/engine/protocol.py``: full weights or LoRA adapters, the learner's choice),
:class:`StoredWeights` on Ray; it only carries them from ``publish`` to
``sync_weights``/``evaluate``. ``apply`` is how a part below the runtime (weight sync)
installs and drives its own state inside the workers without a method on every handle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from asyncrl.rollout.eval_scoring import EvalResult
from asyncrl.learner import TrainBatch
from asyncrl.modes import PartialRollout
from asyncrl.tasks.base import Task
from asyncrl.types import Episode

Weights = Any
"""What ``LearnerHandle.publish`` returns: a snapshot of the weights at one version (a
``WeightUpdate``, or on Ray a :class:`StoredWeights` holding one)."""


@dataclass(frozen=True)
class StoredWeights:
    """Published weights left in Ray's object store: the reference travels, the bytes do
    not pass through the driver. Wrapped, because Ray resolves a bare reference it meets
    as a call's argument or result."""

    ref: Any


class LearnerHandle(Protocol):
    async def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        """One optimizer step (one new version); returns the step's ``actor/*`` metrics."""
        ...

    async def accumulate(self, batch: TrainBatch, on_policy: bool) -> None:
        """Forward and backward on part of a step's batch (``learner.streaming``); the
        weights do not change until :meth:`finish_step`."""
        ...

    async def finish_step(self) -> dict[str, float]:
        """The optimizer step of the parts accumulated since the last step: what
        :meth:`train_step` on them all at once would do, metrics included."""
        ...

    async def publish(self) -> Weights:
        """A snapshot of the current weights; the learner may train on while engines load it."""
        ...

    async def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path: ...

    async def load_checkpoint(self, path: Path) -> int:
        """Weights, optimizer, schedule and RNG of ``path``; returns its version."""
        ...

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` on every rank's worker, in rank order; each rank's value.
        ``fn`` must be importable by name (it crosses to rank processes and actors)."""
        ...

    def stop_soon(self) -> None:
        """A stop was asked (a first Ctrl-C): a call under way that does not return within
        the stop's grace is ended, and the run fails naming it, rather than waiting on."""
        ...

    async def shutdown(self) -> None: ...


class LearnerRank(Protocol):
    """What every learner worker implements — one rank of any learner kind (``LearnerWorker``
    in this process, as a rank process or a Ray actor; ``TinkerLearnerWorker`` behind a URL).
    A transport runs these on its ranks; :class:`LearnerHandle`'s calls are the same names,
    so a learner call is one method here, one on each worker and one on ``LearnerGroup``,
    and the type checker (``mypy`` in CI) holds every worker to this shape."""

    def join(self, init_method: str | None = None, local_rank: int = 0) -> None:
        """Load the policy (joining the ranks' process group first, when there are several)."""
        ...

    def leave(self) -> None:
        """Release what ``join`` took; never raises over the run's own end."""
        ...

    def apply(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]: ...

    def accumulate(self, batch: TrainBatch, on_policy: bool) -> None: ...

    def finish_step(self) -> dict[str, float]: ...

    def publish(self) -> Any: ...

    def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path: ...

    def load_checkpoint(self, path: Path) -> int: ...

    def probe_logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The learner's logprobs of each (prompt, completion)'s completion (the delivery check)."""
        ...

    def engine_update_bytes(self) -> int: ...


LEARNER_CALLS = tuple(name for name in vars(LearnerHandle)
                      if not name.startswith("_") and name not in ("apply", "stop_soon", "shutdown"))
"""The calls a ``LearnerGroup`` sends to its workers, rank 0's value returned: every
method of :class:`LearnerHandle` but the three the group implements itself."""


class RolloutHandle(Protocol):
    @property
    def restarts(self) -> int:
        """Rollout workers replaced after dying, in this process's lifetime."""
        ...

    async def run_group(self, task: Task, n: int, draw: int = 0,
                        replay: Mapping[int, dict[str, Any]] | None = None) -> list[Episode]:
        """``n`` episodes of ``task``; a failing episode comes back with status ``error``.
        ``draw``: the train epoch the task was handed out in (part of the episodes' seeds,
        ``asyncrl/seeding.py``). ``replay``: sample -> its journal from a checkpoint
        (``asyncrl/rollout/journal.py``), continued rather than generated again."""
        ...

    async def in_flight(self) -> list[dict[str, Any]]:
        """The journals of the training episodes under way on every worker, for a
        checkpoint (running sequences are aborted and resumed to read their tokens)."""
        ...

    async def evaluate(self, tasks: list[Task], *, version: int, weights: Weights | None = None,
                       on_episode: Callable[[Episode], None] | None = None) -> EvalResult:
        """Score ``tasks`` on ``version``: with ``weights``, on an evaluation replica that
        loads them (training goes on meanwhile); without, on the rollout engines, which
        must serve ``version`` and receive no sync until this returns."""
        ...

    async def sync_weights(self, weights: Weights, version: int, mode: PartialRollout) -> list[int]:
        """Every engine serves ``version`` when this returns; ``mode`` says what happens to
        generation under way (see ``RolloutWorker.sync_weights``). Returns the version each
        engine reports serving (a Ray worker replaced meanwhile starts from these weights)."""
        ...

    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, i, *args)`` on every rollout worker i (awaited when it returns an
        awaitable); each worker's value, in worker order."""
        ...

    async def engine_work(self) -> dict[str, float]:
        """What the engines did so far: ``busy_s``, the seconds spent generating (mean per
        worker, for the idle ratios), and where the engine counts them, summed over the
        workers, ``decode_steps``, ``prefills``, ``prefill_rows`` (prompts run through the
        model), ``prefill_tokens`` (the positions they filled, padded to each prefill's
        longest), ``decode_positions`` (the cache positions decode steps attended over, padded
        like the prefills'), ``prefill_reused`` (newcomers that shared another's prompt row), ``tokens``
        (sampled) and ``prefill_s`` (the prefills' share of the busy seconds), and
        ``drain_s``, the seconds weight syncs waited for running sequences to finish (mean per
        worker); and the rollout side's own: ``episode_lead_s`` and ``episode_tail_s``, the
        training episodes' seconds before their first engine call and outside the engine
        after it, summed, over ``timed_episodes``: what ``asyncrl plan --from`` fits its cost
        models to."""
        ...

    async def engine_fleet(self) -> dict[str, float | str]:
        """With ``engine: remote``, the servers as the client sees them now, each step's
        ``remote/*`` keys: ``servers_up``, ``servers_lost_total``, ``lost_servers`` (their
        URLs), ``reissued_requests_total`` and ``reissued_tokens_total`` (requests sent again
        to another server after theirs was lost, and the tokens received that they carried),
        ``weight_load_s`` (the last weight sync's load across the servers, once there was
        one); totals since this process started. {} for engines the run starts itself."""
        ...

    async def gateway_counts(self) -> dict[str, int]:
        """What the workers' gateways counted (``tool_parse_errors``, ``sampling_overrides``)
        and ``user_threads_abandoned`` (blocking user calls given up on), summed over the
        workers; zeros where nothing was counted."""
        ...

    async def shutdown(self) -> None: ...
