"""What is learned: the algorithm (advantages, the loss), the optimizer, the learner's ranks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from asyncrl.config.base import Section
from asyncrl.config.model import LoraConfig


class AlgorithmConfig(Section):
    advantage: str = "grpo"
    """Advantage estimator: ``grpo``, ``dr_grpo``, ``rloo`` (group-relative: one advantage per
    sample), ``gae`` (per token, from a critic's values: needs the ``critic`` section;
    docs/critic.md) or a registered name."""
    gamma: float = Field(1.0, ge=0, le=1)
    """``advantage: gae``: the discount per action (per model token; a tool's output or a
    user's turn between two model tokens costs one step, not one per token)."""
    lam: float = Field(0.95, ge=0, le=1)
    """``advantage: gae``: GAE's λ; 1 gives the Monte-Carlo return minus the value, 0 the
    one-step TD error."""
    whiten_advantages: bool | None = None
    """``advantage: gae``: standardise the advantages over the batch's model tokens (mean 0,
    std 1). ``None``: true with ``gae``; group-relative estimators are normalised per group
    already, so it is refused with them."""
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
    """Drop groups whose rewards are all equal (zero advantage) and release their quota.
    Group-relative estimators only: with ``gae`` such a group still has advantages (the
    critic's values differ by token), so it trains."""
    max_abs_reward: float = Field(1e6, gt=0)
    """A reward beyond ±this stops the run (exit 1, naming the task), as a NaN or infinite
    one does: advantages are float32, and rewards this large are almost always a bug in
    the reward function (``asyncrl/algorithms/finite.py``)."""

    @property
    def uses_critic(self) -> bool:
        """Its advantages are per token, from a critic's values (``gae``), computed by the
        learner when the batch trains; the rollout side carries the outcome rewards to it."""
        return self.advantage == "gae"

    @model_validator(mode="after")
    def _bands(self) -> AlgorithmConfig:
        if self.whiten_advantages is not None and not self.uses_critic:
            raise ValueError(f"algorithm.whiten_advantages={str(self.whiten_advantages).lower()} is for "
                             f"algorithm.advantage=gae (algorithm.advantage={self.advantage!r} normalises per group "
                             "already); leave it unset")
        for low, high in (("is_mask_low", "is_mask_high"), ("icepop_low", "icepop_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"algorithm.{low}={getattr(self, low)} must be below "
                                 f"algorithm.{high}={getattr(self, high)}")
        return self


class OptimizerConfig(Section):
    """AdamW and its LR schedule: the policy's (``optim``) and the critic's (``critic.optim``)."""

    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.99), strict=False)  # YAML gives a list
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: constant, or decay to 10 % of ``lr`` by ``total_steps``."""
    grad_clip: float = Field(1.0, gt=0)


class OptimConfig(OptimizerConfig):
    micro_batch_size: int = Field(64, ge=1)
    """Trajectories (conversations, in ``asyncrl sft``) per forward/backward; gradients
    accumulate to one optimizer step (``asyncrl/learner/core.py``, the one micro-batch loop)."""
    micro_batch_tokens: int | None = Field(4096, ge=1)
    """Padded positions per forward/backward (rows × the longest of them): a micro-batch
    also ends where its next trajectory would pass this (a longer one trains alone). The
    learner's activations grow with it, not with the trajectory count (a batch of long agent
    trajectories in one pass: docs/design.md, "Measurements behind choices in the code").
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


class CriticModelConfig(Section):
    path: str | None = None
    """The critic's starting weights: a causal LM directory (its backbone, with a new scalar
    value head) or a value model saved by a run (a checkpoint's ``critic/``). ``null``: the
    policy's ``model.path``. Its dtype and device are the policy's."""


class CriticConfig(Section):
    """A value model V(s) trained beside the policy, in the learner's own process and
    through the same training engine (``algorithm.advantage: gae``; docs/critic.md)."""

    model: CriticModelConfig = CriticModelConfig()
    value_clip: float | None = Field(0.2, gt=0)
    """ε_v: the value loss is ½·max((V − R)², (clip(V, V_old ± ε_v) − R)²), V_old the critic's
    values when the batch's returns were computed; ``null``: ½·(V − R)²."""
    warmup_steps: int = Field(0, ge=0)
    """The first this many batches train the critic only: the policy's weights stay as they
    are, but each batch is still a version (the engines, the staleness bound and
    ``total_steps`` count batches)."""
    optim: OptimizerConfig = OptimizerConfig()
    """The critic's own AdamW and LR schedule (over the run's ``total_steps``), on the
    policy's micro-batches."""
    ppo_epochs: int = Field(1, ge=1)
    """The critic's passes over each batch, against the same V_old and returns. With one
    optimizer step a batch (this and ``mini_batches`` both 1) V is V_old when the loss is
    taken and ``value_clip`` cannot bind; from the second step on it can (verl's
    ``critic.ppo_epochs``)."""
    mini_batches: int = Field(1, ge=1)
    """The critic's optimizer steps per pass: the batch's trajectories shuffled (its own seed)
    and cut into this many parts, as ``optim.mini_batches`` cuts the policy's."""
    lora: LoraConfig | None = None
    """LoRA adapters on the critic, as ``model.lora`` on the policy (its value head trains
    whole); ``null``: every weight trains. Its ``sync`` stays ``auto``: a critic is never sent."""

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_switch(cls, value: Any) -> Any:
        return ({} if value else None) if isinstance(value, bool) else value  # `critic.lora=true`

    @model_validator(mode="after")
    def _never_sent(self) -> CriticConfig:
        if self.lora is not None and self.lora.sync != "auto":
            raise ValueError(f"critic.lora.sync={self.lora.sync}: a critic is never sent to the engines; leave it "
                             "unset")
        return self


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
    ``fully_shard`` per decoder layer), ~1/N of them per rank, each rank reading only its
    shards from the model's safetensors files (no rank loads the whole model; docs/scaling.md
    says when it still does); ``ddp``: full replicas, gradients all-reduced. ``None``: fsdp2.
    Ignored at world_size 1."""
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
    url: str | None = None
    """A Tinker-API URL (``http://host:8200`` of ``asyncrl serve-tinker``, or Tinker's hosted
    service): the learner behind it, the rollout side here (``asyncrl/runtime/tinker_learner.py``,
    docs/tinker.md). It trains LoRA adapters (``model.lora``, alpha 32, no dropout) on the base model the server
    serves under ``tinker.base_model`` (default: ``model.path`` as written), which the engines
    here load too; the key is ``tinker.api_key`` or ``$TINKER_API_KEY``. ``null``: the learner
    in process (or its ranks beside it)."""
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
    def effective_strategy(self) -> Literal["fsdp2", "ddp"]:
        return self.strategy or "fsdp2"
