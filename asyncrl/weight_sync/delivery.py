"""Weights delivered, checked: after a weight sync, every engine computes the learner's
policy at that version, or the run stops (``weight_sync.check_every``).

A sync can report success and deliver nothing: the engine stamps the new version on its
tokens while it still holds the old weights (a LoRA adapter that never reached the engine
looked like a staleness problem for two months in verl, #7495). ``check_served`` sees only
the version; this module looks at the function. After every ``check_every``-th sync each
engine decodes a fixed probe (:data:`PROBE_TEXTS`, tokenized by the run's tokenizer)
greedily through the engine protocol's own ``generate`` (so any engine: the built-in one,
vLLM, on Ray or in process), and the learner scores the same tokens with one plain
forward pass of its current weights: log softmax of the raw logits, which is what an
engine reports for a greedy token (``Completion``). Every token's |Δ| must be within
``weight_sync.check_tolerance`` (:func:`check_tolerance` picks it from the dtypes when it is
unset: :data:`FLOAT32_TOLERANCE` in float32, :data:`ROUNDED_TOLERANCE` when either side's
weights are bf16/fp16); otherwise
:class:`WeightsNotDelivered` stops the run (exit 1) naming the version, the worker, the
max |Δ| and what to do. The learner scores without autocast, in its weights' own dtype,
and in eval mode (no dropout), so what it computes is the policy itself.

Greedy tokens rather than fixed completions: the engine contract has no "score these
tokens" call, and a greedy continuation is as fixed as its weights, so the two sides see
the same sequence whenever the engine holds the learner's weights.

An engine that is a fleet (``engine: remote``: one client, many servers) is probed server
by server (its ``probe_each``): the served model itself, through the same
``/v1/completions`` request the rollouts make (naming the LoRA adapter it was sent, when
it was sent adapters), so a server that loaded a wrong file or never got its adapter is
named, not hidden behind one that did. A greedy token's logprob is the raw log softmax
there too (``vllm serve``'s processed logprobs skip the temperature for greedy requests).

Beside the check, :meth:`DeliveryCheck.after_sync` reports ``weight_sync/bytes``: the bytes
one engine is sent per sync (``Learner.engine_weights``: every parameter with full
fine-tuning; with LoRA the adapters, or the targeted layers merged), counted once (the names and shapes
never change within a run).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol


import torch

from asyncrl.algorithms import token_logprobs
from asyncrl.model_untie import model_path_ties_head
from asyncrl.types import SamplingParams
from asyncrl.weight_sync.group import WeightSyncError

PROBE_TEXTS = ("12+34=", "The answer is", "def f(x): return", "Q: what is 7 times 8?")
"""The probe's prompts, the same in every run (short: any model's context holds them)."""
PROBE_TOKENS = 4
"""Greedy tokens each engine decodes per prompt."""
PROBE_MAX_PROMPT = 16
"""A prompt's tokens beyond this are cut (a tokenizer of single bytes makes long prompts)."""


FLOAT32_TOLERANCE = 1e-4
"""The probe's bound when the engines' and the learner's weights are both float32: the
engine/learner difference in float32, the adapters' forward against the merged weights
included (``docs/scaling.md``, LoRA)."""
ROUNDED_TOLERANCE = 0.5
"""The probe's bound when either side's weights are bf16 or fp16 (``rollout.dtype``,
``model.dtype``): the engine then computes with the learner's weights rounded, and a greedy
token's logprob moves with the rounding. Measured for a bf16 engine against a float32
learner: 0.015–0.023 on the tiny Countdown policy, 0.019 on the tiny addition one,
0.077–0.105 on SmolLM2-135M (docs/results.md, "Precision"); 0.5 leaves a margin, while
weights that were not delivered at all (another checkpoint, an adapter never applied)
still differ by more. A sync whose weights moved less than this cannot be told from a
delivered one: the price of a rounded engine."""


def check_tolerance(setting: float | None, weights_dtype: str, engine_dtype: str) -> float:
    """The delivery probe's bound: ``weight_sync.check_tolerance`` when set, else picked
    from ``model.dtype`` (the learner's weights, which score the probe without autocast)
    and the engines' (``Config.engine_dtype``)."""
    if setting is not None:
        return setting
    return FLOAT32_TOLERANCE if weights_dtype == engine_dtype == "float32" else ROUNDED_TOLERANCE


class WeightsNotDelivered(WeightSyncError):
    """An engine does not compute the learner's policy after a sync; the message names the
    version, the worker, the max |Δ| and what to do (the CLI prints it alone, exit 1).
    ``probe_max_abs_diff`` is that |Δ| (NaN when the engine sampled at another version), for
    the failed step's metrics row: the trainer writes it before the run stops."""

    def __init__(self, message: str, probe_max_abs_diff: float = float("nan")) -> None:
        super().__init__(message)
        self.probe_max_abs_diff = probe_max_abs_diff


class Handle(Protocol):
    async def apply(self, fn: Callable[..., Any], *args: Any) -> list[Any]: ...


# ------------------------------------------------------------ inside the workers
Probed = list[tuple[list[int], list[float], list[int]]]
"""One engine's probe: (tokens, logprobs, versions) per prompt."""


async def engine_probe(worker: Any, index: int, prompts: list[list[int]]) -> list[tuple[str, Probed]]:
    """Rollout worker ``index``'s engine decodes each prompt greedily: (who, its probe) for
    the engine, or for each server of a fleet (a kind whose ``fleet`` is true)."""
    engine = await worker.ready_engine()
    sampling = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0)
    if engine.kind.fleet:  # one client, many servers: each probed apart
        return [(f"rollout worker {index}'s {who}", [(c.token_ids, c.logprobs, c.versions) for c in done])
                for who, done in await engine.probe_each(prompts, sampling)]
    done = await asyncio.gather(*[engine.generate(list(p), sampling) for p in prompts])
    return [(f"rollout worker {index}", [(c.token_ids, c.logprobs, c.versions) for c in done])]


def learner_probe(worker: Any, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """log π(token) of each (prompt, completion)'s completion tokens under the learner's
    current weights. Every rank runs it (a sharded forward is a collective of the learner's
    group). The rank answers for itself (``LearnerWorker.probe_logprobs``: :func:`forward_logprobs`
    of its learner; a learner by URL asks its server, ``asyncrl/runtime/tinker_learner.py``)."""
    return worker.probe_logprobs(sequences)


def forward_logprobs(learner: Any, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """The probe on a learner in this process: one plain forward of its ``model`` per
    sequence, raw logits (what an engine reports for a greedy token), the weights' own dtype
    (no autocast), eval mode (no dropout): the policy itself."""
    model = learner.model
    training = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad():
            for prompt, completion in sequences:
                if not completion:
                    out.append([])
                    continue
                ids = torch.tensor([prompt + completion], device=learner.device)
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
                out.append(token_logprobs(logits[len(prompt) - 1:-1], ids[0, len(prompt):]).tolist())
    finally:
        model.train(training)
    return out


def engine_weight_bytes(worker: Any) -> int:
    """The bytes of what one engine is sent per sync (``Learner.engine_weights``)."""
    return worker.engine_update_bytes()


# ------------------------------------------------------------ the trainer's side
def probe_prompts(tokenizer: Any) -> list[list[int]]:
    """:data:`PROBE_TEXTS` as the run's tokenizer makes them (no special tokens)."""
    prompts = [tokenizer(text, add_special_tokens=False).input_ids[:PROBE_MAX_PROMPT] for text in PROBE_TEXTS]
    return [p for p in prompts if p]


def max_abs_diff(engine: list[list[float]], learner: list[list[float]]) -> float:
    return max((abs(e - lp) for es, ls in zip(engine, learner) for e, lp in zip(es, ls)), default=0.0)


class DeliveryCheck:
    """Called after each weight sync (:meth:`after_sync`); holds the run's probe and
    cadence. ``every`` 0: no probe (the bytes are still reported)."""

    def __init__(self, learner: Handle, rollout: Handle, tokenizer: Any, *, every: int, tolerance: float,
                 tied_head: str | None = None) -> None:
        """``tied_head``: the ``model.path`` of a model whose LM head is tied to its embeddings
        on a fleet of servers (where a reload over HTTP may leave the head behind): a failed
        probe then names the head and ``asyncrl models untie``, not the tolerance."""
        self.learner, self.rollout = learner, rollout
        self.every, self.tolerance, self.tied_head = every, tolerance, tied_head
        self.prompts = probe_prompts(tokenizer)
        self.syncs = 0
        self.bytes: int | None = None
        self._unsupported = False  # a runtime that runs no functions in its workers (asyncrl plan's simulated one)

    @classmethod
    def for_config(cls, learner: Handle, rollout: Handle, tokenizer: Any, cfg: Any) -> DeliveryCheck:
        """The check a run's ``Config`` asks for: ``weight_sync.check_every``, and the
        tolerance :func:`check_tolerance` resolves from it and the dtypes."""
        return cls(learner, rollout, tokenizer, every=cfg.weight_sync.check_every,
                   tolerance=check_tolerance(cfg.weight_sync.check_tolerance, cfg.model.dtype, cfg.engine_dtype),
                   tied_head=cfg.model.path if cfg.engine_kind.fleet and model_path_ties_head(cfg.model.path) else None)

    async def after_sync(self, version: int) -> dict[str, float]:
        """The sync's metrics (``weight_sync/bytes``; on a checked sync
        ``weight_sync/probe_max_abs_diff`` and ``time/delivery_check``); raises
        :class:`WeightsNotDelivered` when an engine's logprobs are off."""
        self.syncs += 1
        if self._unsupported:
            return {}
        try:
            if self.bytes is None:
                self.bytes = (await self.learner.apply(engine_weight_bytes))[0]
            metrics: dict[str, float] = {"weight_sync/bytes": self.bytes}
            if self.every and self.prompts and (self.syncs - 1) % self.every == 0:  # the first sync is checked
                start = time.perf_counter()
                metrics["weight_sync/probe_max_abs_diff"] = await self.check(version)
                metrics["time/delivery_check"] = time.perf_counter() - start
        except NotImplementedError:  # asyncrl plan's simulated handles: no weights to check, nothing to say
            self._unsupported = True
            return {}
        return metrics

    async def check(self, version: int) -> float:
        """The largest |Δ| over every engine and probe token; raises past the tolerance."""
        engines = [engine for worker in await self.rollout.apply(engine_probe, self.prompts) for engine in worker]
        worst = 0.0
        for who, probed in engines:
            stale = sorted({v for _, _, versions in probed for v in versions if v != version})
            if stale:
                raise WeightsNotDelivered(
                    f"weights not delivered: after the weight sync of version {version}, {who} "
                    f"sampled the delivery probe at version(s) {stale}")
            sequences = [(prompt, tokens) for prompt, (tokens, _, _) in zip(self.prompts, probed)]
            learned = (await self.learner.apply(learner_probe, sequences))[0]
            diff = max_abs_diff([logprobs for _, logprobs, _ in probed], learned)
            if not diff <= self.tolerance:  # NaN fails too
                if self.tied_head is not None:
                    raise WeightsNotDelivered(
                        f"weights not delivered: after the weight sync of version {version}, {who}'s logprobs on the "
                        f"delivery probe differ from the learner's by up to {diff:.3g} (max |Δ|), and model.path "
                        f"{self.tied_head!r} ties its LM head to its input embeddings (tie_word_embeddings): a server "
                        "that keeps a packed copy of a tied head (vLLM's CPU build) does not refresh it on a reload "
                        "over HTTP, so it samples from the old head; a higher tolerance would hide that. Untie it "
                        f"once, `asyncrl models untie {self.tied_head}`, start the servers on the copy it prints and "
                        "set model.path to it", probe_max_abs_diff=diff)
                raise WeightsNotDelivered(
                    f"weights not delivered: after the weight sync of version {version}, {who}'s "
                    f"logprobs on the delivery probe differ from the learner's by up to {diff:.3g} (max |Δ|; "
                    f"weight_sync.check_tolerance={self.tolerance:g}). The engine reports version {version} but "
                    "does not compute the policy the learner trained, so it samples from other weights. Check that "
                    "the engine loads what the learner sends (its update_weights: FullWeights, or with model.lora "
                    "an AdapterUpdate it merges onto its base); if the difference is rounding "
                    "(float16, another engine's kernels), raise weight_sync.check_tolerance; "
                    "weight_sync.check_every=0 turns the check off.", probe_max_abs_diff=diff)
            worst = max(worst, diff)
        return worst
