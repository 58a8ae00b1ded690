"""``asyncrl bench sync``: one weight sync, ``object_store`` against ``collective``, side by
side in one run, for the shipped policy and a generated ~100M-parameter Qwen2, with 1 and
2 rollout workers — Ray actors on a local cluster, as ``runtime: ray`` runs them.

A sync is what the trainer waits for after a step (``WeightSync.sync``): ``object_store``
= the learner actor exports a snapshot into the object store, each worker gets it and
loads it; ``collective`` = the learner broadcasts bucket by bucket over the gloo group and
each worker unpacks and loads. Both runtimes' groups are up before timing (the group is
formed once per run), engines idle. The two methods alternate within each repeat, on the
same actors, with increasing versions; the figure is the median of ``repeats``. After
the runs each engine's weights are checked against the learner's (a digest of every
byte), for both methods.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from asyncrl.bench.progress import phase
from asyncrl.config import Config, Section, apply_overrides, validate
from asyncrl.weight_sync import CollectiveSync, ObjectStoreSync, WeightSync, fingerprint
from asyncrl.weight_sync.endpoints import served_fingerprint

METHODS = ("object_store", "collective")


class SyncBenchSettings(Section):
    shipped_path: str = "models/countdown-tiny"
    generated: bool = True
    """Also the generated Qwen2 below (random weights, the shipped tokenizer)."""
    hidden_size: int = Field(768, ge=8)
    num_layers: int = Field(12, ge=1)
    intermediate_size: int = Field(3072, ge=8)
    """768 / 12 layers / 3072: ~104M parameters, 415 MB in float32."""
    workers: list[int] = Field(default_factory=lambda: [1, 2])
    """Rollout-worker counts to time (each a fresh set of actors)."""
    repeats: int = Field(5, ge=1)
    bucket_mb: float = Field(64.0, gt=0)
    timeout_s: float = Field(300.0, gt=0)
    num_cpus: int = Field(2, ge=1)
    """CPUs of the local Ray cluster: the learner takes 1, each worker 0.5."""


def _generated_model(s: SyncBenchSettings, out: Path) -> Path:
    from transformers import AutoTokenizer

    from asyncrl.tiny import build_tiny_model, save_tiny_policy

    tokenizer = AutoTokenizer.from_pretrained(s.shipped_path)
    heads = max(1, s.hidden_size // 64)
    model, tokenizer = build_tiny_model(tokenizer, seed=0, hidden_size=s.hidden_size, num_layers=s.num_layers,
                                        num_heads=heads, num_kv_heads=max(1, heads // 3),
                                        intermediate_size=s.intermediate_size)
    save_tiny_policy(model, tokenizer, out)
    return out


def _config(s: SyncBenchSettings, model_path: Path | str, workers: int) -> Config:
    return validate(Config, apply_overrides({}, [
        f"model.path={model_path}", "runtime=ray", "mode=sync", "eval.background=false", "rollout.max_batch_size=8",
        f"ray.num_rollout_workers={workers}", "ray.worker_cpus=0.5", "ray.learner_cpus=1",
        "weight_sync=collective", f"weight_sync.bucket_mb={s.bucket_mb}", f"weight_sync.timeout_s={s.timeout_s}"]))


def _weights(worker: Any) -> dict[str, Any]:
    """The learner's weights, read in its worker (``publish`` on Ray leaves them in the store)."""
    return worker.learner.export_weights()


async def _measure(cfg: Config, repeats: int, advance) -> dict[str, Any]:
    from asyncrl.runtime import start

    async with start(cfg, model=None, tokenizer=None, train=True) as runtime:
        assert isinstance(runtime.weight_sync, CollectiveSync)
        syncs: dict[str, WeightSync] = {"object_store": ObjectStoreSync(runtime.learner, runtime.rollout),
                                        "collective": runtime.weight_sync}
        reference = fingerprint((await runtime.learner.apply(_weights))[0].items())
        await runtime.rollout.apply(served_fingerprint)  # every engine is up before the clock starts
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        checked: dict[str, bool] = {}
        version = 0
        for i in range(repeats + 1):  # the first round warms both paths up, untimed
            for method in METHODS:
                version += 1
                start_t = time.perf_counter()
                await syncs[method].sync(version, "abort")
                elapsed = time.perf_counter() - start_t
                if i:
                    times[method].append(elapsed)
                if i == repeats:  # the last: every engine holds the learner's weights, at this version
                    served = await runtime.rollout.apply(served_fingerprint)
                    checked[method] = served == [(version, reference)] * cfg.ray.num_rollout_workers
            if i:
                advance()
    if not all(checked.values()):
        raise RuntimeError(f"an engine's weights differ from the learner's after a sync: {checked}")
    return {f"{m}_s": statistics.median(times[m]) for m in METHODS} | {f"{m}_runs_s": times[m] for m in METHODS}


def run_sync_bench(overrides: list[str]) -> dict[str, Any]:
    import ray
    from transformers import AutoConfig

    s = validate(SyncBenchSettings, apply_overrides({}, overrides))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-sync-") as tmp:
        models: list[tuple[str, Path | str]] = [("countdown-tiny", s.shipped_path)]
        if s.generated:
            with phase("sync", f"generate a Qwen2 of hidden {s.hidden_size} × {s.num_layers} layers"):
                models.append(("generated", _generated_model(s, Path(tmp) / "generated")))
        started = not ray.is_initialized()  # a cluster already up (a test's) is joined and left up
        if started:
            ray.init(num_cpus=s.num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
        try:
            for name, path in models:
                params, nbytes = _size(path)
                for workers in s.workers:
                    label = f"{name} ({params / 1e6:.1f}M params), {workers} worker{'s' * (workers > 1)}"
                    with phase("sync", label, total=s.repeats, unit="repeat") as p:
                        result = asyncio.run(_measure(_config(s, path, workers), s.repeats, p.advance))
                        ratio = result["object_store_s"] / result["collective_s"]
                        p.figure = (f"object_store {result['object_store_s'] * 1e3:.1f} ms, collective "
                                    f"{result['collective_s'] * 1e3:.1f} ms ({ratio:.2f}x)")
                    rows.append({"model": name, "model_type": AutoConfig.from_pretrained(path).model_type,
                                 "params_m": params / 1e6, "mb": nbytes / (1 << 20), "workers": workers,
                                 **result, "object_store_over_collective": ratio})
        finally:
            if started:
                ray.shutdown()
    print(f"{'model':16s} {'params':>8s} {'MiB':>7s} {'workers':>7s} {'object_store ms':>15s} "
          f"{'collective ms':>13s} {'object/collective':>17s}")
    for r in rows:
        print(f"{r['model']:16s} {r['params_m']:7.1f}M {r['mb']:7.1f} {r['workers']:7d} "
              f"{r['object_store_s'] * 1e3:15.1f} {r['collective_s'] * 1e3:13.1f} "
              f"{r['object_store_over_collective']:17.2f}")
    print(f"median of {s.repeats} syncs each, methods alternating on the same actors; bucket {s.bucket_mb:g} MiB, "
          f"gloo over loopback; every engine's weights checked against the learner's")
    return {"settings": s.model_dump(), "results": rows}


def _size(path: Path | str) -> tuple[int, int]:
    """(parameters, bytes) of the checkpoint, read from its safetensors headers: what the
    engines receive (a tied LM head is saved, and sent, once)."""
    from safetensors import safe_open

    params = nbytes = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                params += n
                nbytes += n * _DTYPE_BYTES[t.get_dtype()]
    return params, nbytes


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
