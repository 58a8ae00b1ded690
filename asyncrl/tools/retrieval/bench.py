"""Where the numbers in ``index.py`` and ``service.py`` come from.

``python -m asyncrl.tools.retrieval.bench libraries``: bm25s against rank-bm25 (if
installed: ``pip install rank-bm25``) on the same tokens, 2k and 20k documents.
``python -m asyncrl.tools.retrieval.bench batching``: the service in its own process over
20k documents, 64 clients each sending its next query when the last is answered, with
and without batching. Documents are synthetic: 15–50 words from an 8,000-word Zipf-like
vocabulary; a query is 2–5 words of one document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from asyncrl.tools.retrieval.index import BM25Index, tokenize
from asyncrl.tools.retrieval.types import Document


def synthetic_corpus(num_docs: int, num_queries: int = 512, seed: int = 0) -> tuple[list[Document], list[str]]:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(8000)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(vocab))]
    docs = [Document(f"d{i}", " ".join(rng.choices(vocab, weights, k=rng.randint(15, 50)))) for i in range(num_docs)]
    queries = []
    for _ in range(num_queries):
        words = rng.choice(docs).text.split()
        queries.append(" ".join(rng.sample(words, min(len(words), rng.randint(2, 5)))))
    return docs, queries


def _best_of(fn: Callable[[], Any], reps: int = 3) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def libraries() -> None:
    try:
        import rank_bm25  # an optional comparison, not a dependency
    except ImportError:
        rank_bm25 = None
        print("rank-bm25 is not installed (pip install rank-bm25): measuring bm25s only")

    for n in (2000, 20000):
        _compare(n, rank_bm25)


def _compare(n: int, rank_bm25: Any) -> None:
    import bm25s

    docs, queries = synthetic_corpus(n)
    tokens, query_tokens = [tokenize(d.text) for d in docs], [tokenize(q) for q in queries]

    def build() -> bm25s.BM25:
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        return retriever

    t_build, retriever = _best_of(build)
    t_one, _ = _best_of(lambda: [retriever.retrieve([q], k=5, show_progress=False) for q in query_tokens[:200]])
    print(f"{n} documents: bm25s     build {t_build * 1e3:6.0f} ms, one query {t_one / 200 * 1e3:6.3f} ms "
          f"({200 / t_one:,.0f} queries/s)")
    if rank_bm25 is not None:
        t_build, okapi = _best_of(lambda: rank_bm25.BM25Okapi(tokens))
        nq = 200 if n <= 2000 else 30  # rank-bm25 scores a query in a Python loop over every document: few at 20k
        t_one, _ = _best_of(lambda: [np.argpartition(-okapi.get_scores(q), 5)[:5] for q in query_tokens[:nq]])
        print(f"{n} documents: rank-bm25 build {t_build * 1e3:6.0f} ms, one query {t_one / nq * 1e3:6.3f} ms "
              f"({nq / t_one:,.0f} queries/s)")
    index = BM25Index(docs)
    t_ours, _ = _best_of(lambda: index.search_batch(queries[:64], 5))
    t_lib, _ = _best_of(lambda: retriever.retrieve(query_tokens[:64], k=5, show_progress=False))
    print(f"{n} documents: 64 queries, BM25Index.search_batch {t_ours * 1e3:.1f} ms, "
          f"bm25s retrieve {t_lib * 1e3:.1f} ms")


async def _batches(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as r:
        return (await r.json())["batches"]


async def _load(url: str, queries: list[str], clients: int, duration_s: float) -> list[float]:
    """Each client's request latencies, ``clients`` sending one query after the other."""
    latencies: list[float] = []
    deadline = time.perf_counter() + duration_s

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            async with session.post(f"{url}/search", json={"query": queries[i % len(queries)], "k": 5}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            latencies.append(time.perf_counter() - start)
            i += clients

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(client(session, i) for i in range(clients)))
    return latencies


def batching(clients: int = 64, duration_s: float = 3.0, rounds: int = 3) -> None:
    """Three services at once, measured in turn, ``rounds`` times (the median is printed):
    interleaving spreads whatever else the machine does over all three alike."""
    docs, queries = synthetic_corpus(20000)
    settings = ((1, 0.0), (64, 0.0), (64, 0.002))
    rows: dict[tuple[int, float], list[tuple[float, ...]]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
        procs = {s: subprocess.Popen([sys.executable, "-m", "asyncrl.tools.retrieval", "--docs", str(path),
                                      "--max-batch", str(s[0]), "--max-wait-s", str(s[1])],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for s in settings}
        try:
            urls = {s: proc.stdout.readline().strip() for s, proc in procs.items()}
            for _ in range(rounds):
                for s, url in urls.items():
                    before = asyncio.run(_batches(url))  # the counter is the service's life's: take differences
                    lat = asyncio.run(_load(url, queries, clients, duration_s))
                    batches = asyncio.run(_batches(url)) - before
                    rows[s].append((len(lat) / duration_s, statistics.median(lat), float(np.percentile(lat, 99)),
                                    len(lat) / max(1, batches)))
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(10)
    for (max_batch, max_wait_s), runs in rows.items():
        qps, p50, p99, mean_batch = (statistics.median(col) for col in zip(*runs, strict=True))
        print(f"max_batch {max_batch:2d}, max_wait_s {max_wait_s:g}: {qps:,.0f} queries/s "
              f"(rounds: {', '.join(f'{r[0]:,.0f}' for r in runs)}), p50 {p50 * 1e3:.0f} ms, "
              f"p99 {p99 * 1e3:.0f} ms, mean batch {mean_batch:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.tools.retrieval.bench")
    parser.add_argument("what", choices=["libraries", "batching"])
    {"libraries": libraries, "batching": batching}[parser.parse_args().what]()


if __name__ == "__main__":
    main()
