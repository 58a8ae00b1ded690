"""Multi-hop QA: the invented world of identifiers, its questions, the answer format and
reward, user files, and the registry. Questions are checked against an independent
reference solver that reads only the question and the documents' text, so "answerable from
the corpus" is tested, not assumed."""

from __future__ import annotations

import json
import re
from collections import Counter
from itertools import islice, pairwise

import pytest

from asyncrl.tasks import (
    REWARD_SPECS,
    TASK_NAMES,
    Task,
    TaskDataError,
    default_reward_fn,
    is_validation_prompt,
    load_tasks,
    resolve_reward_fn,
)
from asyncrl.tasks.multihop import (
    extract_answer,
    iter_multihop,
    load_corpus,
    load_questions,
    multihop_corpus,
    multihop_reward,
    normalize_answer,
    write_corpus,
    write_questions,
)

ID = r"[PCTR][0-9B-VX-Z]{2}"

# ---- a reference solver that reads only text --------------------------------------

_FACT = re.compile(r"([A-Z0-9]{3}) is in ([A-Z0-9]{3})\.")
_QUESTION = re.compile(r"Which (company|town|region) is ([A-Z0-9]{3}) in\?")
_PREFIX = {"company": "C", "town": "T", "region": "R"}  # the kind a question asks for -> its ids' first letter


def read_facts(docs):
    """``{entity: where it is}`` and ``{entity: id of the document saying so}``, parsed from each text."""
    container, doc_of = {}, {}
    for doc in docs:
        m = _FACT.fullmatch(doc["text"])
        assert m, f"unparsed document {doc}"
        entity, where = m.groups()
        assert entity not in container, f"two documents about {entity}"
        container[entity], doc_of[entity] = where, doc["id"]
    return container, doc_of


def solve(question, container, doc_of):
    """``(answer, ids of the documents read in order, entities visited)``: follow the facts from
    the subject until an identifier of the kind asked for."""
    kind, entity = _QUESTION.fullmatch(question).groups()
    read, path = [], [entity]
    while not entity.startswith(_PREFIX[kind]):
        assert len(read) < 3, f"no {kind} within three hops of {path[0]}"
        read.append(doc_of[entity])
        entity = container[entity]
        path.append(entity)
    return entity, read, path


def assert_answerable(tasks, docs):
    container, doc_of = read_facts(docs)
    for task in tasks:
        answer, read, path = solve(task.prompt, container, doc_of)
        assert (answer, read, path) == (task.data["answer"], task.data["gold_doc_ids"], task.data["entities"]), task
        assert task.data["hops"] == len(read) >= 1


# ---- the world and its questions --------------------------------------------------

def test_corpus_is_deterministic_and_sized_by_num_people():
    docs = multihop_corpus(num_people=200)
    assert docs == multihop_corpus(num_people=200, max_hops=1)  # question options don't shape it
    assert docs != multihop_corpus(num_people=200, corpus_seed=1)
    assert len(docs) == 200 + 50 + 20  # people, companies (n/4), towns (n/10); regions have no document
    assert len(multihop_corpus()) == 800 + 200 + 80 == 1080
    assert len(multihop_corpus(num_people=40)) == 40 + 10 + 4
    docs[0]["text"] = "mutated"  # callers get copies: the cached world is unharmed
    assert multihop_corpus(num_people=200)[0]["text"] != "mutated"


@pytest.mark.parametrize("options", [{}, {"num_people": 200}, {"num_people": 40, "corpus_seed": 3}])
def test_ids_are_well_formed_and_the_world_is_a_chain(options):
    docs = multihop_corpus(**options)
    n = options.get("num_people", 800)
    container, _ = read_facts(docs)
    assert all(d["id"] == d["title"] and _FACT.fullmatch(d["text"]).group(1) == d["id"] for d in docs)
    assert len({d["id"] for d in docs}) == len(docs)
    by_kind = {p: [e for e in container if e[0] == p] for p in "PCT"}
    regions = {container[t] for t in by_kind["T"]}
    everything = set(container) | set(container.values())
    assert all(re.fullmatch(ID, e) for e in everything) and "THE" not in everything
    assert [len(by_kind[p]) for p in "PCT"] + [len(regions)] == [n, n // 4, n // 10, max(2, round(n / 20))]
    # an entity is in one of the next kind, and every container holds at least one entity
    for lower, upper in [("P", "C"), ("C", "T"), ("T", "R")]:
        held = {container[e] for e in by_kind[lower]}
        assert all(e[0] == upper for e in held)
        assert held == (set(by_kind[upper]) if upper != "R" else regions)
    assert len(regions) >= 2  # the smallest world still asks something


def test_questions_are_deterministic_and_answerable_from_their_gold_documents():
    docs = multihop_corpus(num_people=200)
    tasks = list(islice(iter_multihop(3, num_people=200), 1500))
    assert tasks == list(islice(iter_multihop(3, num_people=200), 1500))
    assert [t.prompt for t in tasks[:50]] != [t.prompt for t in islice(iter_multihop(4, num_people=200), 50)]
    assert_answerable(tasks, docs)
    assert_answerable(list(islice(iter_multihop(0, corpus_seed=5, num_people=60), 300)),
                      multihop_corpus(corpus_seed=5, num_people=60))
    assert json.loads(json.dumps(tasks[0].data)) == tasks[0].data  # data is plain JSON


def test_hops_are_uniform_and_max_hops_is_respected():
    tasks = list(islice(iter_multihop(3, num_people=200), 3000))
    hops = Counter(t.data["hops"] for t in tasks)
    assert set(hops) == {1, 2, 3} and all(0.28 < hops[h] / len(tasks) < 0.39 for h in hops)
    # every kind of question is asked: (hops, kind of subject)
    assert {(t.data["hops"], t.prompt.split()[3][0]) for t in tasks} == {
        (1, "P"), (1, "C"), (1, "T"), (2, "P"), (2, "C"), (3, "P")}
    two = Counter(t.data["hops"] for t in islice(iter_multihop(0, max_hops=2), 1000))
    assert set(two) == {1, 2} and 0.4 < two[1] / 1000 < 0.6
    assert all(t.data["hops"] == 1 for t in islice(iter_multihop(0, max_hops=1), 300))


@pytest.mark.parametrize("options, fragment", [
    ({"num_people": 39}, "num_people"), ({"num_people": 0}, "num_people"), ({"num_people": 5000}, "num_people"),
    ({"max_hops": 0}, "max_hops"), ({"max_hops": 4}, "max_hops"),
])
def test_bad_options_raise(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        next(iter_multihop(0, **options))
    with pytest.raises(ValueError, match=fragment):
        multihop_corpus(**options)


def test_too_many_people_is_refused_before_ids_run_out():
    most = (34**2 - 1) * 3 // 4  # 34 characters (no A, W) after the kind's letter, less "THE"
    big = multihop_corpus(num_people=most)  # the largest allowed still has distinct ids of every kind
    assert len({d["id"] for d in big}) == len(big) == most + round(most / 4) + round(most / 10)
    with pytest.raises(ValueError, match="num_people"):
        multihop_corpus(num_people=most + 1)


def test_searching_an_id_ranks_its_own_document_first():
    from asyncrl.tools.retrieval import BM25Index, Document

    for options in ({"num_people": 200}, {"num_people": 40, "corpus_seed": 9}):
        docs = multihop_corpus(**options)
        container, _ = read_facts(docs)
        index = BM25Index(Document(d["id"], d["text"], d["title"]) for d in docs)
        ids = [d["id"] for d in docs]
        assert [hits[0]["id"] for hits in index.search_batch(ids, 3)] == ids
        # a region has no document: its search finds towns in it
        for region in set(container.values()) - set(container):
            hits = index.search(region, 3)
            assert hits and all(container[h["id"]] == region for h in hits)


# ---- answers and reward -----------------------------------------------------------

KB = Task(id="q", prompt="Which town is c7m in?", data={"answer": "t2x"})


@pytest.mark.parametrize("response", [
    "t2x", "Answer: t2x", "answer: T2X.", "  The t2x!  ", "ANSWER:the  t2x",
    "c7m is in t2x.\nAnswer: t2x", "Answer: t9q\nFinal answer: t2x",
])
def test_reward_exact_after_normalisation(response):
    assert multihop_reward(KB, response) == 1.0


@pytest.mark.parametrize("response", [
    "Answer: t9q", "c7m", "Answer: t2", "Answer: t2xx", "Answer: t2x\nAnswer: t9q", "Answer: t2x t2x", "I do not know",
])
def test_reward_well_formed_but_wrong_is_zero(response):
    assert extract_answer(response) is not None  # an answer, just not the right one: no format bonus
    assert multihop_reward(KB, response) == 0.0


@pytest.mark.parametrize("response", [
    "", "   ", "Answer:", "Answer: ...", "The answer is\nt2x",
    '<tool_call>{"name": "search", "arguments": {"query": "t2x"}}</tool_call>',
    "Answer: t2x because c7m is in t2x and so is p3k",  # not a short answer
    "t2x " * 20, "Answer: {t2x}",
])
def test_reward_garbage_is_zero(response):
    assert extract_answer(response) is None
    assert multihop_reward(KB, response) == 0.0


def test_extract_and_normalise():
    assert extract_answer("Answer:  t2x. \nthanks") == "t2x."
    assert extract_answer(" t2x\n") == "t2x"
    assert extract_answer("line one\nline two") is None
    assert normalize_answer(" The  T2X.") == "t2x"
    assert normalize_answer("Theodore") == "theodore"  # only a whole leading word "the" goes
    assert normalize_answer("the") == "the"


def test_every_generated_answer_scores_in_both_forms():
    tasks = list(islice(iter_multihop(0, num_people=100), 300))
    for task, other in pairwise(tasks):
        answer = task.data["answer"]
        assert re.fullmatch(ID, answer) and extract_answer(answer) == answer
        assert multihop_reward(task, answer) == multihop_reward(task, f"Answer: {answer}") == 1.0
        if normalize_answer(other.data["answer"]) != normalize_answer(answer):
            assert multihop_reward(task, f"Answer: {other.data['answer']}") == 0.0


# ---- user files -------------------------------------------------------------------

def write(tmp_path, lines, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_corpus_and_questions_round_trip(tmp_path):
    docs = multihop_corpus(num_people=50)
    write_corpus(tmp_path / "kb" / "corpus.jsonl", docs)
    assert load_corpus(tmp_path / "kb" / "corpus.jsonl") == docs
    tasks = list(islice(iter_multihop(0, num_people=50), 20))
    write_questions(tmp_path / "q.jsonl", tasks)
    assert load_questions(tmp_path / "q.jsonl") == tasks


def test_user_files_minimal_rows(tmp_path):
    corpus = load_corpus(write(tmp_path, ['{"id": 7, "text": "Ada lives in Rome."}', "", '{"id": "b", "text": "x"}']))
    assert corpus == [{"id": "7", "title": "", "text": "Ada lives in Rome."}, {"id": "b", "title": "", "text": "x"}]
    tasks = load_questions(write(tmp_path, ['{"question": "Where does Ada live?", "answer": "Rome", "src": 1}'],
                                 name="mine.jsonl"))
    assert tasks == [Task(id="mine-1", prompt="Where does Ada live?", data={"answer": "Rome", "src": 1})]
    assert multihop_reward(tasks[0], "Answer: rome") == 1.0
    assert multihop_reward(tasks[0], "Answer: Paris") == 0.0


@pytest.mark.parametrize("bad_line, fragment", [
    ('{"id": "d2", "text": "ok"', "invalid JSON"),
    ('["d2", "ok"]', "JSON object"),
    ('{"id": "d2"}', "'text'"),
    ('{"id": "d2", "text": "  "}', "empty"),
    ('{"text": "ok"}', "'id'"),
    ('{"id": true, "text": "ok"}', "'id' must be a string"),
    ('{"id": "d2", "title": 5, "text": "ok"}', "'title'"),
    ('{"id": "d1", "text": "again"}', "duplicate document id 'd1' (first on line 1)"),
])
def test_corpus_errors_name_file_and_line(tmp_path, bad_line, fragment):
    p = write(tmp_path, ['{"id": "d1", "title": "D", "text": "ok"}', "", bad_line])
    with pytest.raises(TaskDataError) as info:
        load_corpus(p)
    assert str(p) in str(info.value) and "line 3" in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("bad_line, fragment", [
    ('{"answer": "Rome"}', "'question'"),
    ('{"question": "Q?"}', "'answer'"),
    ('{"question": "Q?", "answer": 1984}', "'answer' must be a string"),
    ('{"question": "Q?", "answer": "a b c d e f g h i"}', "not a short answer"),
    ('{"question": "Q?", "answer": "Rome", "hops": 0}', "'hops'"),
    ('{"question": "Q?", "answer": "Rome", "gold_doc_ids": "d1"}', "'gold_doc_ids'"),
    ('{"id": "q1", "question": "Q?", "answer": "Rome"}', "duplicate id 'q1' (first on line 1)"),
])
def test_question_errors_name_file_and_line(tmp_path, bad_line, fragment):
    p = write(tmp_path, ['{"id": "q1", "question": "Where?", "answer": "Rome"}', "", bad_line])
    with pytest.raises(TaskDataError) as info:
        load_questions(p)
    assert str(p) in str(info.value) and "line 3" in str(info.value) and fragment in str(info.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TaskDataError, match="corpus file not found.*nope.jsonl"):
        load_corpus(tmp_path / "nope.jsonl")
    with pytest.raises(TaskDataError, match="questions file not found"):
        load_questions(tmp_path / "nope.jsonl")
    with pytest.raises(TaskDataError, match="empty questions file"):
        load_questions(write(tmp_path, [""]))


# ---- registry ---------------------------------------------------------------------

def test_registry_splits_share_one_corpus_and_are_disjoint():
    assert "multihop" in TASK_NAMES
    assert default_reward_fn("multihop") is multihop_reward
    assert resolve_reward_fn(REWARD_SPECS["multihop"]) is multihop_reward
    splits = load_tasks("multihop", seed=0, num_train=50, num_validation=20)
    assert (len(splits.train), len(splits.validation)) == (50, 20)
    assert splits == load_tasks("multihop", seed=0, num_train=50, num_validation=20)
    train, val = {t.prompt for t in splits.train}, [t.prompt for t in splits.validation]
    assert not train & set(val) and len(set(val)) == 20 and all(map(is_validation_prompt, val))
    assert not any(map(is_validation_prompt, train))
    assert_answerable(splits.train + splits.validation, multihop_corpus())
    # Another seed or corpus option: new questions, and both splits over multihop_corpus(**options).
    options = {"num_people": 100, "corpus_seed": 7}
    other = load_tasks("multihop", seed=1, num_train=50, num_validation=20, options=options)
    assert {t.prompt for t in other.train} != train
    assert not {t.prompt for t in other.train} & {t.prompt for t in other.validation}
    assert_answerable(other.train + other.validation, multihop_corpus(**options))
    with pytest.raises((AssertionError, KeyError)):  # ...and not over the default world
        assert_answerable(other.train + other.validation, multihop_corpus())
    with pytest.raises(ValueError, match="options"):
        load_tasks("multihop", seed=0, num_train=1, num_validation=1, options={"people": 10})


def test_max_hops_option_shapes_the_splits():
    splits = load_tasks("multihop", seed=0, num_train=20, num_validation=5, options={"max_hops": 1})
    assert all(t.data["hops"] == 1 for t in splits.train + splits.validation)
    with pytest.raises(ValueError, match="max_hops"):
        load_tasks("multihop", seed=0, num_train=1, num_validation=1, options={"max_hops": 4})
