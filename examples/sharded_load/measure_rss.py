"""Each learner rank's peak RSS while it loads the policy, in one run side by side: one rank
(``load_policy``, the whole model), two gloo ranks as they loaded before sharded loading
(the whole model, then ``fully_shard``) and two ranks loading in shards
(``asyncrl/learner/sharded_load.py``). docs/scaling.md, "Loading in shards", has the figures.

    python examples/sharded_load/measure_rss.py MODEL_DIR [float32 bfloat16 ...]

Each configuration runs in fresh processes (spawned: nothing inherited), and each rank
reads every element it holds once after loading, as the first forward pass would: a
checkpoint whose dtype is the model's is memory-mapped by ``from_pretrained``, and its
pages are resident only once read, so a figure taken before that would flatter the whole
load. RSS counts those file-backed pages as well as the process's own memory.
"""

from __future__ import annotations

import resource
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.config import ModelConfig
from asyncrl.learner.distributed import Sharding
from asyncrl.learner.sharded_load import load_sharded
from asyncrl.policy import load_policy

WAYS = {"one rank, whole": 1, "2 ranks, whole then sharded": 2, "2 ranks, sharded": 2}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank(index: int, way: str, world_size: int, path: str, dtype: str, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    cfg = ModelConfig(path=path, dtype=dtype)
    sharding = None
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=world_size)
        sharding = Sharding("fsdp2", index, world_size, torch.device("cpu"))
    before = peak_mib()
    if way.endswith("sharded") and not way.endswith("then sharded"):
        model = load_sharded(cfg, sharding)
    else:
        model = load_policy(cfg)[0]
        model = sharding.wrap(model) if sharding is not None else model
    held = 0
    with torch.no_grad():  # every element this rank holds, read once (a forward pass would)
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            held += local.numel() * local.element_size()
            local.sum()
    out[index] = (before, peak_mib(), held / 2**20)
    if sharding is not None:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(path: str, dtypes: list[str]) -> None:
    print(f"{'dtype':9s} {'how':30s} {'rank':>4s} {'RSS before MiB':>14s} {'peak RSS MiB':>12s} {'held MiB':>9s}")
    with mp.Manager() as manager:
        for dtype in dtypes:
            for way, world_size in WAYS.items():
                out = manager.dict()
                mp.spawn(rank, args=(way, world_size, path, dtype, free_port(), out), nprocs=world_size)
                for index in sorted(out):
                    before, peak, held = out[index]
                    print(f"{dtype:9s} {way:30s} {index:4d} {before:14.0f} {peak:12.0f} {held:9.0f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["float32", "bfloat16"])
