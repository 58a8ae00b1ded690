"""Multi-hop questions over a synthetic knowledge base, for a search agent that learns on the CPU.

The knowledge base (KB) is invented, so no model knows it and nothing is downloaded: people,
companies, cities and regions with invented names, linked by six functional relations. Each
person, company and city has one short document stating its facts::

    Orla Venn lives in Kestrel Bay. Her mentor is Tamsin Roe. She works at Quillfen.
    Quillfen is a company founded in Kestrel Bay. It is led by Tamsin Roe.
    Kestrel Bay is a city in the region of Norvast.

(Regions have no document: they are only ever answers.) A one-hop question needs the
subject's document ("Where does Orla Venn live?"); a two-hop question needs it and then
the document of the entity it names ("Where does the mentor of Orla Venn live?"). Every
relation is a function, so every question has exactly one answer, and every answer is an
entity name. Each task's ``data`` holds ``answer``, ``hops``, ``gold_doc_ids`` (the
documents to read, in order), ``entities`` (subject, intermediate, answer) and
``relations``, which is all a trace generator needs to write an ideal search trace.

One corpus, two question splits. The KB depends only on ``corpus_seed`` and
``num_people``, never on the stream's seed, so the registry's train stream (``seed``)
and validation stream (a derived seed) ask about the same corpus; ``multihop_corpus``
takes the same options and returns it. The split is the registry's hash of the question
text (``is_validation_prompt``): validation questions are never trained on, and both
splits sample the same mix of relations and hops. Facts are shared between the splits
on purpose: the corpus is the agent's environment, and what is held out is the question.

Names are ASCII letters and spaces (a char-level tokenizer spells them), unique across
the whole KB, and never a word of the templates.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypedDict

from asyncrl.jsonl import JsonlError, iter_jsonl
from asyncrl.tasks.base import Task, TaskDataError

FORMAT_REWARD = 0.1
MAX_ANSWER_WORDS = 8
MAX_ANSWER_CHARS = 100


class Document(TypedDict):
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class _Relation:
    source: str  # entity type of the subject
    target: str  # entity type of the value
    question: str  # "{x}" is the subject's name or a noun phrase naming it
    phrase: str | None  # noun phrase "the ... of {x}" naming the value, for the first hop


_RELATIONS: dict[str, _Relation] = {
    "home": _Relation("person", "city", "Where does {x} live?", "the home city of {x}"),
    "mentor": _Relation("person", "person", "Who is the mentor of {x}?", "the mentor of {x}"),
    "employer": _Relation("person", "company", "Where does {x} work?", "the employer of {x}"),
    "founded": _Relation("company", "city", "Where was {x} founded?", "the founding city of {x}"),
    "leader": _Relation("company", "person", "Who leads {x}?", "the leader of {x}"),
    "region": _Relation("city", "region", "In which region is {x}?", None),
}
_CHAINS: dict[int, list[tuple[str, ...]]] = {
    1: [(r,) for r in _RELATIONS],
    2: [(a, b) for a, ra in _RELATIONS.items() if ra.phrase for b, rb in _RELATIONS.items()
        if rb.source == ra.target and (a, b) != ("leader", "employer")],  # a leader works where they lead
}

# ----------------------------------------------------------------------------- the KB

# Short, pronounceable words (Orla, Venn, Quillfen): mostly single consonants and vowels,
# so a char-level model copies a name in a few tokens.
_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "dr", "fr", "gr", "tr", "st", "th", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ea")
_INNER_CODAS = ("", "", "", "n", "l", "r", "s")
_FINAL_CODAS = ("", "", "n", "l", "r", "s", "th", "nd", "ck", "ll", "ss", "rk", "x", "nn")
_CITY_SUFFIXES = ("Bay", "Ford", "Vale", "Hollow", "Reach", "Crossing", "Harbor", "Falls", "Ridge", "Mill")
# Template words a name must never equal, so no question or document reads two ways.
_RESERVED = {w.lower() for w in _CITY_SUFFIXES} | {
    "the", "a", "an", "answer", "he", "she", "his", "her", "it", "is", "in", "of", "at", "by", "lives", "works",
    "mentor", "company", "city", "region", "founded", "led", "who", "where", "does", "was", "which", "leads",
    "live", "work", "home", "founding", "leader", "employer",
}


@dataclass(frozen=True)
class _KB:
    documents: tuple[tuple[str, str, str], ...]  # (id, title, text)
    doc_id: dict[str, str]  # entity name -> its document id
    facts: dict[tuple[str, str], str]  # (entity name, relation) -> value name
    entities: dict[str, tuple[str, ...]]  # entity type -> names, in document order


def _word(rng: random.Random, syllables: int) -> str:
    parts = []
    for k in range(syllables):
        onset = rng.choice(_ONSETS + ("",)) if k == 0 else rng.choice(_ONSETS)
        coda = rng.choice(_FINAL_CODAS if k == syllables - 1 else _INNER_CODAS)
        parts.append(onset + rng.choice(_VOWELS) + coda)
    return "".join(parts).capitalize()


def _words(rng: random.Random, n: int, syllables: tuple[int, ...], used: set[str]) -> list[str]:
    """``n`` fresh words, none in ``used`` (which they join) nor reserved."""
    out: list[str] = []
    while len(out) < n:
        w = _word(rng, rng.choice(syllables))
        if len(w) >= 3 and w.lower() not in used and w.lower() not in _RESERVED:
            used.add(w.lower())
            out.append(w)
    return out


@lru_cache(maxsize=64)
def _build_kb(corpus_seed: int, num_people: int, facts_seed: int | None = None) -> _KB:
    """Deterministic in its arguments; cached, so never mutate what it returns.
    ``facts_seed``: the same names as ``corpus_seed``'s, every fact drawn afresh."""
    rng = random.Random(f"asyncrl-multihop-{corpus_seed}-{num_people}")
    num_companies, num_cities = max(3, num_people // 10), max(3, num_people // 25)
    num_regions = max(2, num_cities // 4)
    used: set[str] = set()
    # Shared first and last names (as in life), unique full names.
    pool = max(16, num_people // 3)
    firsts, lasts = _words(rng, pool, (2,), used), _words(rng, pool, (1, 2), used)
    people: list[str] = []
    seen: set[str] = set()
    while len(people) < num_people:
        name = f"{rng.choice(firsts)} {rng.choice(lasts)}"
        if name not in seen:
            seen.add(name)
            people.append(name)
    companies = _words(rng, num_companies, (2, 3), used)
    cities = [f"{w} {rng.choice(_CITY_SUFFIXES)}" for w in _words(rng, num_cities, (2,), used)]
    regions = _words(rng, num_regions, (2, 3), used)

    if facts_seed is not None:
        rng = random.Random(f"asyncrl-multihop-facts-{corpus_seed}-{num_people}-{facts_seed}")
    facts: dict[tuple[str, str], str] = {}
    # Mentors follow a hidden seniority ring: the mentor of rank r sits 1..k ranks above it
    # (mod n) with k <= (n-1)//2, so nobody mentors themselves or their own mentor, and
    # "the mentor of the mentor of X" is never X.
    rank = people[:]
    rng.shuffle(rank)
    k = (num_people - 1) // 2
    for r, person in enumerate(rank):
        facts[person, "mentor"] = rank[(r + rng.randint(1, k)) % num_people]
    for person in people:
        facts[person, "home"] = rng.choice(cities)
        facts[person, "employer"] = rng.choice(companies)
    for company, leader in zip(companies, rng.sample(people, num_companies)):
        facts[company, "founded"] = rng.choice(cities)
        facts[company, "leader"] = leader
        facts[leader, "employer"] = company  # a leader works where they lead
    for city in cities:
        facts[city, "region"] = rng.choice(regions)

    docs: list[tuple[str, str, str]] = []
    for i, p in enumerate(people):
        subj, poss = ("She", "Her") if rng.random() < 0.5 else ("He", "His")
        text = (f"{p} lives in {facts[p, 'home']}. {poss} mentor is {facts[p, 'mentor']}. "
                f"{subj} works at {facts[p, 'employer']}.")
        docs.append((f"person-{i}", p, text))
    for i, c in enumerate(companies):
        text = f"{c} is a company founded in {facts[c, 'founded']}. It is led by {facts[c, 'leader']}."
        docs.append((f"company-{i}", c, text))
    for i, c in enumerate(cities):
        docs.append((f"city-{i}", c, f"{c} is a city in the region of {facts[c, 'region']}."))
    return _KB(documents=tuple(docs), doc_id={title: doc_id for doc_id, title, _ in docs}, facts=facts,
               entities={"person": tuple(people), "company": tuple(companies), "city": tuple(cities)})


def _check_options(num_people: int, two_hop_fraction: float) -> None:
    if num_people < 3:  # a mentor ring needs three people
        raise ValueError(f"multihop: num_people must be >= 3, got {num_people}")
    if not 0 <= two_hop_fraction <= 1:
        raise ValueError(f"multihop: two_hop_fraction must be in [0, 1], got {two_hop_fraction}")


def multihop_corpus(*, corpus_seed: int = 0, num_people: int = 500, two_hop_fraction: float = 0.5,
                    facts_seed: int | None = None) -> list[Document]:
    """The documents the ``multihop`` task asks about: people, then companies, then cities.

    Takes the generator's options, so ``multihop_corpus(**options)`` is the corpus of
    ``load_tasks("multihop", options=options, ...)`` whatever its seed; only
    ``corpus_seed`` and ``num_people`` shape it (500 people give 570 documents:
    500 people, 50 companies, 20 cities). ``facts_seed`` keeps the names and redraws every
    fact: a counterfactual variant of the same world (the search warm-up trains on those,
    so it learns to read facts, not to remember them).
    """
    _check_options(num_people, two_hop_fraction)
    return [Document(id=i, title=t, text=x) for i, t, x in _build_kb(corpus_seed, num_people, facts_seed).documents]


def iter_multihop(seed: int, *, corpus_seed: int = 0, num_people: int = 500,
                  two_hop_fraction: float = 0.5, facts_seed: int | None = None) -> Iterator[Task]:
    """Endless deterministic stream of questions over ``multihop_corpus(...)``.

    Each question is two-hop with probability ``two_hop_fraction``; its chain of relations
    is uniform among the chains of that length, its subject uniform among entities of the
    chain's first type.
    """
    _check_options(num_people, two_hop_fraction)
    kb = _build_kb(corpus_seed, num_people, facts_seed)
    rng = random.Random(seed)
    i = 0
    while True:
        hops = 2 if rng.random() < two_hop_fraction else 1
        chain = rng.choice(_CHAINS[hops])
        entities = [rng.choice(kb.entities[_RELATIONS[chain[0]].source])]
        for relation in chain:
            entities.append(kb.facts[entities[-1], relation])
        if entities[-1] in entities[:-1]:  # "Who leads the employer of X?" where X leads it
            continue
        x = entities[0]
        for relation in chain[:-1]:
            x = _RELATIONS[relation].phrase.format(x=x)
        yield Task(
            id=f"multihop-{seed}-{i}",
            prompt=_RELATIONS[chain[-1]].question.format(x=x),
            data={"answer": entities[-1], "hops": hops, "gold_doc_ids": [kb.doc_id[e] for e in entities[:-1]],
                  "entities": entities, "relations": list(chain)},
        )
        i += 1


# ----------------------------------------------------------------------------- answers and reward

_ANSWER_RE = re.compile(r"\banswer\s*:([^\n]*)", re.IGNORECASE)
_MARKUP = set("<>{}")


def normalize_answer(text: str) -> str:
    """Lower case, single spaces, no surrounding punctuation, no leading "the"."""
    text = " ".join(text.lower().split()).strip(string.punctuation + " ")
    if text.startswith("the "):
        text = text[4:].strip(string.punctuation + " ")
    return text


def extract_answer(response: str) -> str | None:
    """The answer a response commits to, or None when it is not well-formed.

    Well-formed means one short answer: the text after the last ``Answer:`` (any case) up to
    the end of its line, or else the whole response when it is a single line. Either way
    the answer must be non-empty after ``normalize_answer``, at most ``MAX_ANSWER_WORDS``
    words and ``MAX_ANSWER_CHARS`` characters, and free of ``< > { }``, so a tool call,
    a paragraph of reasoning or an empty ``Answer:`` is not an answer. The agent uses this
    to read its final answer and the reward to score it, so the two never disagree.
    """
    found = _ANSWER_RE.findall(response)
    if found:
        candidate = found[-1].strip()
    else:
        candidate = response.strip()
        if "\n" in candidate:
            return None
    if (not normalize_answer(candidate) or len(candidate) > MAX_ANSWER_CHARS
            or len(candidate.split()) > MAX_ANSWER_WORDS or _MARKUP & set(candidate)):
        return None
    return candidate


def multihop_reward(task: Task, response: str) -> float:
    """1.0 when the extracted answer equals ``task.data["answer"]`` after
    ``normalize_answer``, ``FORMAT_REWARD`` for a well-formed wrong answer (a small
    gradient toward committing to one short answer), 0.0 when there is no answer."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if normalize_answer(answer) == normalize_answer(str(task.data["answer"])) else FORMAT_REWARD


# ----------------------------------------------------------------------------- user files


def write_corpus(path: str | Path, docs: list[Document]) -> None:
    """One ``{"id", "title", "text"}`` object per line; ``load_corpus`` reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = (json.dumps({"id": d["id"], "title": d["title"], "text": d["text"]}, ensure_ascii=False) for d in docs)
    path.write_text("".join(row + "\n" for row in rows), encoding="utf-8")


def write_questions(path: str | Path, tasks: list[Task]) -> None:
    """One ``{"id", "question", "answer", ...data}`` object per line; ``load_questions`` reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = (json.dumps({"id": t.id, "question": t.prompt, **t.data}, ensure_ascii=False) for t in tasks)
    path.write_text("".join(row + "\n" for row in rows), encoding="utf-8")


def _string(row: dict[str, Any], key: str, where: str, *, default: str | None = None) -> str:
    """``row[key]`` as a non-empty string (an integer id becomes one); ``default`` when absent."""
    if key not in row:
        if default is None:
            raise TaskDataError(f"{where}: missing required field {key!r}")
        return default
    value = row[key]
    # bool is an int subclass; an id of `true` is almost surely a data mistake.
    if key == "id" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise TaskDataError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise TaskDataError(f"{where}: {key!r} must not be empty")
    return value


def _rows(path: Path, what: str) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """``(line_no, where, row)`` per row, file errors as TaskDataError; an empty file is one too."""
    count = 0
    try:
        for line_no, row in iter_jsonl(path):
            count += 1
            yield line_no, f"{path}, line {line_no}", row
    except JsonlError as exc:
        raise TaskDataError(str(exc).replace("file not found", f"{what} file not found")) from None
    if count == 0:
        raise TaskDataError(f"{path}: empty {what} file; expected one JSON object per line")


def load_corpus(path: str | Path) -> list[Document]:
    """Documents from a JSONL file of ``{"id", "text", "title"?}`` objects (other fields
    ignored). Ids (strings or integers) must be unique, since gold paths name documents
    by id; a missing title is ``""``."""
    path = Path(path)
    docs: list[Document] = []
    first_line: dict[str, int] = {}
    for line_no, where, row in _rows(path, "corpus"):
        doc_id = _string(row, "id", where)
        if doc_id in first_line:
            raise TaskDataError(f"{where}: duplicate document id {doc_id!r} (first on line {first_line[doc_id]})")
        first_line[doc_id] = line_no
        title = row.get("title", "")
        if not isinstance(title, str):
            raise TaskDataError(f"{where}: 'title' must be a string, got {type(title).__name__}")
        docs.append(Document(id=doc_id, title=title, text=_string(row, "text", where)))
    return docs


def load_questions(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file of ``{"question", "answer", "id"?, "hops"?, "gold_doc_ids"?}``
    objects; every field but ``question`` and ``id`` goes to ``Task.data``. Ids default to
    ``{stem}-{line}`` and must be unique. An answer that ``extract_answer`` would not
    accept could never score 1.0, so it is refused here rather than trained on at zero
    reward."""
    path = Path(path)
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for line_no, where, row in _rows(path, "questions"):
        question = _string(row, "question", where)
        answer = _string(row, "answer", where)
        if extract_answer(answer) is None:
            raise TaskDataError(f"{where}: answer {answer!r} is not a short answer (one line, at most "
                                f"{MAX_ANSWER_WORDS} words and {MAX_ANSWER_CHARS} characters, no '<>{{}}'), "
                                "so no response could score 1.0")
        hops = row.get("hops", 1)
        if isinstance(hops, bool) or not isinstance(hops, int) or hops < 1:
            raise TaskDataError(f"{where}: 'hops' must be an integer >= 1, got {hops!r}")
        gold = row.get("gold_doc_ids", [])
        if not isinstance(gold, list) or not all(isinstance(g, str) for g in gold):
            raise TaskDataError(f"{where}: 'gold_doc_ids' must be a list of document id strings, got {gold!r}")
        task_id = _string(row, "id", where, default=f"{path.stem}-{line_no}")
        if task_id in first_line:
            raise TaskDataError(f"{where}: duplicate id {task_id!r} (first on line {first_line[task_id]})")
        first_line[task_id] = line_no
        data = {k: v for k, v in row.items() if k not in ("question", "id")}
        tasks.append(Task(id=task_id, prompt=question, data=data))
    return tasks
