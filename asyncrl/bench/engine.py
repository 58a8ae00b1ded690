"""``asyncrl bench engine``: the built-in engine against ``model.generate``, same model,
batch and response lengths, measured side by side in one run.

Two workloads. ``uniform``: every request wants the same number of tokens, the case
``generate`` is built for. ``longtail``: most responses are short and a few are many
times longer; ``generate`` must decode every static batch until its longest row ends,
while continuous batching refills freed rows. Only requested tokens count as useful.

A third, ``group``, times the built-in engine alone with group prefill on and off
(interleaved): ``group_prompts`` distinct prompts of ``group_prompt_tokens`` tokens, each
sent ``group_size`` times, as a GRPO step's workflows send them, one ``generate`` each.
``group_prefill_speedup`` is on / off; ``prefill_rows`` counts prompts run through the model.

Device and precision: on CUDA when there is one (``device=auto``), in bf16 there and float32
on the CPU (``dtype=auto``); ``model.path=`` runs a real model (a Hugging Face directory or
hub id) instead of the built one. ``generate_static`` is ``model.generate`` with
``cache_implementation="static"`` (transformers' preallocated cache; whatever its own
defaults do with it), the figure the GPU path is held to. ``bench.json`` says the ``device``
and ``dtype`` every column ran on, and the engine's ``kv_cache`` and ``capture``.

Where vLLM is installed, ``VLLMEngine`` runs the same workloads (same weights, prompts and
lengths) after the other two, with its own start-up and a warm-up batch left out of the
timing: its worker processes stay up between runs, so interleaving it with the others would
let them share the CPU with an idle vLLM.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import statistics
import tempfile
import time
from typing import Any, Literal

import torch
from pydantic import Field
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from asyncrl.bench.progress import phase
from asyncrl.config import RolloutConfig, Section, apply_overrides, validate
from asyncrl.engine.factory import torch_engine
from asyncrl.engine.torch_engine import EngineStats
from asyncrl.engine.vllm_engine import VLLMEngine
from asyncrl.policy import resolve_device, weights_dtype
from asyncrl.types import SamplingParams


class EngineBenchModel(Section):
    path: str | None = None  # a Hugging Face causal LM (directory or hub id); None: the built Qwen2 below


class EngineBenchSettings(Section):
    model: EngineBenchModel = EngineBenchModel()
    device: str = "auto"  # auto: cuda when torch sees one, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    kv_cache: Literal["auto", "dynamic", "static"] = "auto"  # the engine's (TorchEngine's kv_cache)
    capture: Literal["auto", "off", "graphs", "compile"] = "auto"  # the engine's decode step (TorchEngine's capture)
    generate_static: bool = True  # also time model.generate with cache_implementation="static"
    hidden_size: int = Field(256, ge=8)
    num_layers: int = Field(4, ge=1)
    vocab_size: int = Field(128, ge=16)
    batch_size: int = Field(64, ge=1)
    prompt_tokens: int = Field(16, ge=1)
    uniform_tokens: int = Field(32, ge=1)
    longtail_requests: int = Field(256, ge=1)
    short_tokens: tuple[int, int] = Field((8, 24), strict=False)  # YAML gives lists
    long_tokens: tuple[int, int] = Field((128, 256), strict=False)
    long_fraction: float = Field(0.06, ge=0, le=1)
    threads: int = Field(1, ge=1)
    repeats: int = Field(3, ge=1)
    temperature: float = Field(1.0, gt=0)
    seed: int = 0
    vllm: bool = True  # also time VLLMEngine when vLLM is installed
    group_prompts: int = Field(8, ge=1)  # the group workload: distinct prompts ...
    group_size: int = Field(8, ge=1)  # ... each sent this many times
    group_prompt_tokens: int = Field(128, ge=1)
    group_tokens: int | None = Field(None, ge=1)  # new tokens per sample; None: uniform_tokens


def bench_dtype(s: EngineBenchSettings, device: torch.device) -> torch.dtype:
    if s.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return weights_dtype(s.dtype)


def bench_model(s: EngineBenchSettings, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model every column runs: ``model.path``'s, or a Qwen2 built from the settings."""
    device = device or torch.device("cpu")
    if s.model.path is not None:
        return AutoModelForCausalLM.from_pretrained(s.model.path, dtype=dtype).to(device).eval()
    torch.manual_seed(s.seed)
    config = Qwen2Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * s.hidden_size,
                         max_position_embeddings=max(s.prompt_tokens + s.long_tokens[1],
                                                     s.group_prompt_tokens + (s.group_tokens or s.uniform_tokens)) + 8,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).to(device, dtype).eval()


def run_generate(model: PreTrainedModel, prompts: torch.Tensor, lengths: list[int], batch_size: int,
                 temperature: float, **generate_kwargs: Any) -> float:
    """Static batches in order; each runs until its longest request is done. Returns s."""
    prompts = prompts.to(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(lengths), batch_size):
            chunk = prompts[i:i + batch_size]
            n = max(lengths[i:i + batch_size])
            model.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=n, min_new_tokens=n,
                           do_sample=True, temperature=temperature, top_k=0, top_p=1.0, eos_token_id=None,
                           pad_token_id=0, **generate_kwargs)
    synchronize(model.device)
    return time.perf_counter() - start


def run_generate_static(model: PreTrainedModel, prompts: torch.Tensor, lengths: list[int], batch_size: int,
                        temperature: float) -> float:
    return run_generate(model, prompts, lengths, batch_size, temperature, cache_implementation="static")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timing ends with it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_runner(s: EngineBenchSettings):
    """``run_engine`` with the settings' ``kv_cache`` and ``capture``."""
    def run_engine(model: PreTrainedModel, prompts: torch.Tensor, lengths: list[int], batch_size: int,
                   temperature: float) -> float:
        return run_torch_engine(model, prompts, lengths, batch_size, temperature,
                                kv_cache=s.kv_cache, capture=s.capture)[0]

    return run_engine


def run_torch_engine(model: PreTrainedModel, prompts: torch.Tensor, lengths: list[int], batch_size: int,
                     temperature: float, group_prefill: bool = True, **engine_kwargs: Any) -> tuple[float, EngineStats]:
    async def main() -> tuple[float, EngineStats]:
        rollout = RolloutConfig(max_batch_size=batch_size, group_prefill=group_prefill, **engine_kwargs)
        engine = torch_engine(model, rollout)
        try:
            start = time.perf_counter()
            done = await asyncio.gather(*[
                engine.generate(p, SamplingParams(max_tokens=n, temperature=temperature))
                for p, n in zip(prompts.tolist(), lengths)])
            elapsed = time.perf_counter() - start
        finally:
            await engine.shutdown()
        assert [len(c.token_ids) for c in done] == lengths
        return elapsed, engine.stats

    return asyncio.run(main())


def run_group_bench(model: PreTrainedModel, s: EngineBenchSettings) -> dict[str, Any]:
    """The group workload with group prefill on and off, interleaved; median of ``repeats``."""
    distinct = torch.randint(4, vocab_size(model), (s.group_prompts, s.group_prompt_tokens),
                             generator=torch.Generator().manual_seed(s.seed + 1))
    prompts = distinct.repeat_interleave(s.group_size, dim=0)  # group by group, as the rollout loop sends them
    lengths = [s.group_tokens or s.uniform_tokens] * len(prompts)
    times: dict[str, list[float]] = {"on": [], "off": []}
    rows: dict[str, int] = {}
    with phase("engine", "group", total=2 * s.repeats) as progress:
        for _ in range(s.repeats):
            for name, runs in times.items():
                elapsed, stats = run_torch_engine(model, prompts, lengths, s.batch_size, s.temperature,
                                                  group_prefill=name == "on", kv_cache=s.kv_cache,
                                                  capture=s.capture)
                runs.append(elapsed)
                rows[name] = stats.prefill_rows
                progress.advance()
        tokens_per_s = {name: sum(lengths) / statistics.median(t) for name, t in times.items()}
        progress.figure = ", ".join(f"group prefill {n} {tokens_per_s[n]:,.0f} tok/s" for n in times)
    print(f"group     requests={len(lengths):4d} tokens={sum(lengths):6d} prompt_tokens={s.group_prompt_tokens}  " +
          "  ".join(f"group_prefill_{n}={tokens_per_s[n]:8.0f} tok/s (prefill_rows={rows[n]})" for n in times))
    return {"requests": len(lengths), "prompt_tokens": s.group_prompt_tokens, "new_tokens": lengths[0],
            "tokens_per_s": tokens_per_s, "prefill_rows": rows}


def run_vllm(model: PreTrainedModel, inputs: dict[str, tuple[torch.Tensor, list[int]]],
             s: EngineBenchSettings) -> dict[str, Any]:
    """Tokens/s of ``VLLMEngine`` per workload (median of ``repeats``) and its start-up time.

    vLLM's CPU worker binds its OpenMP threads to cores: ``threads`` of them, as the others
    get, unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise. Its engine-core and client
    processes run beside the worker, so vLLM uses more CPU than ``threads`` in all.
    """
    async def main(path: str) -> dict[str, Any]:
        with phase("engine", "vLLM start-up") as progress:
            start = time.perf_counter()
            engine = await VLLMEngine.start(path, max_batch_size=s.batch_size, seed=s.seed)
            startup_s = time.perf_counter() - start
            progress.figure = f"started in {startup_s:.1f} s"
        try:
            with phase("engine", "vLLM warm-up"):
                sampling = SamplingParams(max_tokens=4, temperature=s.temperature)
                warm_up = next(iter(inputs.values()))[0][:4].tolist()
                await asyncio.gather(*[engine.generate(p, sampling) for p in warm_up])
            tokens_per_s = {}
            for workload, (prompts, lengths) in inputs.items():
                times = []
                with phase("engine", f"vLLM, {workload}", total=s.repeats) as progress:
                    for _ in range(s.repeats):
                        start = time.perf_counter()
                        done = await asyncio.gather(*[
                            engine.generate(p, SamplingParams(max_tokens=n, temperature=s.temperature))
                            for p, n in zip(prompts.tolist(), lengths)])
                        times.append(time.perf_counter() - start)
                        progress.advance()  # outside the timed region
                        assert [len(c.token_ids) for c in done] == lengths
                    tokens_per_s[workload] = sum(lengths) / statistics.median(times)
                    progress.figure = f"{tokens_per_s[workload]:,.0f} tok/s"
        finally:
            await engine.shutdown()
        return {"tokens_per_s": tokens_per_s, "startup_s": startup_s,
                "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind or f"0-{s.threads - 1}"  # read when vLLM spawns
    try:
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            return asyncio.run(main(path))
    finally:
        if bind is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def vocab_size(model: PreTrainedModel) -> int:
    return model.config.vocab_size


def run_engine_bench(overrides: list[str]) -> dict[str, Any]:
    s = validate(EngineBenchSettings, apply_overrides({}, overrides))
    torch.set_num_threads(s.threads)
    device = resolve_device(s.device)
    dtype = bench_dtype(s, device)
    with phase("engine", f"model on {device}, {str(dtype).removeprefix('torch.')}"):
        model = bench_model(s, device, dtype)
    vocab = vocab_size(model)
    rng = random.Random(s.seed)
    workloads = {
        "uniform": [s.uniform_tokens] * s.batch_size,
        "longtail": [rng.randint(*s.long_tokens) if rng.random() < s.long_fraction else rng.randint(*s.short_tokens)
                     for _ in range(s.longtail_requests)],
    }
    run_engine = engine_runner(s)
    systems = {"generate": run_generate, "torch": run_engine}
    labels = {"generate": "model.generate", "torch": "TorchEngine"}
    if s.generate_static:
        systems["generate_static"], labels["generate_static"] = run_generate_static, "generate(static)"
    with phase("engine", "warm-up"):
        warm = torch.randint(4, vocab, (4, s.prompt_tokens))
        for fn in systems.values():
            fn(model, warm, [4] * 4, 4, 1.0)
    tokens_per_s: dict[str, dict[str, float]] = {name: {} for name in systems}
    inputs = {workload: (torch.randint(4, vocab, (len(lengths), s.prompt_tokens),
                                       generator=torch.Generator().manual_seed(s.seed)), lengths)
              for workload, lengths in workloads.items()}
    for workload, (prompts, lengths) in inputs.items():
        times: dict[str, list[float]] = {name: [] for name in systems}
        with phase("engine", workload, total=s.repeats * len(systems)) as progress:
            for _ in range(s.repeats):  # interleaved, so drifts in machine load hit both alike
                for name, fn in systems.items():
                    times[name].append(fn(model, prompts, lengths, s.batch_size, s.temperature))
                    progress.advance()  # between timed runs, never inside one
            for name in systems:
                tokens_per_s[name][workload] = sum(lengths) / statistics.median(times[name])
            progress.figure = ", ".join(f"{labels[n]} {tokens_per_s[n][workload]:,.0f} tok/s" for n in systems)
    for workload, lengths in workloads.items():
        print(f"{workload:9s} requests={len(lengths):4d} tokens={sum(lengths):6d} max_len={max(lengths):4d}  " +
              "  ".join(f"{n}={tokens_per_s[n][workload]:8.0f} tok/s" for n in systems))
    probe = torch_engine(model, RolloutConfig(max_batch_size=s.batch_size, kv_cache=s.kv_cache, capture=s.capture))
    engine_path = {"kv_cache": probe.kv_cache, "capture": probe.capture}
    asyncio.run(probe.shutdown())
    result = {
        "settings": s.model_dump(),
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "engine": engine_path,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "tokens_per_s": tokens_per_s,
        "ratio_vs_generate_uniform": tokens_per_s["torch"]["uniform"] / tokens_per_s["generate"]["uniform"],
        "ratio_vs_generate_longtail": tokens_per_s["torch"]["longtail"] / tokens_per_s["generate"]["longtail"],
    }
    if s.generate_static:
        for workload in workloads:
            result[f"ratio_vs_generate_static_{workload}"] = (
                tokens_per_s["torch"][workload] / tokens_per_s["generate_static"][workload])
    group = result["group"] = run_group_bench(model, s)
    result["group_prefill_speedup"] = group["tokens_per_s"]["on"] / group["tokens_per_s"]["off"]
    print(f"device={result['device']} dtype={result['dtype']} kv_cache={engine_path['kv_cache']} "
          f"capture={engine_path['capture']}  " + "".join(
              f"ratio_vs_generate_static_{w}={result[f'ratio_vs_generate_static_{w}']:.2f}  "
              for w in workloads if s.generate_static))
    print(f"ratio_vs_generate_uniform={result['ratio_vs_generate_uniform']:.2f}  "
          f"ratio_vs_generate_longtail={result['ratio_vs_generate_longtail']:.2f}  "
          f"group_prefill_speedup={result['group_prefill_speedup']:.2f}")
    if not s.vllm:
        result["vllm"] = "off"
    elif importlib.util.find_spec("vllm") is None:
        result["vllm"] = "not installed"
    else:
        try:
            vllm = result["vllm"] = run_vllm(model, inputs, s)
        except (RuntimeError, ValueError) as exc:  # e.g. a head size vLLM's CPU attention lacks
            result["vllm"] = f"failed: {exc!r}"
            print(f"vllm: {result['vllm']}")
            return result
        for workload in workloads:
            result[f"ratio_vllm_vs_generate_{workload}"] = (
                vllm["tokens_per_s"][workload] / tokens_per_s["generate"][workload])
        print(f"vllm: start-up {vllm['startup_s']:.1f} s  " + "  ".join(
            f"{w}={vllm['tokens_per_s'][w]:8.0f} tok/s (x{result[f'ratio_vllm_vs_generate_{w}']:.2f} generate)"
            for w in workloads))
    return result
