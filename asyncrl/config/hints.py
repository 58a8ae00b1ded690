"""Errors that teach: the closest valid key, and what other frameworks call a key."""

from __future__ import annotations

import difflib
from typing import Any, NamedTuple

from pydantic import (
    ValidationError,
)


class CommonName(NamedTuple):
    """Another framework's name for a setting: ``key`` is ours (None: asyncrl has none),
    ``source`` whose name it is, ``note`` what differs."""

    key: str | None
    source: str
    note: str = ""


_THEIR_NAMES: dict[str, dict[str, str | None]] = {
    "TRL": {  # GRPOConfig and the Hugging Face TrainingArguments under it
        "learning_rate": "optim.lr", "num_generations": "group_size", "max_completion_length": "sampling.max_tokens",
        "beta": "algorithm.kl_coef", "epsilon": "algorithm.clip_low", "epsilon_high": "algorithm.clip_high",
        "per_device_train_batch_size": "optim.micro_batch_size", "gradient_accumulation_steps": None,
        "num_train_epochs": "total_steps", "max_steps": "total_steps", "num_iterations": "optim.ppo_epochs",
        "num_ppo_epochs": "optim.ppo_epochs", "num_mini_batches": "optim.mini_batches",
        "loss_type": "algorithm.aggregation", "scale_rewards": "algorithm.advantage", "use_vllm": "engine",
        "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization", "max_grad_norm": "optim.grad_clip",
        "lr_scheduler_type": "optim.schedule", "save_steps": "save_every", "eval_steps": "eval_every",
        "model_name_or_path": "model.path", "reward_funcs": "task.reward_fn", "train_dataset": "task.path",
        "eval_dataset": "task.validation_split"},
    "TRL and verl": {"temperature": "sampling.temperature", "kl_coef": "algorithm.kl_coef",
                     "max_prompt_length": None},
    "verl": {  # ppo_trainer.yaml
        "train_batch_size": "batch_size", "actor_rollout_ref.actor.optim.lr": "optim.lr",
        "actor_rollout_ref.model.path": "model.path", "rollout.n": "group_size",
        "max_response_length": "sampling.max_tokens", "response_length": "sampling.max_tokens",
        "ppo_mini_batch_size": "optim.mini_batches", "ppo_micro_batch_size_per_gpu": "optim.micro_batch_size",
        "ppo_micro_batch_size": "optim.micro_batch_size", "ppo_epochs": "optim.ppo_epochs",
        "clip_ratio": "algorithm.clip_low", "clip_ratio_low": "algorithm.clip_low",
        "clip_ratio_high": "algorithm.clip_high", "kl_loss_coef": "algorithm.kl_coef",
        "loss_agg_mode": "algorithm.aggregation", "adv_estimator": "algorithm.advantage",
        "total_training_steps": "total_steps", "total_epochs": "total_steps", "save_freq": "save_every",
        "test_freq": "eval_every", "project_name": "logging.wandb_project", "train_files": "task.path",
        "val_files": "task.validation_path", "custom_reward_function.path": "task.reward_fn",
        "custom_reward_function.name": "task.reward_fn", "prompt_key": None},
    "transformers": {"max_new_tokens": "sampling.max_tokens"},
    "AReaL": {"max_head_offpolicyness": "max_staleness"},
}


_PER_SAMPLE = "asyncrl counts trajectories (samples), not prompts"


_STEPS = "asyncrl counts optimizer steps, not epochs"


_NOTES = {
    "max_prompt_length": "asyncrl does not cut prompts, a task's prompt is sent whole; `sampling.max_tokens` bounds "
                         "the response",
    "epsilon": "the ratio is clipped below at 1 - ε",
    "temperature": "`eval.temperature` for evaluation",
    "per_device_train_batch_size": "trajectories per forward and backward; a step trains `batch_size` groups × "
                                   "`group_size` samples",
    "gradient_accumulation_steps": "a step trains `batch_size` groups × `group_size` samples in micro-batches of "
                                   "`optim.micro_batch_size` trajectories, and accumulates their gradients",
    "num_train_epochs": _STEPS, "total_epochs": _STEPS,
    "loss_type": "`token_mean` or `seq_mean`; Dr. GRPO's unscaled advantage is `algorithm.advantage=dr_grpo`",
    "scale_rewards": "`grpo` divides by the group's standard deviation, `dr_grpo` does not",
    "use_vllm": "`engine=vllm`",
    "kl_coef": "a k3 KL to the initial policy in the loss, as verl's `use_kl_loss`, not a penalty in the reward",
    "train_batch_size": "prompts (groups) per optimizer step",
    "ppo_mini_batch_size": "verl gives a mini-batch's size in prompts, asyncrl their number: `batch_size` / "
                           "`ppo_mini_batch_size`",
    "ppo_micro_batch_size_per_gpu": _PER_SAMPLE, "ppo_micro_batch_size": _PER_SAMPLE,
    "clip_ratio": "and `algorithm.clip_high` for the upper side",
    "loss_agg_mode": "`token_mean` or `seq_mean`",
    "max_head_offpolicyness": "η",
    "reward_funcs": "one function, TRL's or verl's form as written: `path/to/file.py:function`",
    "train_dataset": "with `task.name=hf`: a local `save_to_disk` directory or a parquet, arrow or jsonl file",
    "eval_dataset": "a split name or a slice of `task.path` (`test`, `train[-64:]`), or `task.validation_path`",
    "custom_reward_function.path": "`task.reward_fn: path/to/file.py:compute_score` names the file and the function",
    "custom_reward_function.name": "`task.reward_fn: path/to/file.py:compute_score` names the file and the function",
    "prompt_key": "`task.options.prompt_key` with `task.name=hf`",
}


COMMON_NAMES: dict[str, CommonName] = {
    name: CommonName(key, source, _NOTES.get(name, "")) for source, names in _THEIR_NAMES.items()
    for name, key in names.items()}
"""Names a newcomer from TRL or verl types, by their last dotted part or a longer tail of
it (``rollout.n``); an unknown key whose tail is here is answered with our key before any
spelling match (which would offer ``optim.mini_batches`` for ``optim.learning_rate``). Every
``key`` is one of ours and every name without one has a note (``tests/test_newcomer_hints.py``);
docs/config.md lists them."""


def _possessive(source: str) -> str:
    """``TRL and verl`` → ``TRL's and verl's``."""
    return " and ".join(f"{name}'s" for name in source.split(" and "))


def _leaves(key: str, value: Any) -> list[str]:
    """``key`` and, where its value is a mapping (an unknown section, such as verl's
    ``actor_rollout_ref``), each dotted key under it."""
    if not isinstance(value, dict) or not value:
        return [key]
    return [leaf for sub, inner in value.items() for leaf in _leaves(f"{key}.{sub}", inner)]


def _hint(key: str, valid: list[str]) -> str:
    """What to say after ``unknown config key 'key'``: another framework's name for one of
    ours; else one of ours ending as it does (``lr`` → ``optim.lr``); else the closest spelling."""
    parts = key.split(".")
    for i in range(len(parts)):  # the longest tail first: `rollout.n` before `n`
        tail = ".".join(parts[i:])
        if tail in COMMON_NAMES and (COMMON_NAMES[tail].key is None or COMMON_NAMES[tail].key in valid):
            ours, source, note = COMMON_NAMES[tail]  # only a key of the schema at hand (`sft` has fewer)
            said = f"`{tail}` is {_possessive(source)} name" + (f"; {note}" if note else "")
            return f"; did you mean {ours!r}? ({said})" if ours else f": {said}"
    for i in range(1, len(parts)):
        if (tail := ".".join(parts[i:])) in valid:
            return f"; did you mean {tail!r}?"
    same_name = [k for k in valid if k.rsplit(".", 1)[-1] == parts[-1]]
    if same_name:  # the shallowest first: a bare `lr` is the policy's `optim.lr`, not `critic.optim.lr`
        depth = min(k.count(".") for k in same_name)
        same_name = [k for k in same_name if k.count(".") == depth]
        return "; did you mean " + " or ".join(map(repr, same_name)) + "?"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5) or \
        difflib.get_close_matches(parts[-1], valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _explain(exc: ValidationError, valid: list[str]) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines += [f"unknown config key {leaf!r}{_hint(leaf, valid)}" for leaf in _leaves(key, err.get("input"))]
        elif not key or (err["type"] == "value_error" and isinstance(err.get("input"), dict)):  # a rule across keys
            lines.append(f"config: {err['msg'].removeprefix('Value error, ')}")
        else:  # a schedule key by the name it is written with (``max_staleness``)
            lines.append(f"config key {key.removeprefix('schedule.')!r}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)
