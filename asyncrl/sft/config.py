"""``asyncrl sft``'s configuration: every key, its type, default and meaning, once.

Loaded like ``asyncrl train``'s (``asyncrl/config/``): YAML, then dotted ``key=value``
overrides whose values parse as YAML; an unknown key or a wrong type raises
``ConfigError`` naming the key and the closest valid one, and the CLI exits 2. The
``model``, ``optim`` and ``learner`` sections are train's own, so a key means the same in
both commands (``model.dtype`` the weights' dtype, ``learner.autocast`` bf16 compute);
only some defaults differ (:data:`SFT_OPTIM`, :data:`SFT_LEARNER`), and the keys of what
SFT has not (sample reuse, rollouts beside the learner) are refused rather than ignored.
"""

from __future__ import annotations

from pathlib import Path
import warnings
from typing import Any

import yaml
from pydantic import Field, field_validator, model_validator

from asyncrl.config import (
    LearnerConfig,
    ModelConfig,
    OptimConfig,
    Section,
    apply_overrides,
    read_config_file,
    validate,
)

SFT_OPTIM: dict[str, Any] = {"lr": 1e-5, "betas": (0.9, 0.95), "schedule": "cosine", "micro_batch_size": 4}
"""``optim``'s defaults where ``asyncrl sft``'s differ from ``asyncrl train``'s: full
fine-tuning of a pretrained model wants a small LR (1e-5 to 5e-5 for 0.1-1B parameters),
decayed by the last step; a conversation is longer than a trajectory."""
SFT_LEARNER: dict[str, Any] = {"autocast": "off"}
"""``learner``'s defaults where ``asyncrl sft``'s differ: float32 compute unless asked, as
``asyncrl sft`` always did (``learner.autocast=bfloat16`` for bf16 compute)."""
RL_ONLY = {"optim": ("ppo_epochs", "mini_batches"), "learner": ("process", "streaming", "share_prompts")}
"""Keys of train's sections that mean nothing without rollouts: set in ``asyncrl sft``, refused."""


class SFTDataConfig(Section):
    train: list[str] = Field(default_factory=list)
    """JSONL files of conversations, one per line: ``{"messages": [...], "tools": [...]}``
    (OpenAI chat format; ``tools`` optional) or a bare list of messages. A single path may
    be given as a string. Every line is checked before training starts."""
    eval: list[str] = Field(default_factory=list)
    """Held-out conversations (same format), scored for ``eval_loss``; none: see
    ``eval_fraction``."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """With no ``eval`` files: this share of the train conversations (at least one) is held
    out, chosen by ``seed``. 0 = no held-out loss."""
    max_length: int = Field(2048, ge=2)
    """Tokens per conversation: a longer one is cut here (the count is said at the start);
    one with no assistant token left is dropped."""

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _one_path(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class SFTConfig(Section):
    output_dir: str = "runs/sft"
    """Where the fine-tuned model is saved (a Hugging Face directory: ``model.path`` of a
    later ``asyncrl train`` or ``serve``), with ``metrics.jsonl``, ``config.yaml`` and
    ``checkpoints/step_N``. One that holds an earlier run's ``metrics.jsonl`` is refused."""
    seed: int = 0
    """Seeds the conversation order, the ``eval_fraction`` split and torch."""
    model: ModelConfig = ModelConfig()
    data: SFTDataConfig = SFTDataConfig()
    epochs: int = Field(1, ge=1)
    """Passes over the train conversations, each in a fresh seeded order."""
    total_steps: int | None = Field(None, ge=1)
    """Optimizer steps; ``None``: ``epochs`` passes (the last batch of a pass may be smaller)."""
    batch_size: int = Field(8, ge=1)
    """Conversations per optimizer step. The loss is the mean over the step's assistant
    tokens, so a long conversation counts by its tokens."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(**SFT_OPTIM))
    """train's ``optim`` (AdamW, the LR schedule, clipping, micro-batches), defaults
    :data:`SFT_OPTIM` where SFT's differ. Micro-batches hold conversations of similar
    length; any split takes the same step. ``ppo_epochs`` and ``mini_batches`` (sample
    reuse) stay 1."""
    learner: LearnerConfig = Field(default_factory=lambda: LearnerConfig(**SFT_LEARNER))
    """train's ``learner``: ``world_size`` ranks (``asyncrl sft`` starts them, each on its
    rows of a step; or run under ``torchrun``), ``strategy``, ``backend``, ``timeout_s``
    and ``autocast`` (default ``off`` here). ``process``, ``streaming`` and
    ``share_prompts`` are RL's."""
    eval_every: int = Field(0, ge=0)
    """Steps between held-out losses; also before the first step and after the last
    (0 = only those two)."""
    save_every: int = Field(0, ge=0)
    """Steps between checkpoints in ``output_dir/checkpoints/step_N`` (0 = none: only the
    final model, in ``output_dir``)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted after each save."""
    resume: bool = False
    """Continue the run in ``output_dir`` from its newest complete ``checkpoints/step_N``
    (weights or LoRA adapters, AdamW state, schedule, RNG), with the same settings: the
    steps after it are the ones the uninterrupted run would have taken."""

    @field_validator("optim", "learner", mode="before")
    @classmethod
    def _sft_defaults(cls, value: Any, info: Any) -> Any:
        """A partial section (``optim.lr=3e-3``) keeps SFT's defaults for the rest."""
        defaults = SFT_OPTIM if info.field_name == "optim" else SFT_LEARNER
        return {**defaults, **value} if isinstance(value, dict) else value

    @model_validator(mode="before")
    @classmethod
    def _old_bfloat16(cls, data: Any) -> Any:
        """``model.dtype: bfloat16`` once meant bf16 compute over float32 weights in
        ``asyncrl sft`` alone; it now means the weights' dtype, as in train. An old config
        keeps what it ran: read as ``learner.autocast: bfloat16`` over float32 weights."""
        model = data.get("model") if isinstance(data, dict) else None
        if not (isinstance(model, dict) and model.get("dtype") == "bfloat16"):
            return data
        learner = data.get("learner") or {}
        if isinstance(learner, dict) and "autocast" in learner:
            raise ValueError("model.dtype: bfloat16 and learner.autocast both set: for bf16 compute over float32 "
                             "weights set learner.autocast=bfloat16 alone (asyncrl sft keeps its weights float32)")
        warnings.warn("asyncrl sft: model.dtype=bfloat16 read as learner.autocast=bfloat16 with float32 weights "
                      "(what it always ran); write learner.autocast=bfloat16 instead", UserWarning, stacklevel=2)
        return {**data, "model": {**model, "dtype": "float32"},
                "learner": {**learner, "autocast": "bfloat16"} if isinstance(learner, dict) else learner}

    @model_validator(mode="after")
    def _consistent(self) -> SFTConfig:
        if "path" not in self.model.model_fields_set:  # train's default (a Countdown policy) is no one's SFT base
            raise ValueError("model.path: name the model to fine-tune (a Hugging Face directory with a chat "
                             "template, or a fetched model's name such as smollm2-135m-instruct)")
        if not self.data.train:
            raise ValueError("data.train: name at least one JSONL file of conversations "
                             "(e.g. data.train=examples/sft/conversations.jsonl)")
        if self.data.eval and self.data.eval_fraction:
            raise ValueError("data.eval and data.eval_fraction both set: hold out with one of them "
                             "(data.eval_fraction=0, or data.eval=[])")
        if self.model.dtype != "float32":
            raise ValueError(f"model.dtype {self.model.dtype!r}: asyncrl sft keeps float32 weights and AdamW state "
                             "(a bf16 weight loses updates below 1/256 of itself); for bf16 compute set "
                             "learner.autocast=bfloat16")
        for section, keys in RL_ONLY.items():
            given = sorted(set(keys) & getattr(self, section).model_fields_set)
            if given:
                raise ValueError(f"{section}.{given[0]}: a key of asyncrl train (rollouts, sample reuse) that "
                                 "asyncrl sft has no use for; remove it")
        if self.model.lora is not None and self.learner.world_size > 1:
            raise ValueError("model.lora trains on one learner rank: set learner.world_size=1")
        return self


def load_sft_config(path: str | Path, overrides: list[str] = ()) -> SFTConfig:
    """The file's settings with ``overrides`` applied; raises ``ConfigError``."""
    return validate(SFTConfig, apply_overrides(read_config_file(path), list(overrides)))


def save_sft_config(config: SFTConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
