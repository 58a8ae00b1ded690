"""Multi-hop QA: the synthetic KB, its questions, the answer format and reward, user files,
and the registry. Questions are checked against an independent reference solver that
reads only the documents' text, so "answerable from the corpus" is tested, not assumed."""

from __future__ import annotations

import json
import re
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
    FORMAT_REWARD,
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

# ---- a reference solver that reads only text --------------------------------------

_NAME = r"([A-Za-z ]+?)"
_DOC_FACTS = [
    (re.compile(rf"{_NAME} lives in {_NAME}\. (?:Her|His) mentor is {_NAME}\. (?:She|He) works at {_NAME}\."),
     ("home", "mentor", "employer")),
    (re.compile(rf"{_NAME} is a company founded in {_NAME}\. It is led by {_NAME}\."), ("founded", "leader")),
    (re.compile(rf"{_NAME} is a city in the region of {_NAME}\."), ("region",)),
]
_QUESTIONS = [(re.compile(q), r) for q, r in [
    (r"Where does (.+) live\?", "home"), (r"Who is the mentor of (.+)\?", "mentor"),
    (r"Where does (.+) work\?", "employer"), (r"Where was (.+) founded\?", "founded"),
    (r"Who leads (.+)\?", "leader"), (r"In which region is (.+)\?", "region"),
]]
_PHRASE = re.compile(r"the (home city|mentor|employer|founding city|leader) of (.+)")
_PHRASE_RELATION = {"home city": "home", "mentor": "mentor", "employer": "employer",
                    "founding city": "founded", "leader": "leader"}


def read_facts(docs):
    """``{(title, relation): value}`` and ``{title: doc id}``, parsed from each text."""
    facts, doc_of = {}, {}
    for doc in docs:
        for pattern, relations in _DOC_FACTS:
            m = pattern.fullmatch(doc["text"])
            if m:
                assert m.group(1) == doc["title"]
                facts.update({(doc["title"], r): v for r, v in zip(relations, m.groups()[1:])})
                break
        else:
            raise AssertionError(f"unparsed document {doc}")
        doc_of[doc["title"]] = doc["id"]
    return facts, doc_of


def solve(question, facts, doc_of):
    """``(answer, ids of the documents read, in order)``."""
    relation, phrase = next((r, m.group(1)) for q, r in _QUESTIONS if (m := q.fullmatch(question)))
    chain = [relation]
    while m := _PHRASE.fullmatch(phrase):
        chain.insert(0, _PHRASE_RELATION[m.group(1)])
        phrase = m.group(2)
    entity, read = phrase, []
    for relation in chain:
        read.append(doc_of[entity])
        entity = facts[entity, relation]
    return entity, read


def assert_answerable(tasks, docs):
    facts, doc_of = read_facts(docs)
    for task in tasks:
        answer, read = solve(task.prompt, facts, doc_of)
        assert (answer, read) == (task.data["answer"], task.data["gold_doc_ids"]), task
        assert task.data["hops"] == len(read) == len(task.data["relations"])
        assert task.data["entities"][-1] == answer and answer not in task.data["entities"][:-1]


# ---- the KB and its questions -----------------------------------------------------

def test_corpus_is_deterministic_and_sized_by_num_people():
    docs = multihop_corpus(num_people=200)
    assert docs == multihop_corpus(num_people=200, two_hop_fraction=1.0)  # question options don't shape it
    assert docs != multihop_corpus(num_people=200, corpus_seed=1)
    assert len(docs) == 200 + 20 + 8  # people, companies (n/10), cities (n/25)
    assert len(multihop_corpus()) == 570 and len(multihop_corpus(num_people=2000)) == 2280
    assert len({d["id"] for d in docs}) == len({d["title"] for d in docs}) == len(docs)
    assert all(re.fullmatch(r"[A-Z][a-z]+( [A-Z][a-z]+)?", d["title"]) for d in docs)
    assert all(re.fullmatch(r"[A-Za-z .]+", d["text"]) for d in docs)
    docs[0]["text"] = "mutated"  # callers get copies: the cached KB is unharmed
    assert multihop_corpus(num_people=200)[0]["text"] != "mutated"


def test_questions_are_deterministic_and_answerable_from_their_gold_documents():
    docs = multihop_corpus(num_people=200)
    tasks = list(islice(iter_multihop(3, num_people=200), 1500))
    assert tasks == list(islice(iter_multihop(3, num_people=200), 1500))
    assert [t.prompt for t in tasks[:50]] != [t.prompt for t in islice(iter_multihop(4, num_people=200), 50)]
    assert_answerable(tasks, docs)
    hops = [t.data["hops"] for t in tasks]
    assert 0.4 < hops.count(2) / len(hops) < 0.6
    assert len({tuple(t.data["relations"]) for t in tasks}) == 6 + 9  # every chain is asked
    assert all(t.data["hops"] == 1 for t in islice(iter_multihop(0, two_hop_fraction=0.0), 100))
    assert all(t.data["hops"] == 2 for t in islice(iter_multihop(0, two_hop_fraction=1.0), 100))


def test_bad_options_raise():
    with pytest.raises(ValueError, match="num_people"):
        next(iter_multihop(0, num_people=2))
    with pytest.raises(ValueError, match="two_hop_fraction"):
        multihop_corpus(two_hop_fraction=1.5)


# ---- answers and reward -----------------------------------------------------------

KB = Task(id="q", prompt="Where does Orla Venn live?", data={"answer": "Kestrel Bay"})


@pytest.mark.parametrize("response", [
    "Kestrel Bay", "Answer: Kestrel Bay", "answer: kestrel bay.", "  The Kestrel Bay!  ", "ANSWER:the  kestrel bay",
    "Her document says she lives there.\nAnswer: Kestrel Bay", "Answer: Quillfen\nFinal answer: Kestrel Bay",
])
def test_reward_exact_after_normalisation(response):
    assert multihop_reward(KB, response) == 1.0


@pytest.mark.parametrize("response", [
    "Answer: Quillfen", "Tamsin Roe", "Answer: Kestrel", "Answer: Kestrel Bay\nAnswer: Quillfen", "I do not know",
])
def test_reward_well_formed_but_wrong(response):
    assert multihop_reward(KB, response) == FORMAT_REWARD


@pytest.mark.parametrize("response", [
    "", "   ", "Answer:", "Answer: ...", "The answer is\nKestrel Bay",
    '<tool_call>{"name": "search", "arguments": {"query": "Kestrel Bay"}}</tool_call>',
    "Answer: Kestrel Bay because the mentor of Orla Venn lives there too",  # not a short answer
    "Kestrel Bay " * 20,
])
def test_reward_garbage_is_zero(response):
    assert multihop_reward(KB, response) == 0.0


def test_extract_and_normalise():
    assert extract_answer("Answer:  Kestrel Bay. \nthanks") == "Kestrel Bay."
    assert extract_answer(" Kestrel Bay\n") == "Kestrel Bay"
    assert extract_answer("line one\nline two") is None
    assert normalize_answer(" The  Kestrel Bay.") == "kestrel bay"
    assert normalize_answer("Theodore") == "theodore"  # only a whole leading word "the" goes


def test_every_generated_answer_scores_in_both_forms():
    tasks = list(islice(iter_multihop(0, num_people=100), 300))
    for task, other in pairwise(tasks):
        answer = task.data["answer"]
        assert extract_answer(answer) == answer
        assert multihop_reward(task, answer) == multihop_reward(task, f"Answer: {answer}") == 1.0
        if normalize_answer(other.data["answer"]) != normalize_answer(answer):
            assert multihop_reward(task, f"Answer: {other.data['answer']}") == FORMAT_REWARD


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
    assert_answerable(splits.train + splits.validation, multihop_corpus())
    # Another seed or corpus option: new questions, and both splits over multihop_corpus(**options).
    options = {"num_people": 100, "corpus_seed": 7}
    other = load_tasks("multihop", seed=1, num_train=50, num_validation=20, options=options)
    assert {t.prompt for t in other.train} != train
    assert_answerable(other.train + other.validation, multihop_corpus(**options))
    with pytest.raises(ValueError, match="options"):
        load_tasks("multihop", seed=0, num_train=1, num_validation=1, options={"people": 10})


def test_two_hop_fraction_option_shapes_the_splits():
    splits = load_tasks("multihop", seed=0, num_train=20, num_validation=5, options={"two_hop_fraction": 1.0})
    assert all(t.data["hops"] == 2 for t in splits.train + splits.validation)
    assert json.loads(json.dumps(splits.train[0].data)) == splits.train[0].data  # data is plain JSON
