"""Several reward functions as one reward, as TRL's ``GRPOTrainer(reward_funcs=[...])`` with
``GRPOConfig(reward_weights=[...])`` takes them: ``task.reward_fn`` a list, each function in
any form ``reward_forms.py`` recognises, and ``task.reward_weights`` one weight each
(default: all 1.0, as TRL's).

TRL's semantics, kept (read in trl 1.16's ``GRPOTrainer``, default
``multi_objective_aggregation="sum_then_normalize"``):

- a completion's reward is ``Σ_i w_i · r_i`` over the functions that scored it;
- a function may return ``None`` for a completion it does not apply to (multi-task data):
  that term is left out of the sum, and the completion out of that function's mean (TRL
  turns ``None`` into NaN, then ``nansum`` / ``nanmean``);
- a completion every function returned ``None`` for has no reward. TRL keeps it with
  advantage 0, outside its group's baseline; asyncrl has no reward-less sample, so its
  episode fails with a message saying so (retried, then counted in ``errors.jsonl``);
- each function's values are logged apart under its name, the function's ``__name__`` (TRL:
  ``rewards/<name>/mean``; here ``reward/<name>/mean`` in ``metrics.jsonl`` and ``rewards``
  in ``samples.jsonl``).

verl's score dicts (``{"score": ..., "acc": ...}``): the keys besides ``score`` are kept as
the completion's ``extras`` (``reward_extras`` in ``samples.jsonl``), as verl keeps them as
``reward_extra_info``; with several functions each key is written ``<name>/<key>``.

All functions of a completion run under one deadline (``workflow.timeout_s``), one after
the other (a batched one once for the completions handed in together); a plain function
runs on the run's worker threads, an ``async def`` on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.tasks.base import RewardFn, Task
from asyncrl.tasks.reward_forms import ForeignReward, Outcome, checked_number, is_async_reward
from asyncrl.threads import call_in_thread, describe


@dataclass(frozen=True)
class Scored:
    """One completion's reward and what it was made of."""

    reward: float
    parts: dict[str, float | None] = field(default_factory=dict)
    """Each function's value by name (``None``: not applicable); empty for a single function."""
    extras: dict[str, Any] = field(default_factory=dict)
    """verl's score-dict keys besides ``score``."""


def reward_name(fn: RewardFn) -> str:
    """The name a function's values are logged under: its ``__name__`` (TRL's choice), a
    callable object's class name."""
    inner = fn.fn if isinstance(fn, ForeignReward) else fn
    return getattr(inner, "__name__", type(inner).__name__)


class RewardSum:
    """``members`` (asyncrl's own form or :class:`ForeignReward`) with their ``weights``,
    scored together. Invariant: as many weights as members, and distinct names."""

    def __init__(self, members: Sequence[RewardFn], weights: Sequence[float] | None = None) -> None:
        weights = [1.0] * len(members) if weights is None else [float(w) for w in weights]
        if len(weights) != len(members) or not members:
            raise ValueError(f"task.reward_weights has {len(weights)} weights for {len(members)} reward functions "
                             "in task.reward_fn; give one weight per function (or none: each 1.0)")
        self.members, self.weights = list(members), weights
        self.names = [reward_name(fn) for fn in self.members]
        twice = sorted({name for name in self.names if self.names.count(name) > 1})
        if twice:
            specs = [describe(fn) for fn, name in zip(self.members, self.names) if name == twice[0]]
            raise ValueError(f"task.reward_fn names two functions called {twice[0]!r} ({', '.join(specs)}); each "
                             "is logged under its name, so give them different names")
        self.batched = any(isinstance(fn, ForeignReward) and fn.batched for fn in self.members)

    def __repr__(self) -> str:
        return " + ".join(f"{w:g}·{name}" for w, name in zip(self.weights, self.names))

    async def __call__(self, task: Task, response: str) -> float:
        """The total for one completion: what a workflow's ``score(ctx.reward_fn, …)`` awaits
        (under its own timeout)."""
        return unwrap((await self.score_batch([task], [response], None, timeout_s=None))[0]).reward

    async def score_batch(self, tasks: Sequence[Task], responses: Sequence[str], token_ids: Sequence[list[int]] | None,
                          *, timeout_s: float | None) -> list[Scored | TypeError]:
        """Every function over these completions (``tasks[i]``'s), combined as TRL does; a
        completion no function scored gets its own ``TypeError`` (its siblings keep theirs).
        A function that raises, or the deadline, fails the whole call."""
        async with asyncio.timeout(timeout_s):
            columns = [await self._outcomes(fn, tasks, responses, token_ids) for fn in self.members]
        return [self._combine(task, row) for task, row in zip(tasks, zip(*columns))]

    async def _outcomes(self, fn: RewardFn, tasks: Sequence[Task], responses: Sequence[str],
                        token_ids: Sequence[list[int]] | None) -> list[Outcome]:
        what, first = f"reward function {describe(fn)}", tasks[0].id
        if isinstance(fn, ForeignReward):
            if fn.is_async:
                return await fn.outcomes_batch_async(tasks, responses, token_ids)
            return await call_in_thread(fn.outcomes_batch, tasks, responses, token_ids, timeout_s=None, what=what,
                                        task_id=first)
        if is_async_reward(fn):
            values = await asyncio.gather(*(fn(task, text) for task, text in zip(tasks, responses)))
        else:
            values = await call_in_thread(lambda: [fn(task, text) for task, text in zip(tasks, responses)],
                                          timeout_s=None, what=what, task_id=first)
        return [(checked_number(value, describe(fn), none_ok=True), {}) for value in values]

    def _combine(self, task: Task, row: Sequence[Outcome]) -> Scored | TypeError:
        scored = [(w, value) for w, (value, _) in zip(self.weights, row) if value is not None]
        if not scored:
            return TypeError(f"every reward function ({', '.join(self.names)}) returned None (not applicable) for "
                            f"task {task.id}: the completion has no reward; make one of them score it")
        several = len(self.members) > 1
        extras = {f"{name}/{key}" if several else key: item
                  for name, (_, more) in zip(self.names, row) for key, item in more.items()}
        return Scored(reward=sum(w * value for w, value in scored),
                      parts={name: value for name, (value, _) in zip(self.names, row)} if several else {},
                      extras=extras)



def unwrap(result: Scored | TypeError) -> Scored:
    """A completion's :class:`Scored`, or its error raised."""
    if isinstance(result, TypeError):
        raise result
    return result
