"""``python -m asyncrl.tools.retrieval --docs FILE.jsonl [--port 8100] [--latency-s 0.05]
[--latency-p99-s 8]
[--index bm25|dense|hybrid] [--encoder minilm|MODEL_PATH]``: the retrieval service in its own process.
Prints its URL on stdout once listening;
Ctrl-C or SIGTERM stops it (exit 0). A bad documents file or a taken port exits 2 with
one line saying which."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from asyncrl.jsonl import JsonlError
from asyncrl.tools.retrieval.dense import build_index
from asyncrl.tools.retrieval.index import load_documents
from asyncrl.tools.retrieval.service import Latency, RetrievalService


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.tools.retrieval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", required=True, help='JSONL, one {"id": str, "text": str} object a line')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (the default): a free one")
    parser.add_argument("--latency-s", type=float, default=0.0, help="added to every request")
    parser.add_argument("--latency-p99-s", type=float, default=None,
                        help="with --latency-s as the median: each request's latency drawn from a lognormal "
                             "with this 99th percentile (seeded by --latency-seed)")
    parser.add_argument("--latency-seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=64, help="queries scored together at most")
    parser.add_argument("--index", choices=["bm25", "dense", "hybrid"], default="bm25",
                        help="dense and hybrid: asyncrl/tools/retrieval/dense.py")
    parser.add_argument("--encoder", default="minilm",
                        help="dense, hybrid: 'minilm' (the research extra) or a causal LM's path "
                             "(pooled hidden states)")
    parser.add_argument("--max-wait-s", type=float, default=0.0, help="how long a batch with room waits for more")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        index = build_index(load_documents(args.docs), args.index, args.encoder)
        latency = None if args.latency_p99_s is None else \
            Latency(args.latency_s, args.latency_p99_s, seed=args.latency_seed)
        service = RetrievalService(index, latency_s=args.latency_s, max_batch=args.max_batch,
                                   max_wait_s=args.max_wait_s, latency=latency)
    except (JsonlError, ValueError, ImportError, OSError) as exc:  # OSError: an encoder path that is not a model
        print(f"retrieval: {exc}", file=sys.stderr)
        return 2
    print(f"retrieval: indexed {len(index)} documents from {args.docs} in {time.perf_counter() - started:.2f} s",
          file=sys.stderr, flush=True)
    return asyncio.run(_serve(service, args.host, args.port))


async def _serve(service: RetrievalService, host: str, port: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await service.start(host, port)
    except OSError as exc:  # the port is taken, or the host is not ours
        print(f"retrieval: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    try:
        print(url, flush=True)
        print("retrieval: POST /search, GET /health; Ctrl-C stops", file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await service.stop()
    counts = service.counts
    print(f"retrieval: stopped after {counts['requests']} requests in {counts['batches']} batches",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
