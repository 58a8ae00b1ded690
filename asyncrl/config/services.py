"""What runs beside the two loops: logging, the gateway, the watchdog, hooks, Ray, weight sync."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from asyncrl.config.base import Section


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
