"""What is generated: the task, sampling, the workflow that runs an episode, the rollout side, evaluation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from asyncrl.config.base import Section


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
    ``num_people`` for multihop), or of a loader (``research``: ``train_hops``, the hop
    counts trained on); an unknown one exits 2 naming it."""
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
    thread_sharing: Literal["split", "colocated", "colocated_learner", "turns"] = "split"
    """How the engine and the learner share the cores where both compute on one machine
    (``runtime: local``, the built-in engine, ``async`` or ``one_step_off``). ``split``: each
    keeps its own count (``num_threads``, ``learner_threads``) always. ``colocated``: the side
    working alone takes every core — the learner while the engine waits on the staleness
    gate or has nothing queued, the engine while the learner waits for a batch — and the two
    keep to those counts while both work, never a thread more than the cores between them
    (a side waits for a core the other still holds until the other's next boundary); the
    engine switches between decode steps, the learner before each micro-batch's forward and
    backward pass (``asyncrl.core_budget``). ``colocated_learner``: only the learner takes
    every core when alone, the engine keeps its share (generation gains little from more
    threads, and shares its process with the event loop). ``turns``: the two never compute
    at once — the learner takes every core whenever it has work and the engine waits for it
    at its next decode step, the engine takes every core while the learner is idle (waiting
    for a batch, during a weight sync): where each side alone scales with the cores, as both
    do on a small CPU, running them side by side only adds contention, and what asynchrony
    keeps is generation running ahead, within η, in the learner's idle time (a learner step
    longer than 30 s, ``CoreBudget.max_wait_s``, lets the engine go on with one thread: counted as its
    wait); use it with ``partial_rollout: continue`` (``abort`` re-prefills whatever is
    under way at every sync). Its samples/s against ``sync``'s, measured: docs/scaling.md,
    "The learner first". Each step's row says how long each
    side had every core and waited for one (``time/learner_all_cores_s``,
    ``time/engine_core_wait_s``, …). ``sync`` already gives the working side every core:
    there it changes nothing. One rollout worker and one learner rank only."""
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
    kv_cache: Literal["auto", "dynamic", "static"] = "auto"
    """Built-in engine: where decoding keeps its KV cache. ``static``: buffers allocated once
    for ``max_batch_size`` rows (what a captured decode step needs: a graph holds
    addresses); ``dynamic``: transformers' growing cache; ``auto``: static on a GPU, dynamic
    on the CPU (where growing costs little and static buffers would hold memory idle)."""
    capture: Literal["auto", "off", "graphs", "compile"] = "auto"
    """Built-in engine, static KV cache: how the decode step runs. ``graphs``: replayed from
    CUDA graphs captured per batch-size bucket (GPU only); ``compile``: ``torch.compile``;
    ``off``: eager; ``auto``: graphs on a GPU, off on the CPU. A capture that fails falls back
    to eager with a warning naming why."""
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
    background: bool | None = None
    """Evaluate beside training, on an engine of evaluation's own holding the evaluated
    version, so training does not wait. Where that engine is, the kinds table's
    ``background_eval`` says: ``replica`` (``torch``), a copy of the weights per rollout
    worker; ``servers`` (``remote``, ``vllm``), the servers at ``eval.urls``.
    ``null`` (the default): beside training where it can be — ``one_step_off`` and ``async``,
    with ``rollout.thread_sharing: split`` for a replica (otherwise it would be a third thread
    team on cores the engine and the learner hand between them) or ``eval.urls`` given for
    servers — else blocking; the run's first line says which. ``true`` where it cannot be
    (``remote`` or ``vllm`` without ``eval.urls``) is refused naming the way. ``false``:
    training waits for every evaluation."""
    urls: list[str] = Field(default_factory=list)
    """With an engine kind that evaluates on servers (``remote``, ``vllm``): the base URLs of
    the servers evaluation runs on beside training (``asyncrl serve-engine`` or ``vllm
    serve``, started as ``remote.urls``' are). A URL that is also in ``remote.urls`` is a
    share of the fleet: it leaves the training pool for the whole run. The others are
    servers of evaluation's own. Each evaluation loads the version it scores on them
    (nothing else sends them weights meanwhile), so every token it scores is of that
    version; a token of another version fails the evaluation, naming the versions. They
    are reached with ``remote``'s settings (``api_key``, ``weights_dir``: under ``eval/`` there,
    the timeouts), their weights always as files. Empty: evaluations block training on these
    kinds."""
