"""Multi-hop research questions in natural language, and the BrowseComp-Plus-shaped files they
travel in.

**The world** (``build_world``, seeded): invented people, companies, towns and regions with
pronounceable names no model has read ("Maren Tovik", "Ostrel Mills", "Korlwick", "Vessa
Highlands"), chained as ``multihop`` chains its identifiers — a person works at one company,
a company is based in one town, a town lies in one region — and one document per entity
that says so in a sentence, with the entity's name as its title::

    Maren Tovik is an engineer who works at Ostrel Mills.
    Ostrel Mills is a textile company based in Korlwick.
    Korlwick is a town in the Vessa Highlands region.
    Vessa Highlands is a region known for its orchards.

A question asks along the chain, 1–3 hops ("Which company does Maren Tovik work at?",
"In which town is the company that Maren Tovik works at based?", "In which region is the
town where Maren Tovik's employer is based?"); every link is a function, so each question
has one answer, a name of at most three words — within what a 135M chat model copies out
of a short tool result, which is why the sentences are short and one fact each.

**Held out**: a seeded fraction of the towns, with every company based in them and every
person working there, is held out: held-out questions start from those entities, and no
train question's chain (subject, intermediates, answer) names any of them. Regions are
shared (there are few; they are answers, never subjects), so a 3-hop held-out answer may
be a region the training saw as an answer — reaching it still needs the held-out chain.
Every document is in the corpus either way: the retrieval service serves one collection.

**The files** (``write_research``): ``corpus.jsonl`` (``{"id", "title", "text"}``, what
``python -m asyncrl.tools.retrieval --docs`` reads) and ``train.jsonl`` / ``heldout.jsonl``
in BrowseComp-Plus' query shape: ``{"query_id", "query", "answer", "evidence_docs",
"gold_docs", "negative_docs"}``, each doc ``{"docid", "text", "title"?, "url"?}`` — the
evidence is the chain's documents, the gold the one that states the answer, the negatives
hard ones (the documents of entities beside the chain's). ``load_research`` reads that shape,
so a (decrypted) BrowseComp-Plus copy exported to JSONL loads the same way
(``task.name: research``, ``path``); its corpus goes to the retrieval service as it is.
The reward is ``multihop_reward``: the ``Answer:`` line's text, normalised, equals the answer.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import Task, TaskDataError
from asyncrl.tasks.multihop import _rows, _string, extract_answer

logger = logging.getLogger(__name__)

_ONSETS = ["b", "br", "d", "dr", "f", "g", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "l", "n", "r", "s", "th", "k", "m", "x"]
_JOBS = ["engineer", "accountant", "chemist", "designer", "nurse", "carpenter", "lawyer", "pilot", "baker", "teacher"]
_INDUSTRIES = [("textile", "Mills"), ("shipping", "Freight"), ("software", "Labs"), ("food", "Foods"),
               ("printing", "Press"), ("engine", "Motors"), ("glass", "Glassworks"), ("timber", "Timber")]
_TOWN_ENDS = ["wick", "ford", "by", "ton", "mere", "dale", "holm", "stead"]
_REGION_ENDS = ["Highlands", "Coast", "Valley", "Plains", "Marches", "Lowlands"]
_FEATURES = ["its orchards", "its salt marshes", "its old mines", "its vineyards", "its lakes", "its wool"]
KINDS = ("person", "company", "town", "region")


@dataclass(frozen=True)
class ResearchWorld:
    """Entities per kind (names), each entity's container (the next kind's), each entity's
    document text, and the held-out entities (subjects of held-out questions only)."""

    entities: dict[str, tuple[str, ...]]  # kind -> names, in document order
    container: dict[str, str]
    documents: dict[str, str]  # name -> its sentence
    heldout: frozenset[str]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables)).capitalize()


def _names(rng: random.Random, n: int, make, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = make()
        if name not in taken and len(name) <= 24:
            taken.add(name)
            out.append(name)
    return out


def build_world(seed: int = 0, *, num_people: int = 400, heldout_fraction: float = 0.2) -> ResearchWorld:
    """The world of ``seed``: ``num_people`` people, a quarter as many companies, a tenth as
    many towns, a fortieth as many regions (at least 3); a ``heldout_fraction`` of the towns
    (at least one) held out with what lies in them."""
    if num_people < 40:
        raise ValueError(f"research: num_people must be at least 40, got {num_people}")
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"research: heldout_fraction must be in (0, 1), got {heldout_fraction}")
    rng = random.Random(f"asyncrl-research-{seed}-{num_people}")
    taken: set[str] = set()
    regions = _names(rng, max(3, num_people // 40), lambda: f"{_word(rng, 2)} {rng.choice(_REGION_ENDS)}", taken)
    towns = _names(rng, max(4, num_people // 10), lambda: _word(rng, 1) + rng.choice(_TOWN_ENDS), taken)
    industries = {}

    def company() -> str:
        industry, suffix = rng.choice(_INDUSTRIES)
        name = f"{_word(rng, 2)} {suffix}"
        industries[name] = industry
        return name

    companies = _names(rng, max(8, num_people // 4), company, taken)
    people = _names(rng, num_people, lambda: f"{_word(rng, 2)} {_word(rng, 2)}", taken)
    container: dict[str, str] = {}
    for lower, upper in ((towns, regions), (companies, towns), (people, companies)):
        order = list(upper) + [rng.choice(upper) for _ in range(len(lower) - len(upper))]  # none left empty
        rng.shuffle(order)
        container.update(zip(lower, order))
    documents = {p: f"{p} is {_article(job := rng.choice(_JOBS))} {job} who works at {container[p]}." for p in people}
    documents |= {c: f"{c} is {_article(industries[c])} {industries[c]} company based in {container[c]}."
                  for c in companies}
    documents |= {t: f"{t} is a town in the {container[t]} region." for t in towns}
    documents |= {r: f"{r} is a region known for {rng.choice(_FEATURES)}." for r in regions}
    held_towns = set(rng.sample(towns, max(1, round(len(towns) * heldout_fraction))))
    held_companies = {c for c in companies if container[c] in held_towns}
    heldout = frozenset(held_towns | held_companies | {p for p in people if container[p] in held_companies})
    return ResearchWorld({"person": tuple(people), "company": tuple(companies), "town": tuple(towns),
                          "region": tuple(regions)}, container, documents, heldout)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def question_text(subject_kind: str, subject: str, hops: int) -> str:
    """The question from ``subject`` (of ``subject_kind``) ``hops`` links up the chain."""
    asks = {("person", 1): f"Which company does {subject} work at?",
            ("person", 2): f"In which town is the company that {subject} works at based?",
            ("person", 3): f"In which region is the town where {subject}'s employer is based?",
            ("company", 1): f"In which town is {subject} based?",
            ("company", 2): f"In which region is the town where {subject} is based?",
            ("town", 1): f"Which region is {subject} in?"}
    return asks[(subject_kind, hops)]


def iter_research(world: ResearchWorld, seed: int, *, heldout: bool, max_hops: int = 3) -> Iterator[Task]:
    """Endless deterministic questions: hops uniform in ``1..max_hops``, the subject's kind
    uniform among those that many links below regions, the subject uniform among its kind's
    held-out (``heldout``) or other entities."""
    if not 1 <= max_hops <= 3:
        raise ValueError(f"research: max_hops must be in [1, 3], got {max_hops}")
    rng = random.Random(seed)
    pools = {kind: [e for e in world.entities[kind] if (e in world.heldout) == heldout] for kind in KINDS[:3]}
    i = 0
    while True:
        hops = rng.randint(1, max_hops)
        kind = KINDS[rng.randint(0, 3 - hops)]
        chain = [rng.choice(pools[kind])]
        for _ in range(hops):
            chain.append(world.container[chain[-1]])
        yield Task(id=f"research-{'heldout' if heldout else 'train'}-{seed}-{i}",
                   prompt=question_text(kind, chain[0], hops),
                   data={"answer": chain[-1], "hops": hops, "gold_doc_ids": chain[:-1], "entities": chain})
        i += 1


def _negatives(world: ResearchWorld, chain: list[str], rng: random.Random, n: int) -> list[str]:
    """Documents beside the chain: other entities in the same containers (the hard negatives)."""
    near = [e for kind in KINDS[:3] for e in world.entities[kind]
            if e not in chain and world.container.get(e) in chain[1:]]
    rng.shuffle(near)
    return near[:n]


def browsecomp_record(world: ResearchWorld, task: Task, *, num_negatives: int = 3) -> dict[str, Any]:
    """``task`` as a BrowseComp-Plus query record (see the module's docstring)."""
    chain = task.data["entities"]

    def doc(name: str) -> dict[str, str]:
        return {"docid": name, "title": name, "text": world.documents[name]}

    rng = random.Random(task.id)
    return {"query_id": task.id, "query": task.prompt, "answer": task.data["answer"], "hops": task.data["hops"],
            "evidence_docs": [doc(e) for e in chain[:-1]], "gold_docs": [doc(chain[-2])],
            "negative_docs": [doc(e) for e in _negatives(world, chain, rng, num_negatives)]}


def write_research(out_dir: str | Path, *, seed: int = 0, num_people: int = 400, num_train: int = 2000,
                   num_heldout: int = 200, max_hops: int = 3) -> dict[str, Path]:
    """``corpus.jsonl``, ``train.jsonl`` and ``heldout.jsonl`` of the world of ``seed`` under
    ``out_dir``; distinct questions per split. Returns the paths by name."""
    world = build_world(seed, num_people=num_people)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"corpus": out / "corpus.jsonl", "train": out / "train.jsonl", "heldout": out / "heldout.jsonl"}
    names = [e for kind in KINDS for e in world.entities[kind]]
    _write(paths["corpus"], ({"id": e, "title": e, "text": world.documents[e]} for e in names))
    for split, n, held in (("train", num_train, False), ("heldout", num_heldout, True)):
        seen: set[str] = set()
        tasks = []
        stream = iter_research(world, seed * 2 + held, heldout=held, max_hops=max_hops)
        for _ in range(50 * n):  # bounded: a world too small for n distinct questions fails below
            if len(tasks) == n:
                break
            task = next(stream)
            if task.prompt not in seen:
                seen.add(task.prompt)
                tasks.append(task)
        if len(tasks) < n:
            raise ValueError(f"research: only {len(tasks)} distinct {split} questions of the {n} asked; "
                             "raise num_people or ask for fewer")
        _write(paths[split], (browsecomp_record(world, t) for t in tasks))
    return paths


def _write(path: Path, rows: Iterator[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def _doc_ids(row: dict[str, Any], key: str, where: str) -> list[str]:
    docs = row.get(key, [])
    if not isinstance(docs, list):
        raise TaskDataError(f"{where}: {key!r} must be a list of documents, got {type(docs).__name__}")
    ids = []
    for doc in docs:
        doc_id = doc.get("docid", doc.get("id")) if isinstance(doc, dict) else doc
        if isinstance(doc_id, int) and not isinstance(doc_id, bool):
            doc_id = str(doc_id)
        if not isinstance(doc_id, str):
            raise TaskDataError(f"{where}: each of {key!r} must be a document with a 'docid' (or a docid), got "
                                f"{str(doc)[:80]}")
        ids.append(doc_id)
    return ids


def load_research(path: str | Path) -> list[Task]:
    """Tasks from a BrowseComp-Plus-shaped JSONL file: ``query`` (or ``question``) and ``answer``
    required, ``query_id`` (or ``id``; default ``{stem}-{line}``) unique; ``evidence_docs``,
    ``gold_docs``, ``negative_docs`` optional lists of ``{"docid", ...}`` (or bare docids).
    ``Task.data``: ``answer``, ``gold_doc_ids`` (the evidence's ids, in order, as ``multihop``
    names them), ``answer_doc_ids`` (the gold's), ``negative_doc_ids``, and ``hops`` when given.
    A record whose answer no reply could match (``multihop.extract_answer``: at most 8 words
    on one line) is skipped with a warning naming how many, not trained on at reward 0."""
    path = Path(path)
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    skipped = []
    for line_no, where, row in _rows(path, "BrowseComp-Plus"):
        question = _string(row, "query" if "query" in row else "question", where)
        answer = _string(row, "answer", where)
        task_id = _string(row, "query_id" if "query_id" in row else "id", where, default=f"{path.stem}-{line_no}")
        if task_id in first_line:
            raise TaskDataError(f"{where}: duplicate query id {task_id!r} (first on line {first_line[task_id]})")
        first_line[task_id] = line_no
        if extract_answer(answer) is None:
            skipped.append(task_id)
            continue
        data: dict[str, Any] = {"answer": answer, "gold_doc_ids": _doc_ids(row, "evidence_docs", where),
                                "answer_doc_ids": _doc_ids(row, "gold_docs", where),
                                "negative_doc_ids": _doc_ids(row, "negative_docs", where)}
        if "hops" in row:
            data["hops"] = row["hops"]
        tasks.append(Task(id=task_id, prompt=question, data=data))
    if skipped:
        logger.warning("%s: skipped %d queries whose answer is not a short answer (e.g. %s)", path, len(skipped),
                       skipped[0])
    if not tasks:
        raise TaskDataError(f"{path}: no query with a short answer to train on")
    return tasks


def research_splits(path: str | Path | None, validation_path: str | Path | None, num_train: int,
                    num_validation: int, *, train_hops: list[int] | None = None) -> tuple[list[Task], list[Task]]:
    """``task.name: research``: train from ``path``, validation from ``validation_path`` (the
    held-out file: held out by entity, which no cut of one file could do), both
    BrowseComp-Plus-shaped; ``num_train``/``num_validation`` > 0 cap each from the front.

    ``train_hops`` (``task.options.train_hops``): train only on the queries with these hop
    counts; the held-out split keeps every query, so its score still reads the whole task.
    Why: a step samples a handful of queries, and the one-hop ones (answered by the first
    search) pull the policy towards answering after one search, against what the multi-hop
    ones need (examples/deepresearch/README.md, "Training on multi-hop questions only")."""
    if path is None or validation_path is None:
        raise ValueError("task 'research' needs `path` (train queries) and `validation_path` (held-out queries), "
                         "BrowseComp-Plus-shaped JSONL: examples/deepresearch/make_data.py writes both")
    train, validation = load_research(path), load_research(validation_path)
    if train_hops is not None:
        kept = [t for t in train if t.data.get("hops") in train_hops]
        if not kept:
            counts = sorted({t.data.get("hops") for t in train}, key=str)
            raise TaskDataError(f"{path}: no query has a hop count in task.options.train_hops={train_hops} "
                                f"(the file's hop counts: {counts}; a record without `hops` never matches)")
        train = kept
    return train[:num_train] if num_train > 0 else train, validation[:num_validation] if num_validation else validation
