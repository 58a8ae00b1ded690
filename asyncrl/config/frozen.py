"""Frozen models by URL: the judge of model-graded rewards and the teacher of on-policy distillation."""

from __future__ import annotations

from pydantic import (
    Field,
    model_validator,
)

from asyncrl.config.base import Section


class FrozenModelConfig(Section):
    """A frozen model reached by URL (``asyncrl/frozen/client.py``): an OpenAI-compatible server,
    vLLM's or ``asyncrl serve``/``serve-engine``."""

    url: str | None = None
    """The server's base URL (``http://host:port``, ``/v1`` optional); ``None``: not used."""
    model: str | None = None
    """The served model's name; ``None``: the first the server lists at ``/v1/models``."""
    api_key: str | None = None
    max_concurrency: int = Field(8, ge=1)
    """Requests in flight to it at most, however many episodes ask at once."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one try (the wait for a free slot is not counted)."""
    retries: int = Field(2, ge=0)
    """Further tries after a failure (a 4xx other than 408/429 is not retried)."""


class JudgeConfig(FrozenModelConfig):
    """Model-graded rewards: name ``judge`` in ``task.reward_fn`` (alone or in the list) and the
    reward is this judge's grade of the response (``asyncrl/frozen/judge.py``)."""

    prompt: str = (
        "You grade answers. Question:\n{prompt}\n\nAnswer to grade:\n{response}\n\n"
        "Reply with one line `GRADE: <0-10>` (10 = fully correct) and nothing else.")
    """The rubric: ``{prompt}``, ``{response}``, ``{task_id}`` and the task's data fields
    (``{answer}``...) are filled in; a field a task lacks is refused before any work."""
    grade_pattern: str = r"GRADE:\s*(-?\d+(?:\.\d+)?)"
    """A regular expression whose first group, in its last match in the reply, is the grade."""
    scale: float = Field(10.0, gt=0)
    """The grade is divided by this (a 0–10 grade becomes a 0–1 reward)."""
    grade_tokens: int = Field(64, ge=1)
    """The most tokens the judge may write in its reply."""
    reward_model: str | None = None
    """Instead of ``url``: a local sequence classifier (``AutoModelForSequenceClassification``
    directory) whose logit at ``label`` for prompt + response is the reward, batched up to
    ``max_concurrency`` rows."""
    label: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _one_source(self) -> JudgeConfig:
        if self.url and self.reward_model:
            raise ValueError("judge.url and judge.reward_model are both set; a judge is one or the other")
        return self


class TeacherConfig(FrozenModelConfig):
    """On-policy distillation (``asyncrl/algorithms/distill.py``): with ``url`` set, every trained
    token's advantage carries ``−coef · (log π_student − log π_teacher)``; the teacher must share
    the student's tokenizer (checked before any work)."""

    coef: float = Field(1.0, ge=0)
    """The distillation term's weight."""
    with_reward: bool = True
    """``true``: the task's reward advantage plus the distillation term; ``false``: distillation
    alone (the reward is still computed and logged, but teaches nothing)."""
    check_tolerance: float = Field(0.5, gt=0)
    """The largest per-token |Δ| allowed between the logprobs the teacher reports for tokens it
    samples and its scores of the same tokens (checked before any work; ``asyncrl doctor`` FAILs
    above it). The two are one forward pass batched differently: float32 keeps within 1e-4 (set
    that for a float32 teacher), a bf16/fp16 server rounds each logit (~0.1); 0.5 serves both."""
