"""Multi-hop questions over a document collection that only a ``search`` tool can reach.

The collection is an invented world of short identifiers, so no model knows it and nothing
is downloaded. Four kinds of entity form a chain — people (``P3K``), companies (``C7M``),
towns (``T2X``), regions (``R5Q``) — and each entity but a region has one document that
states its one fact, where it belongs::

    P3K is in C7M.        C7M is in T2X.        T2X is in R5Q.

A question names an entity and the kind of place asked for: "Which region is P3K in?"
needs three documents read in turn (P3K → its company → that company's town → the
town's region), "Which company is P3K in?" one. Every fact is a function, so every
question has one answer: an identifier.

Why this surface (and not names of people and cities, as before): the search agent is
trained on a CPU by a policy of under a million parameters that spells one character per
token. Copying two-word names out of 600-character conversations proved beyond it in a
session's warm-up (docs/design.md, "Measurements behind choices in the code"); three-character
identifiers, one fact per document and episodes of at most ~500 characters keep the
reading and copying within reach, so what remains to learn is *when* to search again and
*which* identifier is the answer. The first letter of an identifier names its kind, the
question names the kind it wants: an agent can tell it has arrived. Identifiers are
upper case and digits, characters no template or tool-call text uses, and a search
result holds one identifier of the next kind: to copy one, a model finds the last
occurrence of the letter it has just written (an induction head). Measured: with
lower-case identifiers, which share letters with ``"query"`` and ``search``, a 0.8M
policy had not learnt to copy one after 1,200 warm-up steps.

Without the tool the answer is one of hundreds of identifiers the policy has never seen
(the warm-up reads other worlds, ``corpus_seed`` ≠ 0): guessing scores ≈ 0.

One corpus, two question splits. The world depends only on ``corpus_seed`` and
``num_people``, never on the stream's seed, so the registry's train stream (``seed``) and
validation stream (a derived seed) ask about the same corpus; ``multihop_corpus`` takes
the same options and returns it. The split is the registry's hash of the question text
(``is_validation_prompt``): validation questions are never trained on. Each task's
``data`` holds ``answer``, ``hops``, ``gold_doc_ids`` (the documents to read, in order)
and ``entities`` (subject, intermediates, answer), all a trace generator needs.
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

MAX_ANSWER_WORDS = 8
MAX_ANSWER_CHARS = 100
MAX_HOPS = 3


class Document(TypedDict):
    id: str
    title: str
    text: str


# The chain of kinds, lowest first: an entity of kind i is in one entity of kind i + 1.
# (prefix, the word a question uses for the kind, how many per person)
KINDS: tuple[tuple[str, str, float], ...] = (
    ("P", "person", 1.0), ("C", "company", 1 / 4), ("T", "town", 1 / 10), ("R", "region", 1 / 20))
ID_CHARS = "".join(c for c in string.ascii_uppercase + string.digits if c not in "AW")  # "Answer", "Which"


def question_text(kind: int, subject: str) -> str:
    """The question asking which entity of ``KINDS[kind]`` ``subject`` is (transitively) in."""
    return f"Which {KINDS[kind][1]} is {subject} in?"


def fact_text(entity: str, container: str) -> str:
    return f"{entity} is in {container}."


# ----------------------------------------------------------------------------- the world


@dataclass(frozen=True)
class _World:
    ids: tuple[tuple[str, ...], ...]  # per kind, in document order
    container: dict[str, str]  # entity -> the entity of the next kind it is in


_NOT_IDS = {"THE"}  # the one English stopword (which the index drops) of an identifier's shape
_MAX_PER_KIND = len(ID_CHARS) ** 2 - len(_NOT_IDS)


def _fresh_ids(rng: random.Random, prefix: str, n: int) -> list[str]:
    """``n`` distinct identifiers: ``prefix`` and two letters or digits."""
    out: set[str] = set()
    while len(out) < n:
        out.add(prefix + rng.choice(ID_CHARS) + rng.choice(ID_CHARS))
        out -= _NOT_IDS
    ordered = sorted(out)
    rng.shuffle(ordered)
    return ordered


@lru_cache(maxsize=256)
def _build_world(corpus_seed: int, num_people: int) -> _World:
    """Deterministic in its arguments; cached, so never mutate what it returns."""
    rng = random.Random(f"asyncrl-multihop-ids-{corpus_seed}-{num_people}")
    ids = tuple(tuple(_fresh_ids(rng, prefix, max(2, round(num_people * per_person))))
                for prefix, _, per_person in KINDS)
    container: dict[str, str] = {}
    for lower, upper in zip(ids, ids[1:]):
        # every container holds at least one entity (a permutation first), the rest at random
        order = list(upper) + [rng.choice(upper) for _ in range(len(lower) - len(upper))]
        rng.shuffle(order)
        container.update(zip(lower, order))
    return _World(ids=ids, container=container)


def _check_options(num_people: int, max_hops: int) -> None:
    if not 40 <= num_people <= _MAX_PER_KIND * 3 // 4:  # two regions at least; room to draw distinct ids
        raise ValueError(f"multihop: num_people must be in [40, {_MAX_PER_KIND * 3 // 4}], got {num_people}")
    if not 1 <= max_hops <= MAX_HOPS:
        raise ValueError(f"multihop: max_hops must be in [1, {MAX_HOPS}], got {max_hops}")


def multihop_corpus(*, corpus_seed: int = 0, num_people: int = 800, max_hops: int = MAX_HOPS) -> list[Document]:
    """The documents the ``multihop`` task asks about: people, then companies, then towns
    (regions have none: they are only ever answers). Each is ``{"id": e, "title": e,
    "text": "E is in X."}``.

    Takes the generator's options, so ``multihop_corpus(**options)`` is the corpus of
    ``load_tasks("multihop", options=options, ...)`` whatever its seed; only ``corpus_seed``
    and ``num_people`` shape it (800 people: 800 + 200 companies + 80 towns = 1,080 documents,
    and 40 regions).
    """
    _check_options(num_people, max_hops)
    world = _build_world(corpus_seed, num_people)
    return [Document(id=e, title=e, text=fact_text(e, world.container[e])) for kind in world.ids[:-1] for e in kind]


def iter_multihop(seed: int, *, corpus_seed: int = 0, num_people: int = 800,
                  max_hops: int = MAX_HOPS) -> Iterator[Task]:
    """Endless deterministic stream of questions over ``multihop_corpus(...)``.

    The number of hops is uniform in ``1..max_hops``, the subject's kind uniform among the
    kinds at least that many links below regions, the subject uniform in its kind.
    """
    _check_options(num_people, max_hops)
    world = _build_world(corpus_seed, num_people)
    rng = random.Random(seed)
    top = len(KINDS) - 1
    i = 0
    while True:
        hops = rng.randint(1, max_hops)
        start = rng.randint(0, top - hops)
        entities = [rng.choice(world.ids[start])]
        for _ in range(hops):
            entities.append(world.container[entities[-1]])
        yield Task(
            id=f"multihop-{seed}-{i}",
            prompt=question_text(start + hops, entities[0]),
            data={"answer": entities[-1], "hops": hops, "gold_doc_ids": entities[:-1], "entities": entities},
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
    ``normalize_answer``, else 0.0. No bonus for a well-formed wrong answer: any identifier
    is well-formed, so a bonus could be farmed without searching."""
    answer = extract_answer(response)
    return float(answer is not None and normalize_answer(answer) == normalize_answer(str(task.data["answer"])))


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
