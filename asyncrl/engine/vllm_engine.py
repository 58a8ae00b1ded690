"""A rollout engine on vLLM's ``AsyncLLM``: the same contract as ``TorchEngine``, vLLM's kernels.

vLLM is optional and heavy (a process per engine core and worker, tens of seconds to start), so this
module imports it only inside ``VLLMEngine.start``: importing the module needs no vLLM.

How the contract maps onto vLLM (checked against vLLM 0.32, CPU build):

* logprobs: the engine runs with ``logprobs_mode="processed_logprobs"`` and asks for the
  sampled token only (``logprobs=0``). vLLM then returns log softmax(logits / T) (raw logits
  for greedy rows), which is our contract, but computed *after* top-k/top-p masking, i.e.
  renormalised over the kept tokens. ``raw_logprobs`` would ignore the temperature instead.
  Neither matches the contract under truncation, so ``generate`` refuses top-k/top-p.
* versions: vLLM labels every engine step's outputs with the engine core's weight version
  (``update_weight_version``) and returns per-token spans on the final output; the version
  is only changed while generation is paused, so each token carries the weights that
  sampled it, exactly, not an estimate made on arrival in this process.
* stopping: only ``sampling.stop_token_ids`` end a sequence (``ignore_eos``), the stop token
  is kept, and ``max_tokens`` is capped at the model's context like ``TorchEngine`` does.
* weights: shipped to the workers as a safetensors file (vLLM's RPC path cannot carry
  tensors) and loaded in place by ``reload_weights``. Shipping the loader function needs
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickled calls over vLLM's local sockets), which
  ``start`` sets before the engine processes are spawned. :class:`FullWeights` only: an
  :class:`AdapterUpdate` is a ``TypeError`` (with ``model.lora`` a vLLM run is sent the
  merged weights, every one of them: ``asyncrl/learner/export.py``). vLLM's own LoRA
  loading (``enable_lora`` and a ``LoRARequest`` per version) is not wired yet.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from asyncrl.config import VLLMConfig
from asyncrl.engine.protocol import AdapterUpdate, EngineClosedError, PauseMode, TokenSink, WeightUpdate, as_update
from asyncrl.types import Completion, FinishReason, SamplingParams
from asyncrl.config.engine_kinds import ENGINE_KINDS, EngineKind

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMStats:
    """What the trainer reads from an engine. ``busy_s`` is wall time with at least one
    request in flight and the engine not paused: vLLM does not hand its step times to the
    client, so this counts scheduling gaps as busy too."""

    def __init__(self) -> None:
        self.tokens = 0
        self._busy_s = 0.0
        self._since: float | None = None

    @property
    def busy_s(self) -> float:
        return self._busy_s + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def counts(self) -> dict[str, float]:
        """The tokens it sampled: vLLM keeps its step counts to itself."""
        return {"tokens": self.tokens}

    def set_busy(self, busy: bool) -> None:
        if busy and self._since is None:
            self._since = time.perf_counter()
        elif not busy and self._since is not None:
            self._busy_s += time.perf_counter() - self._since
            self._since = None


class VLLMEngine:
    """``RolloutEngine`` over vLLM's ``AsyncLLM``. Build it with ``await VLLMEngine.start(...)``."""

    kind: ClassVar[EngineKind] = ENGINE_KINDS["vllm"]  # what it can do: the kinds table's row

    def __init__(self, llm: AsyncLLM, *, version: int, param_names: frozenset[str] | None) -> None:
        self._llm: AsyncLLM | None = llm
        self._version = version
        self._param_names = param_names
        self._max_model_len: int = llm.model_config.max_model_len
        self._ids = itertools.count()
        self._in_flight = 0
        self._paused = False
        self._update_lock = asyncio.Lock()
        self.stats = VLLMStats()

    @classmethod
    async def start(
        cls, model_path: str | os.PathLike[str], *, seed: int = 0, max_batch_size: int = 64, dtype: str = "float32",
        version: int = 0, kv_cache_bytes: int | None = 1 << 30, enforce_eager: bool = True, **engine_kwargs: Any,
    ) -> VLLMEngine:
        """Start vLLM on a Hugging Face model directory (tokenizer not needed: we pass ids).

        ``kv_cache_bytes`` is set explicitly because on CPU vLLM otherwise reserves 92% of the
        NUMA node's memory and refuses to start when the machine is shared; ``None`` lets vLLM
        size it (on GPU, from ``gpu_memory_utilization``). ``engine_kwargs`` go to
        ``AsyncEngineArgs`` and win over the defaults here (the ``vllm`` config section:
        :func:`engine_args`).
        """
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # before vLLM spawns anything
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args: dict[str, Any] = {
            "model": str(model_path), "skip_tokenizer_init": True, "dtype": dtype, "seed": seed,
            "max_num_seqs": max_batch_size, "logprobs_mode": "processed_logprobs", "enforce_eager": enforce_eager,
            "generation_config": "vllm", "disable_log_stats": True,
            **({"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes is not None else {}), **engine_kwargs,
        }
        # no `llm` local: vLLM keeps an import-time traceback that pins this frame, and with
        # it anything the frame holds, until the interpreter exits
        engine = cls(AsyncLLM.from_engine_args(AsyncEngineArgs(**args)), version=version,
                     param_names=_checkpoint_names(Path(model_path)))
        try:
            await engine._live().update_weight_version(str(version))
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        """vLLM's ``max_model_len`` for this model."""
        return self._max_model_len

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def queue_state(self) -> None:
        """Its queue is the engine's own (``RolloutEngine.queue_state``)."""
        return None

    # ----------------------------------------------------------------- async verbs
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       on_tokens: TokenSink | None = None) -> Completion:
        """Stream one request; cancelling the caller's task aborts it inside vLLM (``AsyncLLM``
        aborts a request whose output generator is cancelled). ``on_tokens`` gets each
        delta's token ids as vLLM hands them out (``StreamingEngine``)."""
        llm = self._live()
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if sampling.top_k or sampling.top_p < 1:
            raise ValueError("VLLMEngine cannot report logprobs before top-k/top-p truncation "
                             "(vLLM renormalises over the kept tokens); use top_k=0, top_p=1")
        room = self._max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context "
                             f"of {self._max_model_len}")
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        params = VLLMSamplingParams(
            max_tokens=min(sampling.max_tokens, room), temperature=sampling.temperature,
            stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False,
            seed=sampling.seed, output_kind=RequestOutputKind.DELTA)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        final: CompletionOutput | None = None
        self._in_flight += 1
        self._update_busy()
        try:
            async for out in llm.generate({"prompt_token_ids": list(prompt_ids)}, params,
                                          request_id=f"asyncrl-{next(self._ids)}"):
                seq = out.outputs[0]
                new = list(seq.token_ids)
                tokens += new
                logprobs += [position[token].logprob for token, position in zip(new, seq.logprobs or [])]
                versions += [self._version] * len(new)  # replaced by vLLM's own labels below
                self.stats.tokens += len(new)
                if on_tokens is not None and new:
                    on_tokens(new)
                final = seq if out.finished else None
        except EngineDeadError as exc:
            raise EngineClosedError(f"the vLLM engine died: {exc}") from exc
        finally:
            self._in_flight -= 1
            self._update_busy()
        if final is None or final.finish_reason not in _FINISH_REASONS:
            raise RuntimeError(f"vLLM ended the request with {final and final.finish_reason!r}")
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens")
        for span in final.weight_versions or []:
            versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
        return Completion(tokens, logprobs, versions, _FINISH_REASONS[final.finish_reason])

    async def pause(self, mode: PauseMode = "keep") -> int | None:
        """vLLM's own pause modes match ours one to one. The KV cache is kept here; it is
        ``update_weights`` that drops it. How many sequences an abort ended is vLLM's to know."""
        await self._live().pause_generation(mode=mode, clear_cache=False)
        self._paused = True
        self._update_busy()
        return None

    async def resume(self) -> None:
        await self._live().resume_generation()
        self._paused = False
        self._update_busy()

    async def update_weights(self, update: WeightUpdate | Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``update``'s weights (Hugging Face names, all of them) between two steps; pauses
        (keep) by itself unless the caller already paused.

        Sequences still in flight go on with the new weights, and unlike ``TorchEngine`` they
        do so on a recomputed KV cache: vLLM's prefix cache would otherwise hand the old
        weights' KV blocks to new requests, and resetting it preempts the held sequences,
        which vLLM prefills again (prompt plus tokens so far) on resume.
        """
        llm = self._live()
        update = as_update(update)
        if isinstance(update, AdapterUpdate):
            raise TypeError("VLLMEngine loads whole weights, not LoRA adapters: send FullWeights "
                            "(model.lora.sync=merged, which model.lora.sync=auto picks for engine=vllm)")
        weights = update.tensors
        if self._param_names is not None:
            unknown = sorted(set(weights) - self._param_names)
            if unknown:
                raise KeyError(f"update_weights got names the model does not have: {unknown[:5]}")
            missing = sorted(self._param_names - set(weights))
            if missing:  # a fused layer (qkv, gate_up) loaded in part would keep garbage in the rest
                raise KeyError(f"VLLMEngine reloads whole layers: pass every weight (missing: {missing[:5]})")
        async with self._update_lock:
            with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
                path = os.path.join(tmp, "weights.safetensors")
                tensors = {name: t.detach().cpu().contiguous() for name, t in weights.items()}
                await asyncio.to_thread(save_file, tensors, path)  # written before pausing: a shorter stall
                paused_here = not self._paused
                if paused_here:
                    await self.pause("keep")
                try:
                    await llm.collective_rpc(_load_weights_in_worker, args=(path,))
                    if not await llm.reset_prefix_cache(reset_running_requests=True):
                        raise RuntimeError("vLLM could not drop the KV cache of the old weights")
                    await llm.update_weight_version(str(version))
                    self._version = version
                finally:
                    if paused_here:
                        await self.resume()

    async def shutdown(self) -> None:
        """Blocks the loop while vLLM stops its processes (seconds): from a
        thread, vLLM's output task would first see the dead engine and log it as a failure."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    # ------------------------------------------------------------------ helpers
    def _live(self) -> AsyncLLM:
        if self._llm is None:
            raise EngineClosedError("the engine is shut down")
        return self._llm

    def _update_busy(self) -> None:
        self.stats.set_busy(self._in_flight > 0 and not self._paused)


def engine_args(vllm: VLLMConfig, *, on_cpu: bool) -> dict[str, Any]:
    """The ``vllm`` config section as :meth:`VLLMEngine.start` keywords. The KV cache gets
    1 GiB on CPU unless ``kv_cache_gb`` says otherwise (see ``start``); on GPU it is what
    ``gpu_memory_utilization`` leaves, unless ``kv_cache_gb`` fixes it."""
    kv_gb = vllm.kv_cache_gb if vllm.kv_cache_gb is not None else (1.0 if on_cpu else None)
    args: dict[str, Any] = {"kv_cache_bytes": int(kv_gb * (1 << 30)) if kv_gb is not None else None,
                            "enforce_eager": vllm.enforce_eager, "tensor_parallel_size": vllm.tensor_parallel_size}
    if not on_cpu:
        args["gpu_memory_utilization"] = vllm.gpu_memory_utilization
    if vllm.max_model_len is not None:
        args["max_model_len"] = vllm.max_model_len
    return {**args, **vllm.engine_args}


def _load_weights_in_worker(worker: Any, path: str) -> None:
    """Runs inside every vLLM worker process; shipped by reference, so ``asyncrl`` must be
    importable there. vLLM maps Hugging Face names onto its fused layers (qkv, gate_up).

    On CPU every linear layer computes from a packed copy of its weight. A tied ``lm_head``
    shares ``embed_tokens``' weight, gets no checkpoint entry of its own, and so keeps the
    packed copy of the old weights after ``reload_weights``: repack it (a no-op off CPU).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    worker.reload_weights(weights_iterator=load_file(path).items())
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, ParallelLMHead) and module.weight.numel():
            module.quant_method.process_weights_after_loading(module)


def _checkpoint_names(model_path: Path) -> frozenset[str] | None:
    """Tensor names of the model's safetensors checkpoint (no tensor is read): what
    ``update_weights`` accepts. ``None`` (no check) for other checkpoint formats."""
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)
