"""One factory: the engine a config names, built from its row of the kinds table.

``build_engine`` reads ``ENGINE_KINDS[cfg.engine].builder`` and calls it; each builder
below knows its own kind's construction and nothing else. A rollout worker, ``serve-engine``
and the benchmarks all come through here, so no caller asks an engine's name.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.config.engine_kinds import engine_kind
from asyncrl.engine.protocol import AdapterUpdate, FullWeights, RolloutEngine, WeightUpdate, as_update

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from asyncrl.config import Config
    from asyncrl.config.rollout import RolloutConfig
    from asyncrl.core_budget import ThreadBudget
    from asyncrl.engine.torch_engine import TorchEngine


@dataclass
class EngineRequest:
    """What a worker hands the factory. ``model``: the policy already in memory (the torch
    engine takes it over; None: loaded from ``model.path``). ``weights``: the latest published
    update, applied before any request. ``eval_replica``: also build an engine of evaluation's
    own, for evaluation beside training: a replica (``background_eval`` ``replica``) or a
    client of ``eval.urls``' servers (``servers``).
    ``thread_budget``: the cores the training engine shares with the learner."""

    seed: int
    version: int
    model: PreTrainedModel | None = None
    weights: WeightUpdate | None = None
    num_threads: int | None = None
    eval_replica: bool = False
    thread_budget: ThreadBudget | None = None
    tokenizer: Any = None
    """The run's tokenizer: servers by URL are checked to tokenize as it does."""


@dataclass
class BuiltEngines:
    engine: RolloutEngine
    eval_engine: RolloutEngine | None = None


async def build_engine(cfg: Config, request: EngineRequest) -> BuiltEngines:
    """The engine(s) of ``cfg.engine``, started, with ``request.weights`` applied."""
    kind = engine_kind(cfg.engine)
    if (missing := kind.missing()) is not None:
        raise RuntimeError(missing)
    if request.eval_replica and kind.background_eval == "servers" and not cfg.eval.urls:
        raise ValueError(f"engine={kind.name} evaluates beside training on eval.urls' servers, and there are none "
                         "(the config refuses eval.background=true without them)")
    module, function = kind.builder.split(":")
    builder = getattr(importlib.import_module(module), function)
    return await builder(cfg, request)


async def _apply_latest(engine: RolloutEngine, request: EngineRequest) -> None:
    """The latest published weights, before any request (the engine loaded ``model.path``)."""
    if request.weights is not None:
        await engine.update_weights(as_update(request.weights), request.version)


async def build_remote(cfg: Config, request: EngineRequest) -> BuiltEngines:
    """Servers the user started (``asyncrl serve-engine``, ``vllm serve``), behind one client:
    ``remote.urls`` less the share ``eval.urls`` takes (``Config.training_urls``)."""
    from asyncrl.engine.remote import RemoteEngine

    engine = await RemoteEngine.connect(cfg.remote.model_copy(update={"urls": cfg.training_urls}),
                                        version=request.version, fresh=request.weights is None,
                                        tokenizer=request.tokenizer, model_path=cfg.model.path)
    await _apply_latest(engine, request)
    return BuiltEngines(engine, await _with_eval_servers(cfg, request, engine))


async def build_vllm(cfg: Config, request: EngineRequest) -> BuiltEngines:
    """vLLM's ``AsyncLLM`` on ``model.path``, in processes of its own."""
    import torch

    from asyncrl.engine.vllm_engine import VLLMEngine, engine_args
    from asyncrl.policy import resolve_model_path

    device = cfg.model.device
    on_cpu = device.startswith("cpu") or (device == "auto" and not torch.cuda.is_available())
    engine = await VLLMEngine.start(str(resolve_model_path(cfg.model.path)), seed=request.seed,
                                    version=request.version, max_batch_size=cfg.rollout.max_batch_size,
                                    dtype=cfg.engine_dtype, **engine_args(cfg.vllm, on_cpu=on_cpu))
    await _apply_latest(engine, request)
    return BuiltEngines(engine, await _with_eval_servers(cfg, request, engine))


async def _with_eval_servers(cfg: Config, request: EngineRequest, engine: RolloutEngine) -> RolloutEngine | None:
    """With ``request.eval_replica``: a client of ``eval.urls``' servers, brought to the
    request's weights and version, for evaluation beside training (``servers`` in the
    kinds table). Only evaluation sends them weights — each evaluation the version it
    scores (``RolloutWorker.evaluate``) — so they never move on during one. Their weights
    go as files (an NCCL group is the training fleet's), under ``remote.weights_dir/eval``
    where that is set (the training client writes the same names beside). ``engine``, the
    training one already started, is shut down when they cannot be used."""
    if not request.eval_replica:
        return None
    from pathlib import Path

    from asyncrl.engine.remote import RemoteEngine

    shared = cfg.remote.weights_dir
    settings = cfg.remote.model_copy(update={"urls": list(cfg.eval.urls), "weight_transfer": "files",
                                             "weights_dir": str(Path(shared) / "eval") if shared else None})
    try:
        eval_engine = await RemoteEngine.connect(settings, version=request.version, fresh=request.weights is None,
                                                 tokenizer=request.tokenizer, model_path=cfg.model.path,
                                                 key="eval.urls")
        try:
            await _apply_latest(eval_engine, request)
        except BaseException:
            await eval_engine.shutdown()
            raise
    except BaseException:
        await engine.shutdown()
        raise
    return eval_engine


async def build_torch(cfg: Config, request: EngineRequest) -> BuiltEngines:
    """The built-in engine on ``request.model`` (or ``model.path``), full weights loaded into
    the model before the engine takes it; adapters merged by each engine onto its own copy
    of the base (``asyncrl/engine/adapters.py``). The evaluation replica is a deep copy."""
    from asyncrl.policy import load_policy
    from asyncrl.seeding import derive_seed

    model = request.model if request.model is not None else load_policy(cfg.model)[0]
    update = as_update(request.weights) if request.weights is not None else None
    if isinstance(update, FullWeights):
        model.load_state_dict(dict(update.tensors), strict=False)  # tied weights appear once in an export

    def make(m: Any, seed: int, budget: ThreadBudget | None = None) -> TorchEngine:
        return torch_engine(m, cfg.rollout, seed=seed, version=request.version, num_threads=request.num_threads,
                            dtype=cfg.engine_dtype, thread_budget=budget)

    eval_engine = None
    if request.eval_replica:
        eval_engine = make(copy.deepcopy(model), derive_seed(request.seed, "eval_replica"))
    engine = make(model, request.seed, request.thread_budget)
    if isinstance(update, AdapterUpdate):
        for each in (engine, eval_engine):
            if each is not None:
                await each.update_weights(update, request.version)
    return BuiltEngines(engine, eval_engine)


def torch_engine(model: PreTrainedModel, rollout: RolloutConfig, *, seed: int = 0, version: int = 0,
                 num_threads: int | None = None, dtype: str | None = None,
                 thread_budget: ThreadBudget | None = None) -> TorchEngine:
    """The built-in engine over ``model`` with a config's ``rollout`` settings (batch rows,
    group prefill, KV cache, decode capture, weight noise; ``dtype``: the engine's weights',
    None for the model's own). Every ``TorchEngine`` in the house is made here — a run's
    workers (:func:`build_torch`), serve-tinker's sampler, the tiny policies' scoring, the
    benchmarks — so a setting of the config's reaches each of them."""
    from asyncrl.engine.torch_engine import TorchEngine

    return TorchEngine(model.eval(), max_batch_size=rollout.max_batch_size, seed=seed, version=version,
                       num_threads=num_threads, weight_noise=rollout.engine_weight_noise,
                       group_prefill=rollout.group_prefill, dtype=dtype, thread_budget=thread_budget,
                       kv_cache=rollout.kv_cache, capture=rollout.capture)
