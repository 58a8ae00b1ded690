"""examples/search_agent: the multi-hop search agent, written against the OpenAI SDK, trains
through ``workflow.name: openai_agent`` against a retrieval service, over several turns."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("openai")
pytest.importorskip("bm25s")

from asyncrl.cli import main
from asyncrl.tasks.base import Task
from asyncrl.tasks.multihop import multihop_corpus, multihop_reward, write_corpus
from asyncrl.tools.retrieval import RetrievalError

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("search_agent", REPO / "examples/search_agent/agent.py")
agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)

SMALL = ["total_steps=2", "sampling.max_tokens=48", "batch_size=2", "group_size=2", "eval.num_tasks=2",
         "eval.samples_per_task=1",
         "task.num_train=16", "task.num_validation=4", "algorithm.filter_zero_variance=false",
         "task.options={num_people: 50}"]


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def retrieval_service(tmp_path, monkeypatch):
    """The test's own service on a free port, over the corpus of the config's task options,
    named to the agent by ``ASYNCRL_RETRIEVAL_URL`` and stopped whatever happens."""
    docs = tmp_path / "corpus.jsonl"
    write_corpus(docs, multihop_corpus(num_people=50))
    process = subprocess.Popen([sys.executable, "-m", "asyncrl.tools.retrieval", "--docs", str(docs), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://"), f"the service printed {url!r} (exit {process.poll()})"
        monkeypatch.setenv("ASYNCRL_RETRIEVAL_URL", url)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.slow
def test_the_search_agent_trains_over_several_turns(tmp_path, policy_dir, retrieval_service):
    out = tmp_path / "search"
    assert main(["train", "examples/search_agent/async.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 *SMALL]) == 0
    samples = rows(out / "samples.jsonl")
    assert len(samples) == 2 * 2 * 2  # steps × groups × samples: one trajectory per episode
    for s in samples:
        roles = [seg["role"] for seg in s["response_segments"]]
        # the model's turns alternate with the environment's (nudges, tool results: mask 0)
        assert roles[0] == roles[-1] == "model" and set(roles) == {"model", "environment"}
        assert all(a != b for a, b in itertools.pairwise(roles)), roles
        assert roles.count("environment") >= 2, roles
        assert s["trained_version"] - s["behavior_version_min"] <= 2  # max_staleness in async.yaml
    metrics = rows(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]


class _ScriptedModel:
    """Stands in for the SDK client: replies from a script, records what it was sent."""

    def __init__(self, replies):
        self.replies, self.sent, self.extra_bodies = list(replies), [], []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, *, messages, extra_body=None, **_):
        self.sent.append([dict(m) for m in messages])
        self.extra_bodies.append(extra_body)
        content, calls = self.replies.pop(0)
        tool_calls = [SimpleNamespace(id=f"call-{i}", function=SimpleNamespace(name=name, arguments=args))
                      for i, (name, args) in enumerate(calls)] or None
        message = SimpleNamespace(content=content, tool_calls=tool_calls,
                                  model_dump=lambda **_: {"role": "assistant", "content": content})
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


class _FakeRetrieval:
    """Stands in for ``RetrievalClient``: ``search(query, k)`` returns hits, or raises."""

    def __init__(self, hits=(), error=None):
        self.hits, self.error, self.queries = list(hits), error, []

    async def search(self, query, k):
        self.queries.append((query, k))
        if self.error is not None:
            raise RetrievalError(self.error)
        return [dict(hit) for hit in self.hits[:k]]


HITS = [{"id": "c7m", "score": 2.5, "text": "c7m is in t2x."},
        {"id": "p3k", "score": 1.2, "text": "p3k is in c7m."},
        {"id": "x", "score": 0.4, "text": "a  long\nhit " + "y" * 60}]


def _run(replies, answer="t2x", **retrieval):
    model, fake = _ScriptedModel(replies), _FakeRetrieval(**retrieval)
    task = Task(id="t", prompt="Which town is c7m in?", data={"answer": answer})
    return multihop_reward(task, asyncio.run(agent.converse(model, fake, task))), model, fake


def test_a_reply_without_a_call_or_an_answer_is_nudged_each_turn_until_the_limit():
    reward, model, _ = _run([("hmm\nlet me think", [])] * agent.MAX_TURNS)
    assert len(model.sent) == agent.MAX_TURNS and reward == 0.0  # two lines, no Answer: not an answer
    last = model.sent[-1]
    assert [m["role"] for m in last] == ["user"] + ["assistant", "user"] * (agent.MAX_TURNS - 1)
    assert all(m["content"] == agent.NUDGE for m in last[2::2])


def test_a_search_then_an_answer_ends_the_episode_with_its_reward(monkeypatch):
    monkeypatch.delenv("ASYNCRL_SEARCH_OFF", raising=False)
    replies = [("", [("search", '{"query": "c7m"}')]), ("Answer: t2x", []), ("never asked", [])]
    reward, model, retrieval = _run(replies, hits=HITS)
    assert reward == 1.0 and len(model.sent) == 2
    assert retrieval.queries == [("c7m", agent.SEARCH_K)]
    tool = model.sent[1][-1]
    assert tool["role"] == "tool" and tool["tool_call_id"] == "call-0"
    # the hits' texts, best first, one per line, each on one line and cut at MAX_HIT_CHARS
    assert tool["content"] == "c7m is in t2x.\np3k is in c7m.\n" + ("a long hit " + "y" * 60)[: agent.MAX_HIT_CHARS]
    assert [len(line) for line in tool["content"].split("\n")] == [14, 14, agent.MAX_HIT_CHARS]


@pytest.mark.parametrize("retrieval, off, expected", [
    ({"hits": []}, None, "no results"),
    ({"hits": HITS}, "1", "no results"),  # ASYNCRL_SEARCH_OFF=1: the tool finds nothing, unasked
    ({"error": "cannot reach the service"}, None, "search failed: cannot reach the service"),
])
def test_empty_switched_off_and_failed_searches_are_results_for_the_model(monkeypatch, retrieval, off, expected):
    if off is None:
        monkeypatch.delenv("ASYNCRL_SEARCH_OFF", raising=False)
    else:
        monkeypatch.setenv("ASYNCRL_SEARCH_OFF", off)
    replies = [("", [("search", '{"query": "c7m"}')]), ("Answer: t2x", [])]
    reward, model, fake = _run(replies, **retrieval)
    assert reward == 1.0 and model.sent[1][-1]["content"] == expected
    assert fake.queries == ([] if off else [("c7m", agent.SEARCH_K)])


def test_bad_tool_arguments_and_unknown_tools_are_results_for_the_model():
    replies = [("", [("search", "not json"), ("search", '{"query": "  "}'), ("lookup", "{}")]), ("Answer: t9q", [])]
    reward, model, retrieval = _run(replies, hits=HITS)
    assert reward == 0.0 and retrieval.queries == []  # well-formed but wrong: no format bonus
    assert [m["content"] for m in model.sent[1][-3:]] == ["search needs a query", "search needs a query",
                                                          "unknown tool: lookup"]


def test_last_call_asks_for_the_answer_before_the_last_model_call():
    """``converse_with_tools(last_call=...)`` (the DeepResearch agent's "no searches left"): after
    ``MAX_TURNS - 1`` searches the last call reads that note after the tool result; a nudge is
    replaced by it; without ``last_call`` the conversation is as before."""
    task = Task(id="t", prompt="Which town is c7m in?", data={"answer": "t2x"})
    search = ("", [("search", '{"query": "c7m"}')])

    async def run_tool(call):
        return "c7m is in t2x."

    def converse(replies, **kwargs):
        model = _ScriptedModel(replies)
        final = asyncio.run(agent.converse_with_tools(model, task, agent.TOOLS, run_tool, **kwargs))
        return final, model.sent

    final, sent = converse([search] * (agent.MAX_TURNS - 1) + [("Answer: t2x", [])], last_call="answer now")
    assert final == "Answer: t2x" and len(sent) == agent.MAX_TURNS
    assert [m["role"] for m in sent[-1][-2:]] == ["tool", "user"] and sent[-1][-1]["content"] == "answer now"
    assert all(m["content"] != "answer now" for call in sent[:-1] for m in call)  # only the last call reads it

    _, sent = converse([search] * (agent.MAX_TURNS - 2) + [("hmm", []), ("Answer: t2x", [])], last_call="answer now")
    assert [m["content"] for m in sent[-1][-2:]] == ["hmm", "answer now"]  # in place of the nudge

    _, sent = converse([search] * agent.MAX_TURNS)
    assert sent[-1][-1]["role"] == "tool"  # no last_call: nothing added


def test_the_answer_prefill_makes_the_last_reply_continue_answer():
    """``answer_prefill``: the last call ends on the assistant's "Answer:", sent as vLLM's
    ``continue_final_message``; the reply returned is the prefill and the continuation, and
    no earlier call carries it."""
    task = Task(id="t", prompt="Which town is c7m in?", data={"answer": "t2x"})
    model = _ScriptedModel([("", [("search", '{"query": "c7m"}')])] * (agent.MAX_TURNS - 1) + [(" t2x", [])])

    async def run_tool(call):
        return "c7m is in t2x."

    final = asyncio.run(agent.converse_with_tools(model, task, agent.TOOLS, run_tool, last_call="answer now",
                                                  answer_prefill="Answer:"))
    assert final == "Answer: t2x" and multihop_reward(task, final) == 1.0
    assert model.sent[-1][-2:] == [{"role": "user", "content": "answer now"},
                                   {"role": "assistant", "content": "Answer:"}]
    assert model.extra_bodies == [None] * (agent.MAX_TURNS - 1) + [
        {"continue_final_message": True, "add_generation_prompt": False}]
