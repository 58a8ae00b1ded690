"""Everything that can be wrong with the input, checked before any work, for ``train``
and ``eval`` alike: the engine is installed, ``model.path`` is a causal LM with a
tokenizer that can render the workflow's prompts, the tasks load, the workflow and every
name the config gives (algorithms, hooks) resolve. A failure is a ``ConfigError``
naming the key (exit 2). Its first phase, the data and the named user code, needs no
torch: ``inputs.py``, which the CLI runs before torch loads and hands the result here."""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor

from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.algorithms import ADVANTAGE_ESTIMATORS, get_policy_loss, resolve
from asyncrl.algorithms.advantages import GROUP_RELATIVE
from asyncrl.config import Config, ConfigError
from asyncrl.engine import require_engine
from asyncrl.learner.lora import check_lora
from asyncrl.orchestrator.hooks import Hooks
from asyncrl.orchestrator.inputs import check_inputs
from asyncrl.orchestrator.invariants import TEACHER_FIX, TEACHER_LOGPROBS, teacher_logprob_evidence
from asyncrl.policy import adapter_base, check_policy, load_policy, resolve_model_path
from asyncrl.tasks.base import TaskSplits
from asyncrl.frozen.client import FrozenModelError
from asyncrl.frozen.teacher import LogprobCheck, TokenizerMismatch, check_logprobs, probe_prompts
from asyncrl.frozen.teacher import check_tokenizer as check_teacher_tokenizer
from asyncrl.orchestrator.rollout_loop import teacher_of
from asyncrl.rollout.workflows.registry import build_workflow, check_tokenizer


@dataclass
class Checked:
    """What pre-flight loaded on the way, so nothing is loaded twice."""

    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel | None  # None where the workers load their own (Ray, vLLM)
    splits: TaskSplits
    hooks: Hooks
    teacher_check: LogprobCheck | None = None  # the teacher's sampled logprobs against its scores


def check_teacher(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> LogprobCheck:
    """On-policy distillation's teacher answers and tokenizes as the student does, before any
    work (exit 2 naming both otherwise); then its sampled logprobs against its scores of the
    same tokens (:func:`check_logprobs`), said at once when beyond ``teacher.check_tolerance``
    and returned for the run's first row, where ``asyncrl doctor`` reads it. Run on a thread of
    its own: a caller may hold a loop."""
    teacher = teacher_of(cfg)
    assert teacher is not None

    async def check() -> LogprobCheck:
        try:
            await check_teacher_tokenizer(teacher, tokenizer, repr(cfg.model.path))
            return await check_logprobs(teacher, probe_prompts(tokenizer))
        finally:
            await teacher.close()

    with ThreadPoolExecutor(1) as pool:
        try:
            found = pool.submit(asyncio.run, check()).result()
        except (TokenizerMismatch, FrozenModelError) as exc:
            raise ConfigError(f"teacher.url: {exc}") from None
    if not found.max_abs_diff <= cfg.teacher.check_tolerance:  # said now; the run goes on, the doctor FAILs it
        said = teacher_logprob_evidence(cfg.teacher.url, found.max_abs_diff, found.tokens, cfg.teacher.check_tolerance)
        print(f"asyncrl: FAIL {TEACHER_LOGPROBS}: {said}; fix: {TEACHER_FIX} (asyncrl doctor RUN_DIR says it too)",
              file=sys.stderr, flush=True)
    return found


def preflight(cfg: Config, command: Literal["train", "eval", "plan"], splits: TaskSplits | None = None) -> Checked:
    """``plan``: a training run whose engines and learner are simulated (``asyncrl plan``):
    the checks of ``train`` without the engine or the weights, which it never runs.
    ``splits``: what :func:`check_inputs` returned for this config, where it ran already
    (the CLI's first phase); ``None`` runs it here, before anything loads."""
    trains = command in ("train", "plan")
    if trains:
        check_trainable(cfg)
    if splits is None:
        splits = check_inputs(cfg, command)
    kind = cfg.engine_kind
    if not kind.adapter_model_path and adapter_base(resolve_model_path(cfg.model.path)) is not None:
        raise ConfigError(f"model.path {cfg.model.path!r} holds LoRA adapters, which engine={kind.name} does not load: "
                          f"write the merged model (python -m asyncrl.learner.lora_merge {cfg.model.path} OUT) "
                          "and set model.path=OUT, or use engine=torch")
    if cfg.runtime == "local" and command != "plan":  # on Ray the workers' environment is what counts
        require_engine(cfg.engine)
    # this process needs the weights only where it runs a learner or a torch engine itself
    needs_model = cfg.runtime == "local" and (command == "train" or (command == "eval" and kind.in_process))
    model, tokenizer = load_policy(cfg.model) if needs_model else (None, check_policy(cfg.model))
    check_tokenizer(cfg, tokenizer)
    teacher_check = check_teacher(cfg, tokenizer) if trains and cfg.teacher.url else None
    if trains:
        check_lora(cfg.model, model)  # peft installed, model.lora.target_modules in the model
    build_workflow(cfg)  # the workers build their own; this refuses a bad one before any work
    hooks = Hooks.from_config(cfg.hooks) if trains else Hooks()
    if trains:
        try:
            resolve(ADVANTAGE_ESTIMATORS, cfg.algorithm.advantage, "advantage estimator")
        except KeyError as exc:
            raise ConfigError(f"algorithm.advantage: {exc.args[0]}") from None
        try:
            get_policy_loss(cfg.algorithm.policy_loss)  # and that it takes the learner's call
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"algorithm.policy_loss: {exc.args[0]}") from None
    return Checked(tokenizer, model, splits, hooks, teacher_check)


def check_trainable(cfg: Config) -> None:
    """Settings that are valid for ``eval`` or ``serve`` but under which training learns
    nothing: every group would score the same and be filtered (the watchdog would stop
    the run minutes later) or, unfiltered, train with advantage 0."""
    n, advantage, sampling = cfg.group_size, cfg.algorithm.advantage, cfg.sampling
    if n == 1 and advantage in GROUP_RELATIVE:
        raise ConfigError(f"group_size=1: algorithm.advantage={advantage!r} compares each sample with the others of "
                          "its task's group, so with one sample every advantage is 0 and nothing trains; use "
                          "group_size >= 2")
    greedy = ("sampling.temperature=0" if sampling.temperature == 0
              else "sampling.top_k=1" if sampling.top_k == 1 else None)
    if greedy and n > 1:
        raise ConfigError(f"{greedy} decodes greedily: the group_size={n} samples of a task are the same text, score "
                          "the same, and every group is filtered, so nothing trains; sample with a temperature > 0 "
                          "(evaluation has its own eval.temperature, where 0 is fine)")
