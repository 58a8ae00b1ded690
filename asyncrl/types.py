"""The data that crosses part boundaries: sampling requests, completions, trajectories.

Every token a learner may train on carries three aligned per-token fields: the loss mask
(1 = produced by the model, 0 = tool/environment text), the behavior logprob under the
sampling distribution that produced it, and the policy version of the weights that
produced it. Environment tokens carry logprob 0.0 and version ``NO_VERSION``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]
NO_VERSION = -1  # version of a token no policy produced (prompt, tool output)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. ``temperature == 0`` means greedy decoding."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Per-request seed (vLLM's ``seed``): the request's tokens then depend only on the
    weights, the prompt and this seed — not on what else is batched with it, nor when."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one request.

    ``logprobs[i]`` is log p(token_ids[i]) under softmax(logits / temperature) (raw logits
    when greedy), before top-k/top-p truncation, so a learner holding the same weights
    reproduces it from a plain forward pass. ``versions[i]`` is the engine's weight version
    when token i was sampled.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason


@dataclass
class Step:
    """One model call inside a trajectory, with its own copy of the conversation so far."""

    messages: list[dict[str, Any]] | None
    prompt_tokens: int
    response_tokens: int
    finish_reason: FinishReason
    num_resumes: int = 0
    reward: float = 0.0
    """This turn's own reward, given by the agent (``LLMClient.set_turn_reward``, the
    gateway's ``turn_reward`` endpoint) on top of the episode's outcome; 0 where it gave
    none. A critic's GAE puts it on the call's last sampled token
    (``algorithms/gae.token_rewards``); a group-relative estimator counts it in the
    episode's :attr:`Episode.total_reward`. A default, so records without it still load."""


@dataclass
class Trajectory:
    """One token sequence the learner can train on: ``prompt_ids + response_ids``.

    ``response_ids`` holds model tokens (mask 1) interleaved with tool/environment tokens
    (mask 0) in multi-turn conversations; the per-token lists are aligned with it.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: FinishReason = "stop"
    num_resumes: int = 0
    steps: list[Step] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    teacher_logprobs: list[float] | None = None
    """On-policy distillation (``teacher.url``): the frozen teacher's log-probability of each
    response token in its context, aligned like ``logprobs``; ``None`` without a teacher."""

    def __post_init__(self) -> None:
        self.check_aligned()

    def check_aligned(self) -> None:
        n = len(self.response_ids)
        lengths = (len(self.loss_mask), len(self.logprobs), len(self.versions))
        if any(length != n for length in lengths):
            raise ValueError(f"per-token fields misaligned: response {n}, mask/logprobs/versions {lengths}")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"per-token fields misaligned: response {n}, teacher_logprobs "
                             f"{len(self.teacher_logprobs)}")

    @property
    def resumed(self) -> bool:
        return self.num_resumes > 0

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def behavior_version_min(self) -> int:
        return min((v for v, m in zip(self.versions, self.loss_mask) if m), default=NO_VERSION)

    @property
    def behavior_version_max(self) -> int:
        return max((v for v, m in zip(self.versions, self.loss_mask) if m), default=NO_VERSION)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["steps"] = [Step(**s) for s in d.get("steps", [])]
        return cls(**d)


@dataclass(frozen=True)
class AgentDiagnostics:
    """What a multi-turn or agent episode did, kept in ``Episode.metadata["agent"]`` (as
    ``to_dict()``, so it survives the JSON checkpoint) and averaged per step into the
    ``agent/*`` keys of ``metrics.jsonl``.

    ``turns`` is model calls; ``tool_calls`` the tool/environment answers asked for;
    ``tool_errors`` those answers marked as failures (:func:`is_tool_error`) plus the
    model's tool calls too broken to parse; ``tool_latency_s`` the time spent outside the
    model between its calls (tools, and the agent's own code around them);
    ``cut_by_turn_limit``: the episode ended because its turn budget ran out while the
    model still wanted to act; ``duplicate_searches``: tool results that were the
    duplicate-search note (:func:`is_duplicate_search`) instead of results.
    """

    turns: int
    tool_calls: int
    tool_errors: int
    tool_latency_s: float
    model_tokens: int
    cut_by_turn_limit: bool
    duplicate_searches: int = 0  # a default: records written before it was counted still load

    @property
    def tokens_per_turn(self) -> float:
        return self.model_tokens / self.turns if self.turns else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; ``tokens_per_turn`` included for whoever reads the file."""
        return {**dataclasses.asdict(self), "tokens_per_turn": self.tokens_per_turn}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AgentDiagnostics:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


_TOOL_ERROR = re.compile(r"^\s*(error\b|\w+ failed:|unknown tool\b)", re.IGNORECASE)


def is_tool_error(content: Any) -> bool:
    """Whether a tool result says the tool failed. Tools answer a failure in text, for the
    model to read, so this is a convention on that text: it starts with ``error``
    (``"Error: timeout"``), ``<word> failed:`` (the retrieval client's ``"search failed:
    …"``) or ``unknown tool``. A result that starts otherwise is a result."""
    return isinstance(content, str) and _TOOL_ERROR.match(content) is not None


DUPLICATE_SEARCH = "duplicate search:"  # how the duplicate guard's note starts (asyncrl/tools/retrieval/duplicates.py)


def is_duplicate_search(content: Any) -> bool:
    """Whether a tool result is the duplicate guard's note (a search already made in the
    episode, answered with the note instead of results): a convention on the text, as
    :func:`is_tool_error` is, so the gateway counts it without knowing the agent."""
    return isinstance(content, str) and content.lstrip().lower().startswith(DUPLICATE_SEARCH)


EpisodeStatus = Literal["ok", "error"]


@dataclass(frozen=True)
class AttemptError:
    """One failed attempt of an episode (what ``errors.jsonl`` records)."""

    attempt: int
    exception: str  # "ValueError: reward service unavailable"
    traceback: str
    timed_out: bool = False  # ran past workflow.timeout_s (the watchdog says how many did)


@dataclass
class Episode:
    """What a workflow returns for one task: its trajectories, one reward, how it ended.

    ``status == "error"`` marks an episode whose workflow or reward function raised or
    timed out; ``error`` keeps the exception and its traceback for the logs.
    """

    task_id: str
    trajectories: list[Trajectory] = field(default_factory=list)
    reward: float = 0.0
    status: EpisodeStatus = "ok"
    error: str | None = None
    attempts: int = 1
    errors: list[AttemptError] = field(default_factory=list)  # every failed attempt, also of an ok episode
    timings: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    rewards: dict[str, float | None] = field(default_factory=dict)
    """Where ``task.reward_fn`` is a list: each function's value by name (``None``: not
    applicable), ``reward`` their weighted sum (``asyncrl/tasks/reward_sum.py``)."""
    reward_extras: dict[str, Any] = field(default_factory=dict)
    """verl's score dicts' keys besides ``score`` (kept for ``samples.jsonl``)."""

    @property
    def total_reward(self) -> float:
        """The outcome ``reward`` plus every per-turn reward (:attr:`Step.reward`) of the
        episode's model calls: the undiscounted return of the whole episode, which is what
        a group-relative estimator compares (GAE gets the parts, each on its own token)."""
        return self.reward + sum(s.reward for t in self.trajectories for s in t.steps)

    @property
    def finish_reason(self) -> FinishReason:
        if self.status == "error":
            return "error"
        return self.trajectories[-1].finish_reason if self.trajectories else "stop"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Episode:
        d = dict(d)
        d["trajectories"] = [Trajectory.from_dict(t) for t in d.get("trajectories", [])]
        d["errors"] = [AttemptError(**e) for e in d.get("errors", [])]
        return cls(**d)

    @classmethod
    def from_json(cls, line: str) -> Episode:
        return cls.from_dict(json.loads(line))


@dataclass
class Group:
    """The n episodes of one task, sampled under one prompt; advantages are per episode."""

    task_id: str
    episodes: list[Episode]
    advantages: list[float] | None = None

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(task_id=d["task_id"], episodes=[Episode.from_dict(e) for e in d["episodes"]],
                   advantages=d.get("advantages"))
