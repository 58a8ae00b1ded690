"""``asyncrl sft``'s configuration: every key, its type, default and meaning, once.

Loaded like ``asyncrl train``'s (``asyncrl/config/``): YAML, then dotted ``key=value``
overrides whose values parse as YAML; an unknown key or a wrong type raises
``ConfigError`` naming the key and the closest valid one, and the CLI exits 2. The
``model`` section is train's own, so ``model.path`` means the same in both commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from asyncrl.config import ModelConfig, Section, apply_overrides, read_config_file, validate


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


class SFTOptimConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of AdamW. Full fine-tuning of a pretrained model wants a small
    one: 1e-5 to 5e-5 for 0.1-1B parameters."""
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.95), strict=False)  # YAML gives a list
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, (step + 1) / warmup_steps, so the first step already trains."""
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """After warm-up: constant, or decay to 10 % of ``lr`` by the last step."""
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(4, ge=1)
    """Conversations per forward/backward; a step's ``batch_size`` conversations are cut
    into micro-batches of similar length and their gradients accumulated."""
    micro_batch_tokens: int | None = Field(4096, ge=1)
    """Padded positions per forward/backward (rows × the longest of them): a micro-batch
    also ends where its next conversation would pass this (a longer one trains alone).
    ``None``: ``micro_batch_size`` alone. Any split takes the same step."""


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
    optim: SFTOptimConfig = SFTOptimConfig()
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
        if self.model.dtype == "float16":
            raise ValueError("model.dtype 'float16' needs loss scaling, which asyncrl sft does not do: "
                             "use bfloat16 (or float32)")
        return self


def load_sft_config(path: str | Path, overrides: list[str] = ()) -> SFTConfig:
    """The file's settings with ``overrides`` applied; raises ``ConfigError``."""
    return validate(SFTConfig, apply_overrides(read_config_file(path), list(overrides)))


def save_sft_config(config: SFTConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
