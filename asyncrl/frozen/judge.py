"""Model-graded rewards: a judge model asked by URL to grade a response against a rubric, or a
reward model (a sequence classifier) loaded here and run in batches. Both are asyncrl reward
functions, ``async (task, response) -> float``, so they go wherever a reward function goes.

A grade that cannot be read from the judge's reply, or a judge that does not answer, raises:
the episode fails and is retried like any failing reward, and the error names the judge and
what it said. A reward of 0 is never made up for a judge that is down.
"""

from __future__ import annotations

import asyncio
import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from asyncrl.frozen.client import FrozenModel, FrozenModelError

DEFAULT_PROMPT = (
    "You grade answers. Question:\n{prompt}\n\nAnswer to grade:\n{response}\n\n"
    "Reply with one line `GRADE: <0-10>` (10 = fully correct) and nothing else."
)
DEFAULT_PATTERN = r"GRADE:\s*(-?\d+(?:\.\d+)?)"
JUDGE = "judge"  # the name in ``task.reward_fn`` that means the ``judge:`` section's model


class GradedTask(Protocol):
    """What a grader reads of a task; ``asyncrl.tasks.Task`` is one. Stated here so the frozen
    models stand beside the tasks, not on them: the tasks' config builder names the judge
    (``tasks/from_config.py``), and no import goes back."""

    @property
    def id(self) -> str: ...
    @property
    def prompt(self) -> str: ...
    @property
    def data(self) -> Mapping[str, Any]: ...


def uses_judge(reward_fn: str | list[str] | None) -> bool:
    """Whether ``task.reward_fn`` names the ``judge:`` section's model."""
    return JUDGE in ([reward_fn] if isinstance(reward_fn, str) else reward_fn or [])


class JudgeParseError(FrozenModelError):
    """The judge answered, but no grade could be read from its reply."""


def render_prompt(template: str, task: GradedTask, response: str) -> str:
    """``template`` with ``{prompt}``, ``{response}``, ``{task_id}`` and every key of the task's
    ``data`` (``{answer}``, ``{ground_truth}``...) filled in; an unknown field is a ``KeyError``
    naming it and the fields there are."""
    fields: dict[str, Any] = {**task.data, "prompt": task.prompt, "response": response, "task_id": task.id}
    wanted = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    if missing := sorted(wanted - set(fields)):
        raise KeyError(f"judge.prompt names {missing}, which task {task.id} lacks; it has {sorted(fields)}")
    return template.format_map(fields)


def judge_messages(template: str, task: GradedTask, response: str) -> list[dict[str, str]]:
    """The chat :class:`JudgeReward` sends for ``response`` to ``task``: one user turn, the
    rubric filled in. A judge trained for the rubric (``examples/judge/make_judge_data.py``)
    is trained on these very messages, so it sees at grading time what it saw in training."""
    return [{"role": "user", "content": render_prompt(template, task, response)}]


def parse_grade(reply: str, pattern: str, scale: float) -> float:
    """The last match of ``pattern``'s first group in ``reply``, divided by ``scale``."""
    found = re.findall(pattern, reply)
    if not found:
        raise ValueError(f"no grade matching {pattern!r} in the judge's reply {reply[:200]!r}")
    grade = float(found[-1] if isinstance(found[-1], str) else found[-1][0]) / scale
    if not math.isfinite(grade):
        raise ValueError(f"the judge's grade {found[-1]!r} is not a finite number")
    return grade


class JudgeReward:
    """The reward is the judge's grade of the response, on ``[0, max_grade] / scale``."""

    def __init__(self, model: FrozenModel, *, prompt: str = DEFAULT_PROMPT, pattern: str = DEFAULT_PATTERN,
                 scale: float = 10.0, max_tokens: int = 64, temperature: float = 0.0) -> None:
        re.compile(pattern)
        self.model, self.prompt, self.pattern, self.scale = model, prompt, pattern, scale
        self.params = {"max_tokens": max_tokens, "temperature": temperature}
        self.__name__ = JUDGE  # what its values are logged under (reward/judge/mean)
        self.__qualname__ = f"judge at {model.url}"

    def __repr__(self) -> str:
        return self.__qualname__

    def check_tasks(self, tasks: Sequence[GradedTask]) -> None:
        """Refuse, before any work, a rubric naming a field some task lacks (``KeyError``)."""
        for task in tasks:
            render_prompt(self.prompt, task, "")

    async def __call__(self, task: GradedTask, response: str) -> float:
        reply = await self.model.chat(judge_messages(self.prompt, task, response), **self.params)
        try:
            return parse_grade(reply, self.pattern, self.scale)
        except ValueError as exc:
            self.model.stats.failures += 1
            raise JudgeParseError(f"{self.model} for task {task.id}: {exc}") from None


class RewardModel:
    """A sequence classifier (``AutoModelForSequenceClassification``) loaded from ``path``: the
    reward is its logit at ``label`` for ``prompt + response``. Requests that arrive together
    are scored in one forward pass of at most ``batch_size`` rows, on a worker thread."""

    def __init__(self, path: str, *, label: int = 0, batch_size: int = 16, max_length: int = 1024) -> None:
        from pathlib import Path

        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"judge.reward_model {path!r} is not a model directory (no config.json)")
        self.path, self.label, self.batch_size, self.max_length = path, label, batch_size, max_length
        self.tokenizer: Any = None
        self.net: Any = None  # loaded on the first score, on the scoring thread (pre-flight loads no weights)
        self.__name__ = JUDGE
        self._queue: asyncio.Queue[tuple[str, asyncio.Future[float]]] | None = None
        self._batcher: asyncio.Task[None] | None = None
        self.__qualname__ = f"reward model {path}"

    def __repr__(self) -> str:
        return self.__qualname__

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.net = AutoModelForSequenceClassification.from_pretrained(self.path).eval()
        if self.net.config.pad_token_id is None:
            self.net.config.pad_token_id = self.tokenizer.pad_token_id

    def score_texts(self, texts: list[str]) -> list[float]:
        import torch

        if self.net is None:
            self._load()
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length)
        with torch.inference_mode():
            logits = self.net(**enc).logits  # (B, num_labels)
        return logits[:, self.label].float().tolist()

    async def __call__(self, task: GradedTask, response: str) -> float:
        loop = asyncio.get_running_loop()
        if self._queue is None or self._batcher is None or self._batcher.done():
            self._queue = asyncio.Queue()
            self._batcher = loop.create_task(self._batches(), name="reward-model batcher")
        future: asyncio.Future[float] = loop.create_future()
        await self._queue.put((task.prompt + response, future))
        return await future

    async def _batches(self) -> None:
        assert self._queue is not None
        while True:
            pending = [await self._queue.get()]
            await asyncio.sleep(0)  # let the requests that arrive together join this batch
            while not self._queue.empty() and len(pending) < self.batch_size:
                pending.append(self._queue.get_nowait())
            live = [(text, fut) for text, fut in pending if not fut.done()]
            if not live:
                continue
            try:
                scores = await asyncio.to_thread(self.score_texts, [text for text, _ in live])
            except Exception as exc:  # every waiter learns why; the batcher goes on
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(RuntimeError(f"{self}: scoring failed: {exc!r}"))
                continue
            for (_, fut), value in zip(live, scores, strict=True):
                if not fut.done():
                    fut.set_result(value)


def judge_from_config(cfg: Mapping[str, Any] | Any) -> JudgeReward | RewardModel:
    """The reward a ``judge:`` section describes: by URL, or a local reward model."""
    if getattr(cfg, "reward_model", None):
        return RewardModel(cfg.reward_model, label=cfg.label, batch_size=cfg.max_concurrency)
    model = FrozenModel("judge", cfg.url, model=cfg.model, api_key=cfg.api_key, max_concurrency=cfg.max_concurrency,
                        timeout_s=cfg.timeout_s, retries=cfg.retries)
    return JudgeReward(model, prompt=cfg.prompt, pattern=cfg.grade_pattern, scale=cfg.scale,
                       max_tokens=cfg.grade_tokens)
