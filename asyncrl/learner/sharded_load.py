"""Loading the policy straight into this rank's FSDP2 shards (``learner.world_size`` > 1,
``learner.strategy=fsdp2``), so no rank ever holds the whole model in memory.

1. The model is built from its config on the meta device: shapes, no storage.
2. It is sharded as training shards it (:meth:`Sharding.shard`): each parameter becomes a
   DTensor whose local piece is this rank's rows of dim 0, in ``torch.chunk``'s split
   (:func:`shard_rows`; checked against the piece FSDP2 made, so a change in PyTorch's split
   fails loudly rather than loading the wrong rows).
3. ``to_empty`` allocates only those local pieces, on the rank's device, and each is filled
   from the safetensors files with exactly its rows (``get_slice(name)[start:stop]``: the
   file is memory-mapped, and only those bytes are read; :class:`CheckpointReader` says why
   each read opens the file afresh). Over all ranks every row is read once.
4. What the files do not hold is made as ``from_pretrained`` makes it. Tied weights are one
   parameter in the skeleton already (FSDP2 shards it once; ``to_empty`` keeps the tie).
   Non-persistent buffers (RoPE's ``inv_freq``) are computed by the model's own
   ``_init_weights``, the mechanism transformers' loader itself uses for them, after each is
   filled with a marker (NaN, or the integer type's minimum): a buffer still holding its
   marker is named, rather than trained on as uninitialised memory.

Invariant: every parameter's local piece equals, bit for bit, the same rows of the model
``load_policy`` returns on one rank (the same rounding casts the stored tensor to
``model.dtype``), and every buffer equals that model's (``tests/test_sharded_learner.py``,
``tests/test_sharded_load.py``).

What this cannot load so raises :class:`WholeLoadNeeded` naming why: before any storage is
allocated where that can be known then (no safetensors files, a LoRA adapter directory, a
tensor the files lack under the model's name, a buffer of a type it cannot check), else
once its buffers are computed (one left uncomputed). Every rank decides alike (the same
files, the same model), so all of them then load the whole model and shard it, as every
rank did before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from asyncrl.config import ModelConfig
from asyncrl.learner.distributed import Sharding
from asyncrl.policy import adapter_base, resolve_model_path, weights_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WholeLoadNeeded(Exception):
    """This model cannot be loaded shard by shard; the message says why."""


def shard_rows(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[start, stop)`` of a dim of ``size`` rows split as
    ``torch.chunk`` splits it (FSDP2's ``Shard(0)``): chunks of ⌈size/N⌉ rows, so the last
    ranks may hold fewer, or none (unlike ``distributed.row_range``, which evens them out)."""
    chunk = -(-size // world_size)
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


def tensor_files(path: Path) -> dict[str, Path]:
    """Which safetensors file of the model directory ``path`` holds each tensor: the one
    ``model.safetensors``, or the shards its index (``model.safetensors.index.json``) maps."""
    index = path / INDEX_FILE
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise WholeLoadNeeded(f"{path} holds no {SINGLE_FILE} (nor {INDEX_FILE}): only safetensors files can be read "
                          "a slice at a time")


class CheckpointReader:
    """Reads tensors, or rows of them, from a model's safetensors files. Each read opens its
    file and lets it go: a handle keeps every page read through it mapped, so a rank
    reading all its slices through one handle held them twice at its peak (its pieces, and
    the file's pages they came from: resident until the handle closes)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0 of tensor ``name``: only their bytes are read."""
        with safe_open(self.files[name], framework="pt", device="cpu") as f:
            return f.get_slice(name)[start:stop]

    def whole(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], framework="pt", device="cpu") as f:
            return f.get_tensor(name)


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a state dict (and so a checkpoint) holds."""
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def build_skeleton(cfg: ModelConfig) -> tuple[PreTrainedModel, dict[str, Path]]:
    """``model.path``'s model on the meta device (no storage) in ``model.dtype``, and where
    each of its tensors is stored; :class:`WholeLoadNeeded` if the files cannot fill it."""
    path = resolve_model_path(cfg.path)
    if adapter_base(path) is not None:
        raise WholeLoadNeeded(f"model.path {cfg.path!r} holds LoRA adapters, merged into their base as it loads")
    files = tensor_files(path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=weights_dtype(cfg.dtype))
    needed = [name for name, _ in model.named_parameters()] + [name for name, _ in persistent_buffers(model)]
    missing = [name for name in needed if name not in files]
    if missing:  # from_pretrained would rename or initialise them: its own business
        raise WholeLoadNeeded(f"{len(missing)} of the model's tensors are not in {path} under their names "
                              f"(first: {', '.join(missing[:3])})")
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None and marker(buffer.dtype) is None:
                raise WholeLoadNeeded(f"buffer {name!r} of {type(module).__name__} is {buffer.dtype}: "
                                      "not one whose computation can be checked")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model, files


def load_sharded(cfg: ModelConfig, sharding: Sharding) -> PreTrainedModel:
    """``model.path``'s model sharded over the ranks with FSDP2 (``sharding.shard``), this
    rank's pieces read from the files and nothing else; in eval mode, as ``load_policy``
    returns it. Not a collective: each rank reads its own rows."""
    model, files = build_skeleton(cfg)
    sharding.shard(model)
    model.to_empty(device=sharding.device)
    reader = CheckpointReader(files)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill_local(name, param, reader)
        for name, buffer in persistent_buffers(model):
            buffer.copy_(reader.whole(name))
    compute_buffers(model)
    return model.eval()


def fill_local(name: str, param: torch.Tensor, reader: CheckpointReader) -> None:
    """Copy into ``param``'s local piece its rows of the stored tensor ``name``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):  # not sharded: this rank holds all of it
        param.copy_(reader.whole(name))
        return
    local = param.to_local()
    if param.device_mesh.ndim != 1 or param.placements[0] not in (Shard(0), Replicate()):
        raise RuntimeError(f"{name}: placed {param.placements} on a {param.device_mesh.ndim}-d mesh; "
                           "sharded loading reads rows of dim 0 only (use learner.strategy=ddp)")
    if param.placements[0] == Replicate():
        local.copy_(reader.whole(name))
        return
    start, stop = shard_rows(param.shape[0], param.device_mesh.get_local_rank(), param.device_mesh.size())
    if tuple(local.shape) != (stop - start, *param.shape[1:]):
        raise RuntimeError(f"{name}: FSDP2 kept a local piece of shape {tuple(local.shape)}, not rows "
                           f"[{start}, {stop}) of {tuple(param.shape)}: shard_rows must follow PyTorch's split")
    local.copy_(reader.rows(name, start, stop))


def marker(dtype: torch.dtype) -> float | int | None:
    """What an uncomputed buffer of ``dtype`` is filled with, so that it shows: NaN, or an
    integer type's minimum (no position or index is); None for a type with no such value."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        return torch.iinfo(dtype).min
    return None


def _marker(dtype: torch.dtype) -> float | int:
    value = marker(dtype)
    if value is None:  # build_skeleton refuses such a buffer before it gets here
        raise WholeLoadNeeded(f"a non-persistent buffer of {dtype} has no marker value")
    return value


def compute_buffers(model: PreTrainedModel) -> None:
    """Non-persistent buffers (not in any checkpoint: RoPE's ``inv_freq``) computed by the
    model's ``_init_weights``, as ``from_pretrained`` computes them; the parameters of their
    modules are marked initialised first, so their loaded values stay. A buffer left
    uncomputed (it still holds its marker) raises, naming it."""
    owners = [(module, [n for n in sorted(module._non_persistent_buffers_set) if module._buffers.get(n) is not None])
              for module in model.modules()]
    with torch.no_grad():
        for module, names in owners:
            if not names:
                continue
            for name in names:
                buffer = module.get_buffer(name)
                buffer.fill_(_marker(buffer.dtype))
            for param in module.parameters(recurse=False):
                setattr(param, "_is_hf_initialized", True)  # what transformers' initialisation reads
            model._init_weights(module)
            for name in names:
                buffer = module.get_buffer(name)
                left = buffer.isnan() if buffer.is_floating_point() else buffer.eq(_marker(buffer.dtype))
                if bool(left.any()):
                    raise WholeLoadNeeded(f"buffer {name!r} of {type(module).__name__} is not computed by "
                                          f"{type(model).__name__}._init_weights (this transformers version)")
