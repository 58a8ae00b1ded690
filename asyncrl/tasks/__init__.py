"""Task registry: turn a config's ``task`` name into train/validation splits, and a
reward spec string (``module:function``) into a callable. ``TASK_SOURCES`` is the one
table: a task name, how its splits load, and its built-in reward (or why it has none)."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.plugins import load_named
from asyncrl.tasks.arithmetic import arithmetic_reward, generate_arithmetic, iter_arithmetic
from asyncrl.tasks.base import RewardFn, Task, TaskDataError, TaskSplits
from asyncrl.tasks.countdown import countdown_reward, generate_countdown, iter_countdown
from asyncrl.tasks.hf import load_hf_splits
from asyncrl.tasks.jsonl import load_jsonl_tasks
from asyncrl.tasks.longtail import iter_longtail, longtail_reward
from asyncrl.tasks.multihop import iter_multihop, multihop_corpus, multihop_reward
from asyncrl.tasks.research import research_splits
from asyncrl.tasks.verifiers_tasks import load_verifiers_splits

__all__ = [
    "is_validation_prompt",
    "Task", "TaskSplits", "RewardFn", "TaskDataError", "load_tasks", "resolve_reward_fn",
    "default_reward_fn", "generate_countdown", "countdown_reward", "generate_arithmetic",
    "arithmetic_reward", "load_jsonl_tasks", "TASK_NAMES", "REWARD_FUNCTIONS",
    "REWARD_SPECS", "multihop_corpus", "multihop_reward", "TASK_SOURCES", "TaskQuery", "TaskSource",
]

# Cap on candidates drawn per wanted task, so a tiny task space (arithmetic has 100
# prompts) fails loudly instead of looping forever.
_DRAWS_PER_VALIDATION_TASK = 200


def _validation_seed(seed: int) -> int:
    """A seed derived from, and never equal to, the train seed."""
    derived = random.Random(f"asyncrl-validation-{seed}").getrandbits(31)
    return derived if derived != seed else derived + 1


def is_validation_prompt(prompt: str) -> bool:
    """A fixed 1/8 of the prompt space is validation-only, chosen by a stable hash.

    Why not "validation = prompts the train draw missed": when the train draw nearly
    exhausts a small space (Countdown with numbers 1-9), the leftovers are the rare
    prompts, so validation would measure a different, harder distribution and RL that
    sharpens the common case would look like it hurts. A hash split keeps both splits
    samples of the same distribution and never lets a validation prompt into training.
    """
    return zlib.crc32(prompt.encode()) % 8 == 0


def _generated_splits(
    name: str, make: Callable[..., Iterator[Task]], seed: int, num_train: int, num_validation: int,
    options: Mapping[str, Any]
) -> TaskSplits:
    try:
        train_stream = make(seed, **options)
    except TypeError as exc:  # unknown option name: a config typo, so say which
        raise ValueError(f"task {name!r}: bad generator options {dict(options)}: {exc}") from None
    train: list[Task] = []
    for _ in range(max(1, num_train) * _DRAWS_PER_VALIDATION_TASK):
        if len(train) == num_train:
            break
        task = next(train_stream)
        if not is_validation_prompt(task.prompt):
            train.append(task)
    validation: list[Task] = []
    seen: set[str] = set()
    stream = make(_validation_seed(seed), **options)
    for _ in range(max(1, num_validation) * _DRAWS_PER_VALIDATION_TASK):
        if len(validation) == num_validation:
            break
        task = next(stream)
        if is_validation_prompt(task.prompt) and task.prompt not in seen:  # distinct validation prompts
            seen.add(task.prompt)
            validation.append(task)
    if len(validation) < num_validation or len(train) < num_train:
        raise ValueError(
            f"task {name!r}: found only {len(train)} train / {len(validation)} validation prompts "
            f"of the {num_train} / {num_validation} asked; the task space is too small, so lower "
            "num_train/num_validation or widen the generator options"
        )
    return TaskSplits(train=train, validation=validation)


def _jsonl_splits(
    path: str | Path | None, validation_path: str | Path | None, num_train: int, num_validation: int
) -> TaskSplits:
    if path is None:
        raise ValueError("task 'jsonl' needs `path` pointing at a JSONL file of tasks")
    rows = load_jsonl_tasks(path)
    if validation_path is not None:
        train, validation = rows, load_jsonl_tasks(validation_path)
    else:
        # Hold out the tail: deterministic, and independent of the seed on purpose so
        # that changing the seed never leaks validation rows into training.
        cut = len(rows) - num_validation
        if cut < 1:
            raise TaskDataError(
                f"{path}: {len(rows)} tasks is too few to hold out {num_validation} for "
                "validation and still train; add rows, lower num_validation, or pass "
                "validation_path"
            )
        train, validation = rows[:cut], rows[cut:]
    if num_train > 0:
        train = train[:num_train]
    return TaskSplits(train=train, validation=validation)


def load_tasks(
    name: str,
    *,
    path: str | Path | None = None,
    seed: int,
    num_train: int,
    num_validation: int,
    validation_path: str | Path | None = None,
    options: Mapping[str, Any] | None = None,
    split: str = "train",
    validation_split: str | None = None,
) -> TaskSplits:
    """Train/validation splits for the task ``name``.

    Generated tasks (countdown, arithmetic) draw train from ``seed`` and validation from
    a derived seed, dropping any validation prompt seen in train so the validation
    score measures generalisation. ``options`` go to the generator (e.g.
    ``num_numbers``). For ``jsonl``, ``path`` is the train file; validation comes from
    ``validation_path`` or else the last ``num_validation`` rows. There ``num_train``
    caps the train rows taken from the front, and ``num_train <= 0`` means all rows.
    ``hf``: a local dataset through ``datasets`` (``asyncrl/tasks/hf.py``), its train
    ``split`` and held-out ``validation_split`` (names or slices).
    ``verifiers``: a `verifiers` taskset (``options.environment``, ``asyncrl/tasks/verifiers_tasks.py``),
    its last ``num_validation`` tasks held out; its rubric scores through its agent
    (``asyncrl/rollout/workflows/verifiers_agent.py``).
    """
    if num_train < 0 or num_validation < 0:
        raise ValueError(f"num_train and num_validation must be >= 0, got {num_train}, {num_validation}")
    if name not in TASK_SOURCES:
        raise ValueError(f"unknown task {name!r}; valid names: {', '.join(TASK_NAMES)}")
    query = TaskQuery(path, seed, num_train, num_validation, validation_path, options or {}, split, validation_split)
    return TASK_SOURCES[name].load(name, query)


@dataclass(frozen=True)
class TaskQuery:
    """What ``load_tasks`` was asked, for a source's loader (each refuses what it does not take)."""

    path: str | Path | None
    seed: int
    num_train: int
    num_validation: int
    validation_path: str | Path | None
    options: Mapping[str, Any]
    split: str
    validation_split: str | None

    def refuse_hf_splits(self, name: str) -> None:
        if self.split != "train" or self.validation_split is not None:
            raise ValueError(f"task {name!r}: `split`/`validation_split` only apply to 'hf'")


@dataclass(frozen=True)
class TaskSource:
    """A task name's row: ``load(name, query)`` its splits; ``reward`` its built-in reward,
    or None, ``no_reward`` then saying what scores it instead."""

    load: Callable[[str, TaskQuery], TaskSplits]
    reward: RewardFn | None = None
    no_reward: str = ""


def _generated(generator: Callable[..., Iterator[Task]]) -> Callable[[str, TaskQuery], TaskSplits]:
    """A generated task's loader over its endless deterministic stream ``generator(seed, **options)``."""
    def load(name: str, q: TaskQuery) -> TaskSplits:
        q.refuse_hf_splits(name)
        if q.path is not None or q.validation_path is not None:
            raise ValueError(f"task {name!r} is generated; `path`/`validation_path` only apply to 'jsonl' and 'hf'")
        return _generated_splits(name, generator, q.seed, q.num_train, q.num_validation, q.options)
    return load


def _load_jsonl(name: str, q: TaskQuery) -> TaskSplits:
    if q.options:
        raise ValueError(f"task 'jsonl' takes no generator options, got {dict(q.options)}")
    return _jsonl_splits(q.path, q.validation_path, q.num_train, q.num_validation)


def _load_hf(name: str, q: TaskQuery) -> TaskSplits:
    return load_hf_splits(q.path, split=q.split, validation_split=q.validation_split,
                          validation_path=q.validation_path, num_train=q.num_train, num_validation=q.num_validation,
                          options=q.options)


def _load_research(name: str, q: TaskQuery) -> TaskSplits:
    """BrowseComp-Plus-shaped files (``asyncrl/tasks/research.py``)."""
    q.refuse_hf_splits(name)
    unknown = sorted(set(q.options) - {"train_hops"})
    if unknown:
        raise ValueError(f"task 'research' takes one option, `train_hops` (a list of hop counts to train on); "
                         f"got {unknown}")
    hops = q.options.get("train_hops")
    if hops is not None and (not isinstance(hops, list) or not hops
                             or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in hops)):
        raise ValueError(f"task.options.train_hops must be a non-empty list of hop counts >= 1, e.g. [2, 3]; "
                         f"got {hops!r}")
    return TaskSplits(*research_splits(q.path, q.validation_path, q.num_train, q.num_validation, train_hops=hops))


def _load_verifiers(name: str, q: TaskQuery) -> TaskSplits:
    if q.path is not None or q.validation_path is not None:
        raise ValueError("task 'verifiers' reads its taskset: name it in options.environment, not `path`")
    return load_verifiers_splits(q.options, num_train=q.num_train, num_validation=q.num_validation)


_USER_REWARD = "has no default reward; set a reward spec 'module:function'"
TASK_SOURCES: dict[str, TaskSource] = {
    "countdown": TaskSource(_generated(iter_countdown), countdown_reward),
    "arithmetic": TaskSource(_generated(iter_arithmetic), arithmetic_reward),
    "longtail": TaskSource(_generated(iter_longtail), longtail_reward),
    # The corpus depends on the options (corpus_seed, num_people), never on the seed, so
    # train and validation ask about one corpus: multihop_corpus(**options).
    "multihop": TaskSource(_generated(iter_multihop), multihop_reward),
    "jsonl": TaskSource(_load_jsonl, no_reward=_USER_REWARD),  # the user's own rows, scored by the user's reward
    "hf": TaskSource(_load_hf, no_reward=_USER_REWARD),
    "research": TaskSource(_load_research, multihop_reward),  # the same short-answer match (tasks/research.py)
    "verifiers": TaskSource(_load_verifiers, no_reward=(
        "is scored by its own rubric: set workflow.name=openai_agent and "
        "workflow.agent=asyncrl.rollout.workflows.verifiers_agent:run, and no task.reward_fn")),
}
TASK_NAMES: tuple[str, ...] = tuple(TASK_SOURCES)
REWARD_FUNCTIONS: dict[str, RewardFn] = {name: s.reward for name, s in TASK_SOURCES.items() if s.reward is not None}
REWARD_SPECS: dict[str, str] = {name: f"{fn.__module__}:{fn.__name__}" for name, fn in REWARD_FUNCTIONS.items()}
"""The built-in rewards as a config names them (``task.reward_fn``)."""


def default_reward_fn(name: str) -> RewardFn:
    """The built-in reward for a built-in generated task. JSONL and hf tasks have no
    default: only the user knows how to score their data."""
    if name not in TASK_SOURCES:
        raise ValueError(f"unknown task {name!r}; valid names: {', '.join(TASK_NAMES)}")
    source = TASK_SOURCES[name]
    if source.reward is None:
        raise ValueError(f"task {name!r} {source.no_reward}")
    return source.reward


def resolve_reward_fn(spec: str) -> RewardFn:
    """Import the ``module:function`` a config names as ``task.reward_fn``."""
    return load_named(spec, key="reward spec")
