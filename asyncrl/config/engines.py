"""Engines beyond the built-in one: vLLM in-process, servers by URL (``engine: remote``), and
``asyncrl serve-engine``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
)

from asyncrl.config.base import Section


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
    """A directory the trainer writes each sync's weights to (safetensors; with
    ``model.lora``, the adapters as a PEFT directory ``lora-v<version>``) and every server
    reads them from: local disk for servers on this machine, a shared mount otherwise.
    ``None``: a temporary directory on this machine (servers on this machine only)."""
    weight_transfer: Literal["files", "nccl"] = "files"
    """How full weights reach the servers: ``files``, safetensors in ``weights_dir`` that
    each server reloads (any server, the CPU build, across clusters); ``nccl``, vLLM's native
    weight transfer (``/init_weight_transfer_engine`` once, then ``/start_weight_update``,
    ``/update_weights`` while this trainer broadcasts from its GPU, ``/finish_weight_update``):
    GPUs on both sides, vLLM in the trainer's environment, ``vllm serve
    --weight-transfer-config '{"backend": "nccl"}'``. LoRA adapters go through
    ``/v1/load_lora_adapter`` either way."""
    nccl_address: str | None = None
    """With ``weight_transfer=nccl``: the address the servers reach this trainer at for the
    NCCL rendezvous. ``None``: the one this machine reaches the first server from."""
    nccl_port: int = Field(0, ge=0, le=65535)
    """With ``weight_transfer=nccl``: the rendezvous port on this trainer (0 = a free one)."""
    control_timeout_s: float = Field(60.0, gt=0)
    """Deadline of each control call (pause, resume, version, health) on each server."""
    weight_load_timeout_s: float = Field(600.0, gt=0)
    """Deadline of each server's weight load (a file reload, an adapter load, each call of the
    NCCL transfer and the trainer's broadcast): a large model's load can take minutes."""
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
