"""The retrieval tool: BM25 ranking, the batched HTTP service (latency, refusals, health,
its own process) and the agent's client, whose failures (timeouts after retries, a
stopped service, a refused query) come back as text instead of raising. Every service
binds a free port and is stopped by its test, also when the test fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from asyncrl.jsonl import JsonlError
from asyncrl.tools.retrieval import (
    BM25Index,
    Document,
    RetrievalClient,
    RetrievalError,
    RetrievalService,
    format_hits,
    load_documents,
)

DOCS = [
    Document("plants", "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar; "
                       "chlorophyll absorbs the light."),
    Document("volcano", "A volcano erupts when magma rises through the crust; lava flows and ash clouds follow."),
    Document("rome", "The Roman Empire was ruled from Rome by emperors such as Augustus and Trajan."),
    Document("python", "Python is a programming language with dynamic typing and garbage collection."),
    Document("ocean", "The Pacific Ocean is the largest and deepest ocean on Earth."),
    Document("sun", "The Sun is a star; its light takes about eight minutes to reach Earth."),
]


@contextlib.asynccontextmanager
async def serving(documents: list[Document] = DOCS, **options: float) -> AsyncIterator[RetrievalService]:
    service = RetrievalService(BM25Index(documents), **options)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


def test_the_obviously_relevant_document_ranks_first():
    index = BM25Index(DOCS)
    for query, best in [("how does photosynthesis work in plants", "plants"), ("lava from a volcano", "volcano"),
                        ("emperor Augustus of Rome", "rome"), ("garbage collection in Python", "python"),
                        ("deepest ocean", "ocean")]:
        hits = index.search(query, 3)
        assert hits[0]["id"] == best, (query, hits)
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    assert {h["id"] for h in index.search("light", 5)} == {"plants", "sun"}  # only the documents with the term
    assert index.search("zebra the of", 5) == []  # no shared term: no hit, not six zero scores
    assert len(index.search("earth ocean sun star", 100)) == 2  # k beyond the collection is fine
    batch = index.search_batch(["rome", "volcano", "nothing here"], 1)
    assert [[h["id"] for h in hits] for hits in batch] == [["rome"], ["volcano"], []]


def test_a_title_ranks_its_own_page_above_pages_that_mention_the_name():
    docs = [Document("mentee", "Ada Fenn lives in Rome. Her mentor is Orla Venn.", "Ada Fenn"),
            Document("orla", "Orla Venn lives in Kestrel Bay and works at Quillfen today.", "Orla Venn")]
    assert [h["id"] for h in BM25Index(docs).search("Orla Venn", 2)] == ["orla", "mentee"]
    untitled = [Document(d.id, d.text) for d in docs]  # the shorter page wins on text alone
    assert [h["id"] for h in BM25Index(untitled).search("Orla Venn", 2)] == ["mentee", "orla"]


def test_documents_load_from_jsonl_and_a_bad_row_names_its_line(tmp_path):
    good = tmp_path / "docs.jsonl"
    good.write_text('{"id": "a", "text": "alpha", "url": "x"}\n\n{"id": "b", "text": "beta", "title": "B"}\n')
    assert load_documents(good) == [Document("a", "alpha"), Document("b", "beta", "B")]
    for lines, fragment in [(['{"id": "a", "text": "x"}', '{"id": "b"}'], "line 2: 'text' must be a string"),
                            (['{"id": 1, "text": "x"}'], "line 1: 'id' must be a string"),
                            (['{"id": "a", "text": "x", "title": 3}'], "line 1: 'title' must be a string"),
                            (['{"id": "a", "text": "x"}', '{"id": "a", "text": "y"}'], "line 2: id 'a' was already"),
                            (['{"id": "a", "text": "x"}', "{oops"], "line 2: invalid JSON")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text("\n".join(lines) + "\n")
        with pytest.raises(JsonlError, match=re.escape(fragment)):
            load_documents(bad)
    with pytest.raises(ValueError, match="at least one document"):
        BM25Index([])


def test_64_concurrent_requests_are_batched_and_each_gets_its_own_answer():
    docs = [Document(f"d{i}", f"entry {i}: keyword{i} " + " ".join(f"filler{j}" for j in range(i % 7)))
            for i in range(64)]

    async def main():
        async with serving(docs) as service, RetrievalClient(service.base_url) as client:
            answers = await asyncio.gather(*(client.search(f"keyword{i}", 3) for i in range(64)))
            return answers, dict(service.counts)

    answers, counts = asyncio.run(main())
    assert [hits[0]["id"] for hits in answers] == [f"d{i}" for i in range(64)]
    assert all(len(hits) == 1 for hits in answers)  # one document holds each keyword
    assert counts["requests"] == counts["queries"] == 64
    assert counts["batches"] < 64  # queries that arrived together were scored together


def test_latency_is_added_to_each_request_without_blocking_the_others():
    async def main():
        async with serving(latency_s=0.3) as service, RetrievalClient(service.base_url) as client:
            start = time.perf_counter()
            one = await client.search("volcano", 1)
            alone = time.perf_counter() - start
            start = time.perf_counter()
            many = await asyncio.gather(*(client.search("rome", 1) for _ in range(16)))
            return one, alone, many, time.perf_counter() - start

    one, alone, many, together = asyncio.run(main())
    assert one[0]["id"] == "volcano" and all(hits[0]["id"] == "rome" for hits in many)
    assert alone >= 0.3
    # Relative to the lone request just measured (its wait and its overhead, on this machine's
    # load now): 16 requests that overlapped their waits take about one; in turn, 16 of them.
    assert together < 4 * alone


def test_a_search_slower_than_the_timeout_fails_as_a_message_after_the_retries():
    async def main():
        async with serving(latency_s=2.0) as service:
            async with RetrievalClient(service.base_url, timeout_s=0.15, retries=2, backoff_s=0.01) as client:
                start = time.perf_counter()
                message = await client.search_tool_message("volcano")
                elapsed = time.perf_counter() - start
                with pytest.raises(RetrievalError, match="within 0.15 s"):
                    await client.search("volcano")
            return message, elapsed, service.counts["requests"]

    message, elapsed, requests = asyncio.run(main())
    assert message.startswith("search failed: no answer from ") and message.endswith("within 0.15 s (3 attempts)")
    assert 3 * 0.15 <= elapsed < 2.0  # under the service's 2 s latency: no reply was waited for
    assert requests == 3 + 3  # each call tried three times


def test_a_stopped_service_is_a_failure_message_not_an_exception():
    async def main():
        async with serving() as service:
            url = service.base_url
        async with RetrievalClient(url, timeout_s=1.0, retries=1, backoff_s=0.01) as client:
            return await client.search_tool_message("volcano")

    message = asyncio.run(main())
    assert message.startswith("search failed: cannot reach http://127.0.0.1:") and message.endswith("(2 attempts)")


def test_a_5xx_is_retried_and_a_400_is_not():
    calls = {"n": 0}

    async def flaky(request: web.Request) -> web.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if calls["n"] == 2:
            return web.Response(text="<html>proxy error</html>", status=502)
        return web.json_response({"results": [{"id": "x", "score": 1, "text": "found"}]})

    async def main():
        app = web.Application()
        app.router.add_post("/search", flaky)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            async with RetrievalClient(url, retries=2, backoff_s=0.01) as client:
                retried = await client.search_tool_message("anything")
            async with serving() as service, RetrievalClient(service.base_url, retries=3) as client:
                refused = await client.search_tool_message("volcano", k=0)
                return retried, refused, service.counts["requests"]
        finally:
            await runner.cleanup()

    retried, refused, requests = asyncio.run(main())
    assert retried == "[1] x: found" and calls["n"] == 3
    assert refused == "search failed: the request was refused: k: Input should be greater than or equal to 1 (got 0)"
    assert requests == 1


def test_bad_requests_are_400_with_an_error_body_and_the_service_goes_on():
    cases = [("not json", "the body is not JSON", None), ("[1]", "must be a JSON object, got list", None),
             ('{"k": 3}', "query: Field required", "query"), ('{"query": "  "}', "query: must not be blank", "query"),
             ('{"query": 5}', "query: Input should be a valid string", "query"),
             ('{"query": "x", "k": 0}', "k: Input should be greater than or equal to 1", "k"),
             ('{"query": "x", "k": 101}', "k: Input should be less than or equal to 100", "k"),
             ('{"query": "x", "k": "5"}', "k: Input should be a valid integer", "k"),
             ('{"query": "x", "k": true}', "k: Input should be a valid integer", "k"),
             ('{"query": "x", "top_k": 3}', "top_k: Extra inputs are not permitted", "top_k")]

    async def main():
        async with serving() as service, aiohttp.ClientSession() as session:
            got = []
            for body, _, _ in cases:
                async with session.post(f"{service.base_url}/search", data=body) as r:
                    got.append((r.status, await r.json()))
            async with session.post(f"{service.base_url}/search", json={"query": "volcano"}) as r:
                after = (r.status, await r.json())
            async with session.get(f"{service.base_url}/health") as r:
                health = (r.status, await r.json())
            return got, after, health

    got, after, health = asyncio.run(main())
    for (status, body), (sent, fragment, param) in zip(got, cases, strict=True):
        assert status == 400 and body["error"]["code"] == 400, sent
        assert fragment in body["error"]["message"] and body["error"]["param"] == param, (sent, body)
    assert after[0] == 200 and after[1]["results"][0]["id"] == "volcano"
    assert after[1]["results"][0].keys() == {"id", "score", "text"}
    assert health == (200, {"status": "ok", "documents": 6, "requests": 11, "refused": 10, "queries": 1,
                            "batches": 1})


def test_tool_messages_are_one_line_per_hit():
    hits = [{"id": "a", "score": 2.0, "text": "first\nline  and more"}, {"id": "b", "score": 1.0, "text": "x" * 50}]
    assert format_hits(hits, max_chars=10) == "[1] a: first lin…\n[2] b: xxxxxxxxx…"
    assert format_hits([]) == "no results"


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no URL within {timeout_s} s"
    return proc.stdout.readline().strip()


def test_the_service_runs_as_its_own_process_and_stops_on_sigterm(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in DOCS))
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.tools.retrieval", "--docs", str(docs), "--port", "0",
                             "--latency-s", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _first_line(proc, 60)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url

        async def ask():
            async with RetrievalClient(url) as client:
                return await client.search_tool_message("magma and lava", 2)

        assert asyncio.run(ask()).startswith("[1] volcano: A volcano erupts")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "stopped after 1 requests" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n')
    done = subprocess.run([sys.executable, "-m", "asyncrl.tools.retrieval", "--docs", str(bad)],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "line 1: 'text' must be a string" in done.stderr and done.stdout == ""


def test_lognormal_latency_has_the_stated_median_and_p99():
    """σ by hand: ln(8 / 1) / 2.3263 = 2.0794 / 2.3263 = 0.8939; the draws' quantiles match.
    Bounds: over n = 20,000 draws the sample median's s.e. is 1.2533·σ/√n ≈ 0.8 % and the p99's
    σ·√(0.99·0.01/n)/φ(2.326) ≈ 2.4 % (log scale), so 5 % and 15 % are ~6 s.e.; the draws are
    seeded Python `random` (no torch kernels), the same on every CPU."""
    from asyncrl.tools.retrieval.service import Latency, lognormal_sigma

    assert lognormal_sigma(1.0, 8.0) == pytest.approx(0.8939, abs=1e-4)
    assert lognormal_sigma(0.5, 0.5) == 0.0
    with pytest.raises(ValueError, match="median 2.0 <= p99 1.0"):
        lognormal_sigma(2.0, 1.0)
    latency = Latency(1.0, 8.0, seed=3)
    draws = sorted(latency.sample() for _ in range(20_000))
    assert draws[10_000] == pytest.approx(1.0, rel=0.05)
    assert draws[19_800] == pytest.approx(8.0, rel=0.15)
    again = Latency(1.0, 8.0, seed=3)
    assert [again.sample() for _ in range(3)] == draws_in_order(Latency(1.0, 8.0, seed=3), 3)  # seeded


def draws_in_order(latency, n: int) -> list[float]:
    return [latency.sample() for _ in range(n)]


def test_the_service_sleeps_each_request_its_drawn_latency():
    class Fixed:
        def __init__(self):
            self.calls = 0

        def sample(self) -> float:
            self.calls += 1
            return 0.2

    async def main():
        fixed = Fixed()
        async with serving(latency=fixed) as service, RetrievalClient(service.base_url) as client:
            started = time.perf_counter()
            await client.search("alpha", 1)
            elapsed = time.perf_counter() - started
        return fixed.calls, elapsed

    calls, elapsed = asyncio.run(main())
    assert calls == 1 and elapsed >= 0.2
