"""The research task (asyncrl/tasks/research.py): a seeded natural-language world, held-out
entities, BrowseComp-Plus-shaped files through the one loader."""

from __future__ import annotations

import json

import pytest

from asyncrl.tasks import default_reward_fn, load_tasks
from asyncrl.tasks.base import TaskDataError
from asyncrl.tasks.research import build_world, load_research, write_research


def test_the_world_and_its_files_are_determined_by_the_seed(tmp_path):
    a, b = write_research(tmp_path / "a", seed=3, num_train=100, num_heldout=30), \
        write_research(tmp_path / "b", seed=3, num_train=100, num_heldout=30)
    c = write_research(tmp_path / "c", seed=4, num_train=100, num_heldout=30)
    for name in ("corpus", "train", "heldout"):
        assert a[name].read_bytes() == b[name].read_bytes()
    assert a["corpus"].read_bytes() != c["corpus"].read_bytes()


def test_each_question_follows_the_world_chain_and_its_documents_say_so(tmp_path):
    world = build_world(0)
    paths = write_research(tmp_path, num_train=200, num_heldout=40)
    corpus = {row["id"]: row for row in map(json.loads, paths["corpus"].read_text().splitlines())}
    for task in load_research(paths["train"]):
        chain = task.data["gold_doc_ids"]
        assert 1 <= task.data["hops"] == len(chain) <= 3
        for entity, nxt in zip(chain, [*chain[1:], task.data["answer"]]):
            assert world.container[entity] == nxt and nxt in corpus[entity]["text"]  # one fact per hop, stated
        assert task.data["answer_doc_ids"] == chain[-1:]
        assert not set(task.data["negative_doc_ids"]) & set(chain)
    hops = {t.data["hops"] for t in load_research(paths["train"])}
    assert hops == {1, 2, 3}


def test_held_out_questions_are_over_entities_no_train_question_names(tmp_path):
    paths = write_research(tmp_path, num_train=400, num_heldout=60)
    world = build_world(0)

    def named(task):  # subject and intermediates; the answer too unless it is a region (shared by design)
        chain = task.data["gold_doc_ids"]
        answer = task.data["answer"]
        return set(chain) | ({answer} if answer not in world.entities["region"] else set())

    train = set().union(*map(named, load_research(paths["train"])))
    held = set().union(*map(named, load_research(paths["heldout"])))
    assert held and train and not train & held
    assert held <= world.heldout and not train & world.heldout


def test_a_browsecomp_plus_shaped_file_round_trips_through_the_loader(tmp_path):
    rows = [{"query_id": "q1", "query": "Who founded the firm?", "answer": "Ada Lovelace",
             "evidence_docs": [{"docid": "d1", "text": "…", "url": "http://x"}, {"docid": 7, "text": "…"}],
             "gold_docs": [{"docid": "d1", "text": "…"}], "negative_docs": [{"docid": "d9", "text": "…"}]},
            {"query_id": "q2", "query": "What is long?", "answer": "a b c d e f g h i j k"}]  # no short answer
    path = tmp_path / "bcp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = load_research(path)
    assert [(t.id, t.prompt) for t in tasks] == [("q1", "Who founded the firm?")]
    assert tasks[0].data == {"answer": "Ada Lovelace", "gold_doc_ids": ["d1", "7"], "answer_doc_ids": ["d1"],
                             "negative_doc_ids": ["d9"]}
    splits = load_tasks("research", path=path, validation_path=path, seed=0, num_train=0, num_validation=1)
    assert [t.id for t in splits.train] == ["q1"]
    assert default_reward_fn("research")(tasks[0], "Answer: ada lovelace") == 1
    with pytest.raises(ValueError, match="validation_path"):
        load_tasks("research", path=path, seed=0, num_train=0, num_validation=1)
    path.write_text(json.dumps({"query_id": "q1", "query": "x", "answer": "y", "evidence_docs": [{"text": "no id"}]}))
    with pytest.raises(TaskDataError, match="line 1: each of 'evidence_docs' must be a document with a 'docid'"):
        load_research(path)


def test_train_hops_keeps_those_hop_counts_in_training_and_every_query_held_out(tmp_path):
    rows = [{"query_id": f"q{i}", "query": f"Question {i}?", "answer": "Korlwick", "hops": h}
            for i, h in enumerate([1, 2, 3, 1, 3])] + [{"query_id": "q9", "query": "No hops?", "answer": "Vessa"}]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = load_tasks("research", path=path, validation_path=path, seed=0, num_train=0, num_validation=0,
                        options={"train_hops": [2, 3]})
    assert [t.id for t in splits.train] == ["q1", "q2", "q4"]
    assert [t.id for t in splits.validation] == ["q0", "q1", "q2", "q3", "q4", "q9"]
    with pytest.raises(TaskDataError, match=r"no query has a hop count in task.options.train_hops=\[4\]"):
        load_tasks("research", path=path, validation_path=path, seed=0, num_train=0, num_validation=0,
                   options={"train_hops": [4]})
    with pytest.raises(ValueError, match="non-empty list of hop counts"):
        load_tasks("research", path=path, validation_path=path, seed=0, num_train=0, num_validation=0,
                   options={"train_hops": 2})
    with pytest.raises(ValueError, match=r"one option, `train_hops`.*\['max_hops'\]"):
        load_tasks("research", path=path, validation_path=path, seed=0, num_train=0, num_validation=0,
                   options={"max_hops": 2})


def test_the_deepresearch_agent_refines_results_and_notes_a_repeated_search(monkeypatch):
    """The example's tool, against a real BM25 service over its shipped corpus and a stub refine model."""
    import asyncio
    import sys
    from pathlib import Path

    from aiohttp import web
    from test_frozen_models import chat_reply, fake_server

    from asyncrl.plugins import load_named
    from asyncrl.tools.retrieval import BM25Index, RetrievalClient, RetrievalService, load_documents

    example = Path(__file__).parents[1] / "examples" / "deepresearch"
    agent = sys.modules[load_named(f"{example / 'agent.py'}:run", key="test").__module__]
    docs = load_documents(example / "data" / "corpus.jsonl")
    person = next(d for d in docs if " works at " in d.text)
    asked = []

    async def refine(request: web.Request) -> web.Response:
        asked.append((await request.json())["messages"][-1]["content"])
        return chat_reply("condensed")

    async def main():
        service = RetrievalService(BM25Index(docs))
        await service.start()
        try:
            async with fake_server(refine) as url, RetrievalClient(service.base_url) as client:
                monkeypatch.setenv("ASYNCRL_REFINE_URL", url)
                monkeypatch.setenv("ASYNCRL_REFINE_MODEL", "m")
                guard = agent.DuplicateGuard()
                query = json.dumps({"query": person.id})
                first = await agent.search(client, guard, "Q?", query)
                second = await agent.search(client, guard, "Q?", query)
                await agent.refiner().model.close()
                return first, second, guard.duplicates
        finally:
            await service.stop()

    first, second, duplicates = asyncio.run(main())
    assert first == "condensed" and person.text in asked[0] and "Question: Q?" in asked[0]
    assert second.startswith("duplicate search:") and duplicates == 1 and len(asked) == 1


def test_deepresearch_traces_answer_after_the_last_call_note_as_the_agent_asks(tmp_path):
    """make_traces.py writes conversations as the agent holds them: none searches more than
    ``MAX_TURNS - 1`` times, and those that search that often read ``LAST_CALL`` before answering."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[1] / "examples" / "deepresearch"
    subprocess.run([sys.executable, str(example / "make_traces.py"), "--out", str(tmp_path), "--repeat", "0.5"],
                   check=True, capture_output=True)
    from asyncrl.plugins import load_named
    agent = sys.modules[load_named(f"{example / 'agent.py'}:run", key="test").__module__]
    last = agent.plain.MAX_TURNS - 1
    counts = set()
    for line in (tmp_path / "sft_train.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        searches = sum(m["role"] == "tool" for m in messages)
        told = [m for m in messages[1:] if m["role"] == "user"]
        counts.add(searches)
        assert searches <= last and messages[-1]["content"].startswith("Answer: ")
        assert told == ([{"role": "user", "content": agent.LAST_CALL}] if searches == last else [])
        assert not told or messages[-2] == told[0]
    assert counts == {1, 2, 3}


def test_the_deepresearch_reward_takes_off_duplicates_and_an_unanswered_ending():
    """By hand: right 1, wrong 0, no answer (a tool call, a paragraph) 0 less the unanswered
    penalty; each duplicate search costs its penalty in every case."""
    import sys
    from pathlib import Path

    from asyncrl.plugins import load_named
    from asyncrl.tasks.base import Task

    example = Path(__file__).parents[1] / "examples" / "deepresearch"
    agent = sys.modules[load_named(f"{example / 'agent.py'}:run", key="test").__module__]
    task = Task(id="q", prompt="Who?", data={"answer": "Ada Brook"})
    reward = agent.episode_reward
    assert reward(task, "Answer: Ada Brook", 0, 0.25, 0.5) == 1.0
    assert reward(task, "Answer: Ada Brook", 2, 0.25, 0.5) == 0.5
    assert reward(task, "Answer: Tom Reed", 1, 0.25, 0.5) == -0.25
    assert reward(task, '<tool_call>{"name": "search"}</tool_call>', 0, 0.25, 0.5) == -0.5
    assert reward(task, "Ada Brook", 0, 0.25, 0.5) == 1.0  # one line: the answer, as the reward reads it
    assert reward(task, "I am not sure.\nI would search more.", 1, 0.25, 0.5) == -0.75
    assert reward(task, "I am not sure.\nI would search more.", 1) == 0.0  # both penalties default to 0
