"""The search-agent warm-up's traces mean what the real agent and gateway will see, and the
shipped ``models/search-tiny`` is loadable and says how it was made."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path

import pytest

pytest.importorskip("bm25s")

from asyncrl.gateway.tool_calls import hermes
from asyncrl.plugins import load_named
from asyncrl.tasks import load_tasks
from asyncrl.tasks.multihop import extract_answer, multihop_corpus
from asyncrl.tiny import build_char_tokenizer
from asyncrl.tiny.search_sft import (
    IGNORE_INDEX,
    SearchTool,
    corpus_index,
    ideal_trace,
    search_examples,
    trace_example,
    world_examples,
)
from asyncrl.tools.retrieval import RetrievalClient, RetrievalService

ROOT = Path(__file__).resolve().parents[1]
AGENT = str(ROOT / "examples/search_agent/agent.py")
MODEL = ROOT / "models/search-tiny"
MAX_LEN = 768


@pytest.fixture(scope="module")
def setup():
    tool = SearchTool.from_agent(AGENT)
    tasks = load_tasks("multihop", seed=0, num_train=60, num_validation=1).train
    return tool, corpus_index(), build_char_tokenizer(), tasks


def _traces(setup):
    tool, index, _, tasks = setup
    return [(task, m) for task in tasks if (m := ideal_trace(task, index, tool)) is not None]


def test_assistant_turns_parse_back_as_the_intended_calls_and_answer(setup):
    traces = _traces(setup)
    assert {t.data["hops"] for t, _ in traces} == {1, 2}
    for task, messages in traces:
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(replies) == task.data["hops"] + 1
        for hop, reply in enumerate(replies[:-1]):
            parsed = hermes(reply)
            assert parsed.error is None and parsed.content is None
            (call,) = parsed.tool_calls
            assert call.name == "search"
            assert json.loads(call.arguments) == {"query": task.data["entities"][hop]}
        final = hermes(replies[-1])
        assert not final.tool_calls and extract_answer(final.content) == task.data["answer"]


def test_tool_results_equal_what_the_agent_returns_through_a_real_service(setup):
    tool, index, _, _ = setup
    agent = inspect.getmodule(load_named(f"{AGENT}:run", key="agent"))
    queries = ["Orla Venn", "Kestrel Bay", "nobody here"] + [t.data["entities"][0] for t in setup[3][:10]]

    async def through_service() -> list[str]:
        service = RetrievalService(index)
        url = await service.start()
        try:
            async with RetrievalClient(url) as client:
                return [await agent.search(client, json.dumps({"query": q})) for q in queries]
        finally:
            await service.stop()

    assert asyncio.run(through_service()) == [tool.result(index, q) for q in queries]
    for task, messages in _traces(setup):  # and each trace's tool turns hold exactly that
        results = [m["content"] for m in messages if m["role"] == "tool"]
        assert results == [tool.result(index, e) for e in task.data["entities"][: task.data["hops"]]]


def test_loss_mask_covers_exactly_the_assistant_turns_and_traces_fit(setup):
    tool, _, tokenizer, _ = setup
    eos = tokenizer.eos_token_id
    for task, messages in _traces(setup):
        full = tokenizer.apply_chat_template(messages, tools=tool.tools, tokenize=False)
        full_ids = tokenizer.encode(full, add_special_tokens=False)
        ids, labels = trace_example(tokenizer, messages, tool.tools, max_len=10_000)
        # turn-by-turn build == the gateway's rendering, less the template's "\n" after the last turn
        assert ids == full_ids[:-1] and tokenizer.decode(full_ids[-1:]) == "\n"
        # labelled runs, in order, are each assistant content + the end-of-turn token
        runs, run = [], []
        for i, label in zip(ids, labels, strict=True):
            if label == IGNORE_INDEX:
                if run:
                    runs.append(run)
                run = []
            else:
                assert label == i
                run.append(i)
        runs += [run] if run else []
        expected = [tokenizer.encode(m["content"], add_special_tokens=False) + [eos]
                    for m in messages if m["role"] == "assistant"]
        assert runs == expected
        cut_ids, cut_labels = trace_example(tokenizer, messages, tool.tools, max_len=MAX_LEN)
        assert len(cut_ids) == len(cut_labels) <= MAX_LEN and cut_ids == full_ids[:-1][:MAX_LEN]
        assert len(full_ids) < MAX_LEN  # a two-hop episode fits whole, answer included


def test_search_examples_count_and_label_something(setup):
    tool, index, tokenizer, tasks = setup
    examples, counts = search_examples(tokenizer, tasks, index, tool, MAX_LEN)
    assert counts["examples"] == len(examples) == counts["tasks"] - counts["unanswerable"] > 0
    assert all(len(ids) <= MAX_LEN and any(x != IGNORE_INDEX for x in labels) for ids, labels in examples)


def test_the_warm_up_traces_variants_of_the_examples_world_with_its_names_and_other_facts(setup):
    """Familiar names, facts that cannot be remembered: the answer must be read off the result."""
    tool, _, tokenizer, _ = setup
    examples, counts = world_examples(tokenizer, tool, worlds=3, own_share=0.25, num_train=40, seed=0,
                                      max_len=MAX_LEN)
    assert counts["variants"] == 3 and counts["own_world_traces"] == 10 and counts["tasks"] == 40
    assert counts["examples"] == len(examples) and counts["cut_to_context"] == 0
    assert counts["unanswerable"] <= 2  # titles rank the subject's page first
    own = multihop_corpus()
    variant = multihop_corpus(facts_seed=1)
    assert [d["title"] for d in variant] == [d["title"] for d in own]  # the same names...
    assert sum(a["text"] != b["text"] for a, b in zip(own, variant, strict=True)) > 0.9 * len(own)  # ...other facts
    assert multihop_corpus(facts_seed=1) == variant and multihop_corpus(facts_seed=2) != variant


def test_shipped_model_loads_and_records_how_it_was_made():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = json.loads((MODEL / "base_policy.json").read_text())
    assert record["command"].startswith("python -m asyncrl.tiny.search_sft ")
    assert {"steps", "held_out", "machine", "made_at"} <= record.keys()
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    assert model.config.max_position_embeddings == MAX_LEN == record["model"]["max_position_embeddings"]
    assert tokenizer.chat_template and tokenizer.eos_token_id == model.config.eos_token_id
    assert sum(f.stat().st_size for f in MODEL.iterdir()) < 8 * 2**20
