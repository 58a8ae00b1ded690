"""The task splits and the reward a config names, built and checked with neither torch nor
the model: pre-flight runs this first (``asyncrl/orchestrator/inputs.py``), so a missing
data file, a missing column or a wrong reward path is reported before the weights load.
Every problem is a ``ConfigError`` naming the key (exit 2)."""

from __future__ import annotations

from asyncrl.config import Config, ConfigError
from asyncrl.frozen.judge import JUDGE, JudgeReward, judge_from_config
from asyncrl.plugins import load_named
from asyncrl.tasks import default_reward_fn, load_tasks
from asyncrl.tasks.base import RewardFn, TaskSplits
from asyncrl.tasks.reward_forms import check_reward_fits, recognise_reward
from asyncrl.tasks.reward_sum import RewardSum


def build_tasks(cfg: Config) -> TaskSplits:
    """The task splits, with any dataset problem reported as a config error (exit 2), and
    the configured reward's arguments checked against their columns."""
    t = cfg.task
    try:
        splits = load_tasks(t.name, path=t.path, validation_path=t.validation_path, seed=cfg.seed,
                            num_train=t.num_train, num_validation=t.num_validation, options=t.options,
                            split=t.split, validation_split=t.validation_split)
    except ValueError as exc:  # TaskDataError included: it names the file and line
        raise ConfigError(f"task: {exc}") from None
    chats = [task for task in splits.train + splits.validation if task.messages is not None]
    if chats and not cfg.workflow.use_chat_template:
        raise ConfigError(f"workflow.use_chat_template=false, but task {chats[0].id!r} (and {len(chats) - 1} more) "
                          "gives its prompt as chat messages, which only the chat template renders; set it to true")
    if cfg.task.reward_fn and cfg.workflow.name != "openai_agent":
        reward_fn = build_reward_fn(cfg)
        members = reward_fn.members if isinstance(reward_fn, RewardSum) else [reward_fn]
        for key, spec, member in zip(_reward_keys(cfg), _specs(cfg), members):
            try:
                if isinstance(member, JudgeReward):
                    member.check_tasks(splits.train + splits.validation)
                check_reward_fits(member, splits.train + splits.validation)
            except (ValueError, KeyError) as exc:
                raise ConfigError(f"{key} {spec!r}: {exc}") from None
    return splits


def build_reward_fn(cfg: Config) -> RewardFn:
    """``task.reward_fn`` recognised (asyncrl's, TRL's or verl's form), a :class:`RewardSum`
    where it is a list or ``task.reward_weights`` is set; else the task's own reward."""
    t = cfg.task
    if not t.reward_fn:
        if t.reward_weights is not None:
            raise ConfigError("task.reward_weights weighs the functions of task.reward_fn, which is not set")
        try:
            return default_reward_fn(t.name)
        except ValueError as exc:
            raise ConfigError(f"task.reward_fn: {exc}") from None
    members = []
    for key, spec in zip(_reward_keys(cfg), _specs(cfg)):
        if spec == JUDGE:  # the `judge:` section's model grades the response
            if not (cfg.judge.url or cfg.judge.reward_model):
                raise ConfigError(f"{key} names the judge, but neither judge.url nor judge.reward_model is set: "
                                  "give the judge's server (judge.url=http://host:port) or a reward model's directory")
            members.append(judge_from_config(cfg.judge))
            continue
        try:
            members.append(recognise_reward(load_named(spec, key=key), spec))
        except ValueError as exc:
            raise ConfigError(str(exc) if str(exc).startswith(key) else f"{key}: {exc}") from None
    if isinstance(t.reward_fn, str) and t.reward_weights is None:
        return members[0]
    try:
        return RewardSum(members, t.reward_weights)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _specs(cfg: Config) -> list[str]:
    spec = cfg.task.reward_fn
    return [spec] if isinstance(spec, str) else list(spec or [])


def _reward_keys(cfg: Config) -> list[str]:
    """The key each spec came from, as the user edits it: ``task.reward_fn``, or
    ``task.reward_fn[i]`` in a list."""
    if isinstance(cfg.task.reward_fn, str):
        return ["task.reward_fn"]
    return [f"task.reward_fn[{i}]" for i in range(len(_specs(cfg)))]
