"""``asyncrl bench learner``: one train step of the learner on 1 rank and on N ranks of a
sharded learner (``learner.world_size``), same batch, same model, measured side by side.

Two models: ``model_path`` (the shipped ``models/countdown-tiny``) and a Qwen2 or Llama
generated with random weights from its shape keys (``hidden_size``, ``num_layers``,
``intermediate_size``, ``num_kv_heads``: ~25M parameters by default; Llama-3.2-1B's decoder,
~1B, with ``architecture=llama hidden_size=2048 num_layers=16 intermediate_size=8192
num_kv_heads=8``) and the tiny char tokenizer, so nothing is downloaded. ``lora_ranks``
times full fine-tuning (0) and LoRA at each rank r > 0 (``model.lora.rank=r``, every other
LoRA key its default) on the same batch; LoRA trains on one rank, so only the one-rank
configuration is timed with it. Each configuration runs as rank processes
(the ``RankProcesses`` transport, ``asyncrl/runtime/rank_processes.py``), the one-rank baseline too, so every one pays
the same process boundary; torch threads are split evenly over the ranks (``threads`` in all).

A step's time is the slowest rank's, from a barrier to the end of the optimizer step
(median of ``repeats`` after a warm-up step). Memory per rank: the bytes of parameters,
gradients and optimizer state the rank holds, counted exactly from the tensors' local
shards (what FSDP2 divides by N and DDP does not), and the process's peak RSS after the
steps (which also holds the interpreter and the libraries; how much a rank's loading takes
is ``examples/sharded_load/measure_rss.py``'s); on CUDA, ``torch.cuda.max_memory_allocated``
per rank.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

from asyncrl.bench.progress import phase
from asyncrl.config import ConfigError, Section, apply_overrides, load_config, validate
from asyncrl.learner import TrainBatch, pack_batch
from asyncrl.runtime.rank_processes import RankProcesses
from asyncrl.tiny import build_char_tokenizer, save_tiny_policy, tiny_qwen2_config
from asyncrl.types import Trajectory


class LearnerBenchSettings(Section):
    model_path: str = "models/countdown-tiny"
    architecture: Literal["qwen2", "llama"] = "qwen2"
    """The generated model's family: the same shape either way, but Qwen2 has q/k/v biases."""
    hidden_size: int = Field(512, ge=0)
    """The generated model's width (0 = no generated model); heads of 64 (at least 4)."""
    num_layers: int = Field(8, ge=1)
    """The generated model's decoder layers."""
    intermediate_size: int | None = Field(None, ge=1)
    """The generated model's MLP width; ``None``: 3 × hidden_size."""
    num_kv_heads: int | None = Field(None, ge=1)
    """The generated model's key/value heads (grouped-query attention); ``None``: half the heads."""
    lora_ranks: list[int] = Field([0], strict=False)
    """0: full fine-tuning; r > 0: LoRA of rank r (one rank only), timed in this order."""
    world_sizes: list[int] = Field([1, 2], strict=False)
    """Rank counts to time; 1 is the unsharded learner (the baseline)."""
    strategies: list[str] = Field(["fsdp2", "ddp"], strict=False)
    """Sharding strategies timed at each world size > 1."""
    rows: int = Field(16, ge=1)
    """Trajectories in the step's batch."""
    prompt_tokens: int = Field(32, ge=1)
    response_tokens: int = Field(64, ge=2)
    """The longest response; lengths are drawn from [response_tokens / 2, response_tokens]."""
    micro_batch_size: int = Field(8, ge=1)
    repeats: int = Field(3, ge=1)
    threads: int | None = Field(None, ge=1)
    """torch threads in all, split evenly over the ranks; ``None``: the machine's cores."""
    seed: int = 0


def generated_model(s: LearnerBenchSettings, path: Path) -> Path:
    """A Qwen2 or Llama of the settings' shape with random weights and the tiny char tokenizer."""
    tokenizer = build_char_tokenizer()
    heads = max(4, s.hidden_size // 64)
    kv_heads = s.num_kv_heads or max(1, heads // 2)
    if heads % kv_heads:
        raise ConfigError(f"bench learner: num_kv_heads={kv_heads} must divide the {heads} heads of "
                          f"hidden_size={s.hidden_size} (heads of 64, at least 4)")
    config = tiny_qwen2_config(len(tokenizer), hidden_size=s.hidden_size, num_layers=s.num_layers, num_heads=heads,
                               num_kv_heads=kv_heads, intermediate_size=s.intermediate_size or 3 * s.hidden_size,
                               max_position_embeddings=s.prompt_tokens + s.response_tokens, tokenizer=tokenizer)
    if s.architecture == "llama":  # the same shape keys; Llama has no attention biases
        config = LlamaConfig(**{k: getattr(config, k) for k in LLAMA_SHAPE_KEYS})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        model = (LlamaForCausalLM if s.architecture == "llama" else Qwen2ForCausalLM)(config)
    path = save_tiny_policy(model, tokenizer, path)
    del model  # a 1B model is 4 GiB in float32: not held while the ranks load their own
    return path


LLAMA_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "pad_token_id",
                    "eos_token_id", "bos_token_id")


def count_parameters(path: Path) -> tuple[int, Any]:
    """The model's parameter count and config, built on the meta device: no weights loaded."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), config


def bench_batch(s: LearnerBenchSettings, vocab_size: int, max_positions: int) -> TrainBatch:
    """``rows`` trajectories of random tokens, responses of different lengths."""
    g = torch.Generator().manual_seed(s.seed)
    prompt_len = min(s.prompt_tokens, max_positions // 2)
    longest = min(s.response_tokens, max_positions - prompt_len)
    trajectories = []
    for _ in range(s.rows):
        n = int(torch.randint(max(1, longest // 2), longest + 1, (1,), generator=g))
        prompt = torch.randint(4, vocab_size, (prompt_len,), generator=g).tolist()
        response = torch.randint(4, vocab_size, (n,), generator=g).tolist()
        behavior = (-torch.rand(n, generator=g) * 6).tolist()
        trajectories.append(Trajectory(prompt, response, [1] * n, behavior, [0] * n, reward=0.0))
    return pack_batch(trajectories, torch.randn(s.rows, generator=g).tolist(), pad_id=0)


def run_config(s: LearnerBenchSettings, name: str, path: Path, batch: TrainBatch, world_size: int,
               strategy: str | None, lora_rank: int = 0) -> dict[str, Any]:
    """Warm-up, ``repeats`` timed steps and the memory of each rank, for one configuration."""
    cfg = load_config(None, [f"model.path={path}", f"learner.world_size={world_size}", f"total_steps={s.repeats + 1}",
                             "batch_size=1", f"group_size={s.rows}", f"optim.micro_batch_size={s.micro_batch_size}",
                             *([f"learner.strategy={strategy}"] if strategy else []),
                             *([f"model.lora.rank={lora_rank}"] if lora_rank else [])])
    threads = max(1, (s.threads or os.cpu_count() or 1) // world_size)
    label = (f"{name}, {world_size} rank{'s' if world_size > 1 else ''}" + (f" {strategy}" if strategy else "")
             + (f", LoRA r={lora_rank}" if lora_rank else ""))

    async def measure() -> dict[str, Any]:
        ranks = RankProcesses(cfg, num_threads=threads)
        try:
            await ranks.start()
            with phase("learner", label, total=s.repeats + 1, unit="step") as progress:
                times = []
                for i in range(s.repeats + 1):
                    per_rank = [t for _, t in await ranks.call("timed_train_step", batch, False)]
                    if i:  # the first step warms up (allocations, thread pools)
                        times.append(max(per_rank))
                    progress.advance()  # between timed steps
                memory = await ranks.call("memory")
                step_s = statistics.median(times)
                state = max(m["params"] + m["grads"] + m["optimizer"] for m in memory)
                progress.figure = f"{step_s:.3f} s/step, params+grads+optimizer {state / 2**20:,.1f} MiB/rank"
            return {"world_size": world_size, "strategy": strategy, "lora_rank": lora_rank,
                    "threads_per_rank": threads, "step_s": step_s,
                    "step_s_all": times, "memory": memory, "state_bytes_per_rank": state,
                    "peak_rss_per_rank": max(m["peak_rss"] for m in memory),
                    **({"cuda_max_allocated_per_rank": max(m["cuda_max_allocated"] for m in memory)}
                       if "cuda_max_allocated" in memory[0] else {})}
        finally:
            await ranks.close()

    return asyncio.run(measure())


def run_learner_bench(overrides: list[str]) -> dict[str, Any]:
    s = validate(LearnerBenchSettings, apply_overrides({}, overrides))
    if 1 not in s.world_sizes:
        raise ConfigError("bench learner: world_sizes must include 1, the baseline the others are compared with")
    unknown = set(s.strategies) - {"fsdp2", "ddp"}
    if unknown:
        raise ConfigError(f"bench learner: unknown strategies {sorted(unknown)}; valid: fsdp2, ddp")
    if any(r < 0 for r in s.lora_ranks) or not s.lora_ranks:
        raise ConfigError(f"bench learner: lora_ranks={s.lora_ranks}: 0 (full fine-tuning) or LoRA ranks r > 0")
    configs = [(1, None)] + [(n, strategy) for n in sorted(set(s.world_sizes)) if n > 1 for strategy in s.strategies]
    if torch.cuda.is_available():  # one GPU per rank
        skipped = [n for n, _ in configs if n > torch.cuda.device_count()]
        configs = [(n, st) for n, st in configs if n <= torch.cuda.device_count()]
        if skipped:
            print(f"[bench learner] skipping world sizes {sorted(set(skipped))}: {torch.cuda.device_count()} GPU(s)")
    result: dict[str, Any] = {"settings": s.model_dump(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        models = {Path(s.model_path).name: Path(s.model_path)}
        if s.hidden_size:
            models[f"{s.architecture}-h{s.hidden_size}-l{s.num_layers}"] = generated_model(s, Path(tmp) / "generated")
        for name, path in models.items():
            if not (path / "config.json").is_file():
                raise ConfigError(f"bench learner: model_path {str(path)!r} is not a Hugging Face model directory")
            params, config = count_parameters(path)
            batch = bench_batch(s, config.vocab_size, config.max_position_embeddings)
            runs = [run_config(s, name, path, batch, n, strategy, rank) for rank in s.lora_ranks
                    for n, strategy in (configs if rank == 0 else configs[:1])]
            base = runs[0]  # one rank, the first of lora_ranks
            for run in runs:
                run["speedup_vs_1"] = base["step_s"] / run["step_s"]
                run["state_ratio_vs_1"] = run["state_bytes_per_rank"] / base["state_bytes_per_rank"]
            result["models"][name] = {"params": params, "tokens": int(batch.loss_mask.sum()), "runs": runs}
    print(table(result))
    return result


def table(result: dict[str, Any]) -> str:
    head = (f"{'model':22s} {'params':>8s} {'LoRA r':>6s} {'ranks':>5s} {'strategy':>8s} {'step s':>8s} "
            f"{'speedup':>7s} "
            f"{'params+grads+optim MiB/rank':>27s} {'vs 1 rank':>9s} {'peak RSS MiB/rank':>17s}")
    cuda = any("cuda_max_allocated_per_rank" in r for m in result["models"].values() for r in m["runs"])
    head += f" {'CUDA max alloc MiB/rank':>23s}" if cuda else ""
    lines = [head]
    for name, m in result["models"].items():
        for r in m["runs"]:
            line = (f"{name:22s} {m['params'] / 1e6:7.1f}M {r['lora_rank'] or '-':>6} {r['world_size']:5d} "
                    f"{r['strategy'] or '-':>8s} "
                    f"{r['step_s']:8.3f} {r['speedup_vs_1']:7.2f} {r['state_bytes_per_rank'] / 2**20:27.1f} "
                    f"{r['state_ratio_vs_1']:9.2f} {r['peak_rss_per_rank'] / 2**20:17.0f}")
            if cuda:
                line += f" {r.get('cuda_max_allocated_per_rank', 0) / 2**20:23.1f}"
            lines.append(line)
    return "\n".join(lines)
