"""A learner's checkpoint on disk: writing it and reading it back.

A checkpoint is a Hugging Face model directory (weights, tokenizer, config) with
``trainer_state.pt`` beside it (version, LR schedule, RNG streams, whatever the caller adds)
and the optimizer state under ``optimizer/`` as torch.distributed.checkpoint files, one
shard per rank. Any number of ranks (one included) loads what any number saved.

Invariant: a directory under a checkpoint's final name is complete. It is written under
``<name>.tmp`` and renamed into place; an older checkpoint of the same name is set aside
as ``<name>.old`` until the new one is there, never deleted first.

With ``model.lora`` the weights are the adapters alone, as peft writes them
(``adapter_config.json`` + ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base,
dir)`` loads it; ``lora.save_merged`` writes the merged model), and the optimizer state is
the adapters' only: the base is ``model.path``, unchanged.

What the run keeps beside the learner's state (run state, journals, rotation of old
checkpoints, rolling the logs back on resume) is ``asyncrl/orchestrator/checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from asyncrl.config import LoraConfig
from asyncrl.learner.distributed import Sharding
from asyncrl.learner.lora import load_adapter_weights, peft_model

STATE_FILE = "trainer_state.pt"
"""The learner's state beside its weights: version, schedule, RNG, what the caller adds."""
URL_STATE_KEY = "learner_url_state"
"""Set in the state of a checkpoint a learner by URL wrote (``asyncrl/runtime/tinker_learner.py``):
the ``tinker://`` path of the server's saved state, which holds its optimizer."""
OPTIMIZER_DIR = "optimizer"
"""A checkpoint's optimizer state, as torch.distributed.checkpoint files keyed by parameter
name: any number of ranks (one included) can load what any number saved."""

class Checkpointed(Protocol):
    """What a checkpoint holds of a learner (:class:`asyncrl.learner.learner.Learner`)."""

    tokenizer: PreTrainedTokenizerBase
    sharding: Sharding | None
    version: int  # restored: the one member written
    lora: LoraConfig | None  # module is then a PeftModel: its save_pretrained writes the adapters

    @property
    def model(self) -> torch.nn.Module: ...  # as trained: wrapped (FSDP2/DDP) when sharded

    @property
    def module(self) -> PreTrainedModel: ...  # the Hugging Face model under it: names, config, save_pretrained

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler: ...

    @property
    def is_main(self) -> bool: ...


def write_checkpoint(learner: Checkpointed, path: Path, extra: dict[str, Any] | None = None,
         files: dict[str, str] | None = None, parts: Mapping[str, Checkpointed] | None = None) -> Path:
    """``path`` becomes a Hugging Face model directory with ``trainer_state.pt`` (version,
    schedule, RNG, ``extra``), the optimizer state under ``optimizer/`` (one shard per
    rank, loadable by any number of ranks) and the text ``files`` of other parts beside
    the weights; each of ``parts`` (a model trained beside it: the critic) the same in a
    sub-directory of its name, read back by :func:`restore_checkpoint` on ``path / name``.
    Written to a temporary directory and renamed, so a crash mid-write never leaves a half
    checkpoint under the final name. Sharded, every rank calls it (the weights are
    gathered to rank 0, each rank writes its optimizer shard) and the directory must be one
    all ranks see."""
    tmp = path.with_name(path.name + ".tmp")
    if learner.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    _write_into(learner, tmp, extra, files)
    for name, part in (parts or {}).items():
        _write_into(part, tmp / name)
    if learner.is_main:
        place_checkpoint(tmp, path)
    _barrier(learner.sharding)  # no rank returns before the checkpoint is in place
    return path


def _write_into(learner: Checkpointed, directory: Path, extra: dict[str, Any] | None = None,
                files: dict[str, str] | None = None) -> None:
    """What :func:`write_checkpoint` says, into ``directory`` as it is (no rename)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sharding = learner.sharding
    weights = sharding.full_state_dict(learner.model) if sharding is not None else None
    if learner.is_main:
        learner.module.save_pretrained(directory, state_dict=weights)
        learner.tokenizer.save_pretrained(directory)
        for name, text in (files or {}).items():
            (directory / name).write_text(text)
        torch.save({"version": learner.version, "scheduler": learner.scheduler.state_dict(), "rng": rng_state(),
                    **(extra or {})}, directory / STATE_FILE)
    del weights
    _barrier(sharding)  # the directory exists before any rank writes into it
    with _single_process_dcp():
        dcp.save({"optimizer": get_optimizer_state_dict(learner.model, learner.optimizer)},
                 checkpoint_id=directory / OPTIMIZER_DIR, no_dist=sharding is None)


def place_checkpoint(tmp: Path, path: Path) -> None:
    """Rename the complete ``tmp`` to ``path``; an older ``path`` is set aside as
    ``<name>.old``, not deleted, until the new one is in place (the module's invariant)."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def restore_checkpoint(learner: Checkpointed, path: Path) -> dict[str, Any]:
    """Continue from ``path``: weights, optimizer, LR schedule, RNG streams, version,
    whatever number of ranks saved it. (The KL reference, if any, stays the initial
    policy.) Returns the trainer state. Sharded, every rank calls it."""
    state = torch.load(path / STATE_FILE, weights_only=False, map_location="cpu")
    if learner.lora is not None:
        load_adapter_weights(peft_model(learner.module), path)
    else:
        _load_weights(learner, path)
    _load_optimizer(learner, path, state)
    learner.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    learner.version = state["version"]
    return state


def _load_weights(learner: Checkpointed, path: Path) -> None:
    architectures = AutoConfig.from_pretrained(path).architectures or ()
    value_model = any(a.endswith("ForTokenClassification") for a in architectures)  # a critic (value_model.py)
    loader = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    saved = loader.from_pretrained(path, dtype=next(learner.module.parameters()).dtype).state_dict()
    if learner.sharding is None:
        learner.model.load_state_dict(saved)
    else:
        learner.sharding.load_full_state_dict(learner.model, saved)


def _load_optimizer(learner: Checkpointed, path: Path, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if "optimizer" in state:  # a checkpoint from before optimizer/: one state dict keyed by parameter order
        if learner.sharding is None:
            learner.optimizer.load_state_dict(state["optimizer"])
            return
        names = [name for name, _ in learner.module.named_parameters()]  # the optimizer's order
        old = state["optimizer"]
        full: dict[str, Any] = {  # torch's own state-dict type, which a dict built here is not inferred to be
            "state": {names[i]: v for i, v in old["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in old["param_groups"]]}
        set_optimizer_state_dict(learner.model, learner.optimizer, full, options=StateDictOptions(full_state_dict=True))
        return
    import torch.distributed.checkpoint as dcp

    target = get_optimizer_state_dict(learner.model, learner.optimizer)  # this layout's shapes: DCP reshards into it
    with _single_process_dcp():
        dcp.load({"optimizer": target}, checkpoint_id=path / OPTIMIZER_DIR, no_dist=learner.sharding is None)
    set_optimizer_state_dict(learner.model, learner.optimizer, target)


def _barrier(sharding: Sharding | None) -> None:
    if sharding is not None:
        sharding.barrier()


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP warns whenever it runs without a process group; one learner means exactly that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
