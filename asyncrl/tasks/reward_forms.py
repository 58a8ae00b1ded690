"""Reward functions as written for TRL and verl, used unchanged: ``task.reward_fn`` names
one and its parameters say which it is.

- asyncrl's own: ``reward(task, response) -> float``;
- TRL's (``GRPOTrainer(reward_funcs=...)``): ``reward(prompts, completions, **kwargs) ->
  list[float]``, batched: one call scores a group's completions. Prompts and completions
  are text, or message lists where the prompt is conversational (a completion is then
  ``[{"role": "assistant", "content": text}]``), as TRL passes them; every dataset column
  besides the prompt comes as a keyword argument holding one value per completion;
  ``completion_ids`` holds the sampled token ids, and ``trainer_state``, ``log_extra`` and
  ``log_metric`` come as ``None`` (asyncrl has no ``TrainerState``; TRL's own reward
  functions take these as optional);
- verl's (``custom_reward_function``): ``compute_score(data_source, solution_str,
  ground_truth, extra_info=None) -> float | dict`` (a dict's ``"score"`` is the reward, its
  other keys kept as the completion's extras, ``reward_extras`` in ``samples.jsonl``),
  one call per completion, with the row's ``data_source``, ``reward_model.ground_truth``
  and ``extra_info`` (verl's schema); or verl's batched form, the same names in the
  plural (``solution_strs``...), returning one score per completion.

Either may be ``async def``: it is awaited on the event loop; a plain function runs on
the run's worker threads, as asyncrl's own rewards do. Recognised by parameter names
(``completions``; ``solution_str`` with ``ground_truth``) because those are the names the
two frameworks pass them by (keywords), so a function written for them has them. Only
the keywords a function names (or all, when it takes ``**kwargs``) are passed.

Several functions as one weighted reward (TRL's ``reward_funcs`` with ``reward_weights``),
where ``None`` means "not applicable": ``reward_sum.py``.

What comes back is checked as asyncrl's rewards are: not a number is a ``TypeError``
(the episode is retried, then counted as an error), a non-finite number stops the run in
``asyncrl/algorithms/finite.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from asyncrl.tasks.base import RewardFn, Task

ASYNCRL_FORM = "asyncrl's reward(task, response) -> float"
TRL_FORM = "TRL's reward(prompts, completions, **kwargs) -> list[float]"
VERL_FORM = "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"
# What TRL passes besides the dataset's columns; the last three come as None here.
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives an awaitable (an ``async def``, or an object whose
    ``__call__`` is one, a :class:`ForeignReward` around one)."""
    if isinstance(fn, ForeignReward):
        return fn.is_async
    call = vars(type(fn)).get("__call__")  # a class instance's own __call__, not a function's slot
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


class ForeignReward:
    """A TRL or verl reward function behind asyncrl's ``(task, response) -> float`` (a
    batch of one), and :meth:`outcomes_batch` for a group's completions in one call where
    the function is batched (``batched``). ``form``: ``trl``, ``verl`` or ``verl_batch``."""

    def __init__(self, fn: Callable[..., Any], spec: str, form: str, parameters: Mapping[str, inspect.Parameter]):
        self.fn, self.spec, self.form = fn, spec, form
        self.batched = form != "verl"
        self.is_async = is_async_reward(fn)
        takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
        self._accepts: Callable[[str], bool] = (lambda _: True) if takes_any else parameters.__contains__
        self.required = [name for name, p in parameters.items() if p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def __repr__(self) -> str:
        return f"{self.spec} ({self.form})"

    def __call__(self, task: Task, response: str) -> Any:
        """One completion: a float, or (``is_async``) a coroutine of one; what a workflow's
        ``score(ctx.reward_fn, task, text)`` calls."""
        if self.is_async:
            return self._one_async(task, response)
        return self._float(self.outcomes_batch([task], [response], None)[0])

    async def _one_async(self, task: Task, response: str) -> float:
        return self._float((await self.outcomes_batch_async([task], [response], None))[0])

    def _call(self, tasks: Sequence[Task], responses: Sequence[str], token_ids: Sequence[list[int]] | None) -> Any:
        if self.form == "trl":
            return self.fn(**self._pick(self.trl_keywords(tasks, responses, token_ids)))
        rows = [self.verl_keywords(task, text) for task, text in zip(tasks, responses)]
        if self.form == "verl":
            return [self.fn(**self._pick(row)) for row in rows]
        return self.fn(**self._pick({f"{key}s": [row[key] for row in rows] for key in VERL_KEYWORDS}))

    def _pick(self, keywords: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in keywords.items() if self._accepts(key)}

    @staticmethod
    def trl_keywords(tasks: Sequence[Task], responses: Sequence[str],
                     token_ids: Sequence[list[int]] | None) -> dict[str, Any]:
        """What TRL's ``GRPOTrainer`` passes a reward function, for these completions."""
        columns = dict.fromkeys(key for task in tasks for key in task.data)
        return {
            **{key: [task.data.get(key) for task in tasks] for key in columns},
            "prompts": [task.prompt if task.messages is None else task.messages for task in tasks],
            "completions": [text if task.messages is None else [{"role": "assistant", "content": text}]
                            for task, text in zip(tasks, responses)],
            "completion_ids": None if token_ids is None else [list(ids) for ids in token_ids],
            "trainer_state": None, "log_extra": None, "log_metric": None,
        }

    @staticmethod
    def verl_keywords(task: Task, response: str) -> dict[str, Any]:
        """verl's arguments from a row in its schema (the ground truth checked present by
        :func:`check_reward_fits`)."""
        return {"data_source": task.data.get("data_source"), "solution_str": response,
                "ground_truth": task.data["reward_model"]["ground_truth"], "extra_info": task.data.get("extra_info")}

    def _float(self, outcome: Outcome) -> float:
        """One completion's reward alone: ``None`` is refused, as it leaves it without one."""
        if outcome[0] is None:
            raise TypeError(f"reward function {self.spec} returned None; expected a float (None, TRL's 'not "
                            "applicable', needs another reward function beside it in task.reward_fn's list)")
        return outcome[0]

    def outcomes(self, raw: Any, n: int) -> list[Outcome]:
        """Each completion's ``(reward or None, verl's extra keys)`` in ``raw``; ``None`` where the
        function returned ``None`` (TRL's "not applicable"); a ``TypeError`` naming the
        function for anything else that is not a number (or verl's dict holding one)."""
        not_a_list = isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence) or len(raw) != n
        if self.form != "verl" and not_a_list:  # verl's per-completion calls are gathered into a list here
            size = f" of {len(raw)}" if isinstance(raw, Sequence) else ""
            raise TypeError(f"reward function {self.spec} returned {type(raw).__name__}{size} {str(raw)[:80]!r} "
                            f"for {n} completions; expected a list of {n} floats")
        return [self._outcome(value) for value in raw]

    def _outcome(self, value: Any) -> Outcome:
        extras: dict[str, Any] = {}
        if self.form != "trl" and isinstance(value, Mapping):  # verl: {"score": ..., what else it logs}
            if "score" not in value:
                raise TypeError(f"reward function {self.spec} returned a dict without 'score' ({sorted(value)}); "
                                "verl's compute_score returns a float or a dict holding 'score'")
            extras = {key: item for key, item in value.items() if key != "score"}
            value = value["score"]
        return checked_number(value, self.spec, none_ok=True), extras

    def outcomes_batch(self, tasks: Sequence[Task], responses: Sequence[str],
                       token_ids: Sequence[list[int]] | None) -> list[Outcome]:
        """A plain function's outcomes (:meth:`outcomes`), one call where it is batched."""
        return self.outcomes(self._call(tasks, responses, token_ids), len(responses))

    async def outcomes_batch_async(self, tasks: Sequence[Task], responses: Sequence[str],
                                   token_ids: Sequence[list[int]] | None) -> list[Outcome]:
        """An ``async def``'s outcomes, awaited (verl's per-completion calls together)."""
        raw = self._call(tasks, responses, token_ids)
        return self.outcomes(await (asyncio.gather(*raw) if self.form == "verl" else raw), len(responses))


Outcome = tuple[float | None, dict[str, Any]]
"""One completion's score from one function: the number (``None``: "not applicable", TRL's
multi-task convention) and the extra keys of verl's score dict (empty otherwise)."""


def checked_number(value: Any, spec: str, *, none_ok: bool = False) -> float | None:
    """``value`` as a float (``None`` kept where ``none_ok``), else a ``TypeError`` naming the
    function ``spec`` and what it returned."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward function {spec} returned {value!r}; expected a float")
    return float(value)


def recognise_reward(fn: Callable[..., Any], spec: str) -> RewardFn:
    """``fn`` itself when it is asyncrl's form, else a :class:`ForeignReward`; a
    ``ValueError`` naming ``spec``, its signature and the three forms when it is none."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature (a C function): asyncrl's form
        return fn
    names = signature.parameters
    if "completions" in names:
        return ForeignReward(fn, spec, "trl", names)
    if {"solution_str", "ground_truth"} <= set(names):
        return ForeignReward(fn, spec, "verl", names)
    if {"solution_strs", "ground_truths"} <= set(names):
        return ForeignReward(fn, spec, "verl_batch", names)
    try:
        signature.bind(object(), "")
    except TypeError:
        shown = signature.replace(return_annotation=inspect.Signature.empty)
        raise ValueError(f"{spec}: {getattr(fn, '__qualname__', fn)}{shown} is none of the reward forms asyncrl "
                         f"recognises: {ASYNCRL_FORM}; {TRL_FORM} (a parameter named 'completions'); {VERL_FORM} "
                         "(parameters named 'solution_str' and 'ground_truth')") from None
    return fn


def check_reward_fits(reward_fn: RewardFn, tasks: Sequence[Task]) -> None:
    """Refuse, before any work, a TRL or verl reward whose arguments the tasks cannot give:
    a verl row without ``reward_model.ground_truth``, a TRL parameter without a default
    that is no column. ``ValueError`` naming the task and the column."""
    if not isinstance(reward_fn, ForeignReward):
        return
    if reward_fn.form != "trl":
        given = VERL_KEYWORDS if reward_fn.form == "verl" else tuple(f"{key}s" for key in VERL_KEYWORDS)
        missing = [name for name in reward_fn.required if name not in given]
        if missing:
            raise ValueError(f"verl's compute_score {reward_fn.spec} takes {missing[0]!r} without a default; verl "
                             f"passes only {', '.join(given)}: give it a default")
    for task in tasks:
        if reward_fn.form == "trl":
            missing = [name for name in reward_fn.required if name not in TRL_KEYWORDS and name not in task.data]
            if missing:
                raise ValueError(f"TRL reward function {reward_fn.spec} takes {missing[0]!r}, which task {task.id!r} "
                                 f"has no column for (its columns: {', '.join(task.data) or 'none'}); give it a "
                                 "default or add the column")
        else:
            truth = task.data.get("reward_model")
            if not isinstance(truth, Mapping) or truth.get("ground_truth") is None:
                raise ValueError(f"verl's compute_score {reward_fn.spec} needs column 'reward_model' holding "
                                 f"{{'ground_truth': ...}} (verl's schema), which task {task.id!r} lacks (its "
                                 f"columns: {', '.join(task.data) or 'none'})")
