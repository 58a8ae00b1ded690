"""The search-agent warm-up's traces mean what the real agent and gateway will see, its
noise is what it says, it never reads the example's world, and the shipped
``models/search-tiny`` is loadable and says how it was made."""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import re
from collections import Counter
from itertools import islice, pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("bm25s")

import torch

from asyncrl.rollout.gateway.tool_calls import hermes
from asyncrl.plugins import load_named
from asyncrl.tasks import load_tasks
from asyncrl.tasks.multihop import extract_answer, fact_text, iter_multihop, multihop_corpus, multihop_reward
from asyncrl.tiny import build_char_tokenizer, search_sft
from asyncrl.tiny.search_sft import (
    DEFAULT_MODEL,
    IGNORE_INDEX,
    Noise,
    SearchTool,
    corpus_index,
    noisy_trace,
    trace_example,
    turn_probe,
    world_examples,
)
from asyncrl.tools.retrieval import RetrievalClient, RetrievalService

ROOT = Path(__file__).resolve().parents[1]
AGENT = str(ROOT / "examples/search_agent/agent.py")
MODEL = ROOT / "models/search-tiny"
MAX_LEN = 512  # the shipped policy's context, which a whole episode must fit
IDEAL = Noise(0, 0, 0)
_ID = re.compile(r"[PCTR][0-9B-VX-Z]{2}")


@pytest.fixture(scope="module")
def tool():
    return SearchTool.from_agent(AGENT)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def index():
    return corpus_index()


@pytest.fixture(scope="module")
def tasks():
    tasks = load_tasks("multihop", seed=0, num_train=60, num_validation=1).train
    assert {t.data["hops"] for t in tasks} == {1, 2, 3}
    return tasks


def _ideal(task, index, tool):
    return noisy_trace(task, index, tool, IDEAL, random.Random(0))


def _assistant(messages):
    return [m["content"] for m in messages if m["role"] == "assistant"]


def _results(messages):
    return [m["content"] for m in messages if m["role"] == "tool"]


def _final(messages):
    answer = extract_answer(_assistant(messages)[-1])
    assert answer is not None, messages
    return answer


# ---- ideal traces are the agent's conversation ----------------------------------------

def test_assistant_turns_parse_back_as_the_intended_calls_and_answer(tasks, index, tool):
    for task in tasks:
        messages = _ideal(task, index, tool)
        hops = task.data["hops"]
        assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * hops + ["assistant"]
        assert messages[0]["content"] == task.prompt
        replies = _assistant(messages)
        for hop, reply in enumerate(replies[:-1]):
            parsed = hermes(reply)
            assert parsed.error is None and parsed.content is None
            (call,) = parsed.tool_calls
            assert call.name == "search"
            assert json.loads(call.arguments) == {"query": task.data["entities"][hop]}
        final = hermes(replies[-1])
        assert not final.tool_calls and extract_answer(final.content) == task.data["answer"]
        assert multihop_reward(task, replies[-1]) == 1.0
        # each result leads on: its best hit is the searched entity's own fact, naming the next hop
        for hop, result in enumerate(_results(messages)):
            entities = task.data["entities"]
            assert result.split("\n")[0] == fact_text(entities[hop], entities[hop + 1])


def test_tool_results_equal_what_the_agent_returns_through_a_real_service(tasks, index, tool, monkeypatch):
    monkeypatch.delenv("ASYNCRL_SEARCH_OFF", raising=False)
    agent = inspect.getmodule(load_named(f"{AGENT}:run", key="agent"))
    assert (tool.k, tool.tools, tool.format_result) == (agent.SEARCH_K, agent.TOOLS, agent.format_result)
    entities = sorted({e for t in tasks[:20] for e in t.data["entities"]})  # people, companies, towns, regions
    queries = ["nobody here", "zzz", *entities]

    async def through_service() -> list[str]:
        service = RetrievalService(index)
        url = await service.start()  # a free port
        try:
            async with RetrievalClient(url) as client:
                return [await agent.search(client, json.dumps({"query": q})) for q in queries]
        finally:
            await service.stop()

    got = asyncio.run(through_service())
    assert got == [tool.result(index, q) for q in queries]
    assert got[:2] == ["no results", "no results"]
    assert all(r != "no results" for r in got[2:])
    for task in tasks:  # and each trace's tool turns hold exactly that
        messages = _ideal(task, index, tool)
        assert _results(messages) == [tool.result(index, e) for e in task.data["entities"][: task.data["hops"]]]


def _labelled_runs(ids, labels):
    runs, run = [], []
    for i, label in zip(ids, labels, strict=True):
        if label == IGNORE_INDEX:
            if run:
                runs.append(run)
            run = []
        else:
            assert label == i
            run.append(i)
    return runs + ([run] if run else [])


def test_loss_mask_covers_exactly_the_assistant_turns_and_traces_fit(tasks, index, tool, tokenizer):
    eos = tokenizer.eos_token_id
    noisy = Noise(0.2, 0.3, 0.5)
    rng = random.Random(1)
    traces = [_ideal(t, index, tool) for t in tasks] + [noisy_trace(t, index, tool, noisy, rng) for t in tasks]
    longest = {}
    for messages in traces:
        full = tokenizer.apply_chat_template(messages, tools=tool.tools, tokenize=False)
        full_ids = tokenizer.encode(full, add_special_tokens=False)
        ids, labels = trace_example(tokenizer, messages, tool.tools, max_len=10_000)
        # turn-by-turn build == the gateway's rendering, less the template's "\n" after the last turn
        assert ids == full_ids[:-1] and tokenizer.decode(full_ids[-1:]) == "\n"
        # labelled runs, in order, are each assistant content + the end-of-turn token
        expected = [tokenizer.encode(c, add_special_tokens=False) + [eos] for c in _assistant(messages)]
        assert _labelled_runs(ids, labels) == expected
        hops = len(_results(messages))
        longest[hops] = max(longest.get(hops, 0), len(full_ids))
        cut_ids, cut_labels = trace_example(tokenizer, messages, tool.tools, max_len=50)
        assert cut_ids == ids[:50] and cut_labels == labels[:50]
    assert set(longest) == {0, 1, 2, 3} and longest[3] < MAX_LEN  # three searches and the answer fit whole
    # the worst case: three searches of k full hits each, and the longest question
    worst = [{"role": "user", "content": "Which company is p00 in?"}]
    for _ in range(3):
        worst += [{"role": "assistant", "content": search_sft.tool_call_text("c00")},
                  {"role": "tool", "content": tool.format_result(["c00 is in t00."] * tool.k)}]
    worst.append({"role": "assistant", "content": "Answer: r00"})
    assert len(trace_example(tokenizer, worst, tool.tools, max_len=10_000)[0]) < MAX_LEN
    assert DEFAULT_MODEL["max_position_embeddings"] == MAX_LEN


# ---- the teacher's noise ---------------------------------------------------------------

def test_noise_rates_are_validated():
    for bad in ({"skip": 1.0}, {"early": -0.1}, {"wrong": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Noise(**{"skip": 0, "early": 0, "wrong": 0, **bad})


def test_without_noise_every_trace_searches_each_hop_and_answers_right(tool, tokenizer):
    index = corpus_index({"corpus_seed": 4})
    rng = random.Random(0)
    for task in islice(iter_multihop(11, corpus_seed=4), 300):
        messages = noisy_trace(task, index, tool, IDEAL, rng)
        assert len(_results(messages)) == task.data["hops"] and _final(messages) == task.data["answer"]
    _, counts = world_examples(tokenizer, tool, IDEAL, worlds=2, num_train=60, seed=0, max_len=MAX_LEN)
    assert counts["traces"] == counts["right_answer"] == 60
    assert counts["skipped_search"] == counts["stopped_early"] == counts["wrong_answer"] == 0
    assert counts["cut_to_context"] == 0


NOISE = Noise(skip=0.2, early=0.3, wrong=0.5)
WORLDS, NUM_TRAIN = 3, 600


@pytest.fixture(scope="module")
def recorded(tool, tokenizer):
    """``world_examples`` run with its ``corpus_index`` and ``noisy_trace`` recorded: the
    options of each index built, and each (options, task, messages) traced."""
    built, traced = [], []
    real_index, real_trace = search_sft.corpus_index, search_sft.noisy_trace

    def recording_index(options=None):
        index = real_index(options)
        built.append((dict(options or {}), index))
        return index

    def recording_trace(task, index, tool_, noise, rng):
        messages = real_trace(task, index, tool_, noise, rng)
        options = next(o for o, i in built if i is index)
        traced.append((options, task, messages))
        return messages

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search_sft, "corpus_index", recording_index)
        mp.setattr(search_sft, "noisy_trace", recording_trace)
        examples, counts = world_examples(tokenizer, tool, NOISE, worlds=WORLDS, num_train=NUM_TRAIN, seed=0,
                                          max_len=MAX_LEN)
    return SimpleNamespace(examples=examples, counts=counts, built=built, traced=traced)


def _classify(task, messages):
    searches, answer = len(_results(messages)), _final(messages)
    if searches == 0:
        return "skipped_search"
    if searches < task.data["hops"]:
        return "stopped_early"
    return "right_answer" if answer == task.data["answer"] else "wrong_answer"


def test_world_examples_count_what_the_teacher_did(recorded, tool, tokenizer):
    counts, traced = recorded.counts, recorded.traced
    assert counts["traces"] == len(traced) == len(recorded.examples) == NUM_TRAIN
    kinds = Counter(_classify(task, messages) for _, task, messages in traced)
    right_anyway = sum(_classify(t, m) == "skipped_search" and _final(m) == t.data["answer"] for _, t, m in traced)
    assert {k: counts[k] for k in kinds} == {**kinds, "right_answer": kinds["right_answer"] + right_anyway}
    assert counts["cut_to_context"] == 0 and counts["max_len"] < MAX_LEN
    # the examples are those traces, rendered
    for example, (_, _, messages) in zip(recorded.examples, traced, strict=True):
        assert example == trace_example(tokenizer, messages, tool.tools, MAX_LEN)


def test_noise_rates_match_within_statistical_bounds(recorded):
    traced = recorded.traced
    n = len(traced)
    kinds = Counter(_classify(task, messages) for _, task, messages in traced)
    hops = [task.data["hops"] for _, task, _ in traced]
    # P(skip) = 0.2; P(early | searched) = 1 - 0.7 ** (hops - 1); P(wrong | every hop searched) = 0.5
    expected_early = sum((1 - NOISE.skip) * (1 - (1 - NOISE.early) ** (h - 1)) for h in hops)
    assert abs(kinds["skipped_search"] / n - NOISE.skip) < 0.06
    assert abs(kinds["stopped_early"] - expected_early) / n < 0.06
    full = kinds["wrong_answer"] + kinds["right_answer"]
    assert abs(kinds["wrong_answer"] / full - NOISE.wrong) < 0.1
    early_by_hops = Counter(task.data["hops"] for _, task, m in traced if _classify(task, m) == "stopped_early")
    assert early_by_hops[1] == 0 and early_by_hops[3] > early_by_hops[2] > 0


def test_each_kind_of_error_looks_like_itself(recorded):
    made_up = []
    for _, task, messages in recorded.traced:
        entities, answer, kind = task.data["entities"], _final(messages), _classify(task, messages)
        if kind == "skipped_search":  # no search, an identifier of the kind asked for
            assert [m["role"] for m in messages] == ["user", "assistant"]
            assert _ID.fullmatch(answer) and answer[0] == task.data["answer"][0]
            made_up.append(answer)
        elif kind == "stopped_early":  # the identifier just read: an intermediate entity
            searches = len(_results(messages))
            assert answer == entities[searches] != task.data["answer"]
            assert answer in _results(messages)[-1].split("\n")[0]
        elif kind == "wrong_answer":  # another identifier seen in a result
            seen = {w for r in _results(messages) for w in re.findall(r"[A-Z0-9]{3}", r)}
            assert answer in seen and answer != task.data["answer"] and _ID.fullmatch(answer)
    assert len(set(made_up)) > 0.8 * len(made_up)  # made up, not one remembered identifier


def test_the_warm_up_never_reads_the_examples_world(recorded):
    assert sorted(options.get("corpus_seed", 0) for options, _ in recorded.built) == list(range(1, WORLDS + 1))
    per_world = Counter(options["corpus_seed"] for options, _, _ in recorded.traced)
    assert per_world == {w: NUM_TRAIN // WORLDS for w in range(1, WORLDS + 1)}
    facts = {w: {d["text"] for d in multihop_corpus(corpus_seed=w)} for w in range(WORLDS + 1)}
    lines = Counter()
    for options, task, messages in recorded.traced:
        world = options["corpus_seed"]
        chain = task.data["entities"]
        assert all(fact_text(a, b) in facts[world] for a, b in pairwise(chain))  # asked of its own world
        for result in _results(messages):
            for line in result.split("\n"):
                assert line in facts[world]
                lines[line in facts[0]] += 1
    assert lines[True] < 0.05 * lines.total()  # world 0 shares a fact only by chance


def test_world_examples_needs_a_world(tool, tokenizer):
    with pytest.raises(ValueError, match="worlds"):
        world_examples(tokenizer, tool, IDEAL, worlds=0, num_train=10, seed=0, max_len=MAX_LEN)


# ---- the training log's probe ----------------------------------------------------------

class _Oracle:
    """A 'model' whose argmax at each position is the next input token (it peeks): every
    labelled turn is exact. With ``peek=False`` it repeats the current token instead."""

    def __init__(self, vocab, peek=True):
        self.vocab, self.peek = vocab, peek

    def __call__(self, *, input_ids, attention_mask):
        target = torch.roll(input_ids, -1, dims=1) if self.peek else input_ids
        return SimpleNamespace(logits=torch.nn.functional.one_hot(target, self.vocab).float())


def test_turn_probe_scores_calls_and_answers_exactly(tool, tokenizer):
    probe = turn_probe(tokenizer, tool, num_tasks=8, max_len=MAX_LEN)
    vocab = len(tokenizer)
    assert probe(_Oracle(vocab)) == {"call_exact": 1.0, "answer_exact": 1.0}
    assert probe(_Oracle(vocab, peek=False)) == {"call_exact": 0.0, "answer_exact": 0.0}


# ---- the shipped policy -----------------------------------------------------------------

def test_shipped_model_loads_and_records_how_it_was_made():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = json.loads((MODEL / "base_policy.json").read_text())
    assert record["command"].startswith("python -m asyncrl.tiny.search_sft ")
    assert {"steps", "held_out", "machine", "made_at", "noise"} <= record.keys()
    assert set(record["noise"]) == {"skip", "early", "wrong"}
    Noise(**record["noise"])  # valid rates
    assert 0.2 <= record["held_out"]["pass@1"] <= 0.5  # unsure: RL has something to sharpen
    no_tool = record.get("no_tool", {}).get("pass@1")
    assert no_tool is not None and no_tool <= 0.02  # without the tool it can only guess
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    assert model.config.max_position_embeddings == record["model"]["max_position_embeddings"] >= MAX_LEN
    assert tokenizer.chat_template and tokenizer.eos_token_id == model.config.eos_token_id
    assert sum(f.stat().st_size for f in MODEL.iterdir()) < 8 * 2**20
