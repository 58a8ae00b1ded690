"""serve-tinker's peak memory on a tinker-cookbook-sized RL batch, through Tinker's own SDK.

    python examples/tinker/peak_memory.py [CONFIG.yaml [key=value ...]]

Starts ``asyncrl serve-tinker CONFIG`` (default ``examples/tinker/cookbook/serve.yaml`` with
``tinker.base_model`` the SmolLM2 directory ``asyncrl models get`` put on this machine) on a
free port, sends one batch the size of a multi-turn recipe's first (160 datums, about 50k
tokens) as ``forward_backward(..., "importance_sampling")`` then ``optim_step``, and prints
one JSON line: the server's peak resident memory (``VmHWM`` of its process, which holds the
model, its sampler and the training thread), its resident memory after loading, the batch's
size and the call's wall time. As in a recipe, a datum's first part is its prompt
(advantage 0: no loss there) and its rest the sampled turn (advantage ±1).

The server is stopped on the way out, also on failure.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types

DATUMS, MEAN_TOKENS = 160, 312  # 160 × ~312 ≈ 50k tokens


def peak_kib(pid: int, field: str) -> int:
    """A /proc/<pid>/status memory field (VmHWM: the peak resident set; VmRSS: now), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def batch(vocab: int, seed: int = 0) -> list[types.Datum]:
    """DATUMS random-token datums of 200 to 424 tokens, the first 40 % of each a prompt."""
    rng = random.Random(seed)
    data = []
    for _ in range(DATUMS):
        n = rng.randint(2 * MEAN_TOKENS - 424, 424)
        tokens = [rng.randrange(vocab) for _ in range(n + 1)]
        prompt = int(0.4 * n)
        advantages = np.zeros(n, np.float32)
        advantages[prompt:] = rng.choice([-1.0, 1.0])
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], np.int64), "logprobs": np.full(n, -10.0, np.float32),
            "advantages": advantages}))
    return data


def main(argv: list[str]) -> None:
    if argv:
        args = [*argv, "tinker.port=0"]
    else:
        get = [sys.executable, "-m", "asyncrl.cli", "models", "get", "smollm2-135m-instruct"]
        model = subprocess.run(get, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        args = ["examples/tinker/cookbook/serve.yaml", f"tinker.base_model={model}", "tinker.port=0"]
    server = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve-tinker", *args],
                              stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()  # printed once the server listens
        if not url:
            raise SystemExit(f"serve-tinker exited ({server.wait()}) before printing its URL")
        loaded = peak_kib(server.pid, "VmRSS")
        service = tinker.ServiceClient(base_url=url, api_key="tml-local")
        rest = tinker.RestClient(base_url=url, api_key="tml-local")
        base = rest.get_server_capabilities().result().supported_models[0].model_name
        training = service.create_lora_training_client(base_model=base, rank=32, seed=0)
        vocab = len(training.get_tokenizer())
        data = batch(vocab)
        start = time.perf_counter()
        result = training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=1e-5)).result()
        took = time.perf_counter() - start
        print(json.dumps({"peak_rss_mb": round(peak_kib(server.pid, "VmHWM") / 1024),
                          "loaded_rss_mb": round(loaded / 1024), "datums": len(data),
                          "tokens": sum(d.model_input.length for d in data), "seconds": round(took, 1),
                          "loss_sum": round(result.metrics["loss:sum"], 3), "cpus": os.cpu_count()}), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main(sys.argv[1:])
