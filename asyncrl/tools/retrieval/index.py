"""BM25 over a document collection, searched many queries at a time.

The library is ``bm25s`` (eager sparse scores, numpy only), chosen over ``rank-bm25`` by
measurement (``python -m asyncrl.tools.retrieval.bench libraries``; the table is in
docs/design.md, "Measurements behind choices in the code"). rank-bm25 builds faster (it
only counts terms; bm25s precomputes every score) but scores a query with a Python loop
over all documents per query term, which many concurrent agents turn into queueing at
tens of thousands of documents; bm25s is also the maintained one.

A batch is scored with ``BM25.get_scores_from_ids`` per query and one top-k selection
(``argpartition``) over the stacked ``(B, num_docs)`` scores, faster than
``BM25.retrieve``, whose top-k selection is slower. Scoring one query at a time costs the
same per query: adding a query's postings is memory-bound, batched or not. What batching
buys is in the service (``service.py``).
Tokens: lowercased ``\\w+`` runs less English stopwords, no stemming. A document's
``title`` is indexed with its text (one field, title first), as BEIR-style retrieval does: a
search for an entity's name then ranks its own page above the pages that merely mention it
(in the ``multihop`` corpus, a person's page and the pages of the people they mentor have
the name once each; without the title the shorter page wins). Documents that share no
term with the query score 0 and are not returned.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from asyncrl.jsonl import JsonlError, iter_jsonl
from asyncrl.tools.retrieval.types import Document, Hit

try:
    import bm25s
    from bm25s.stopwords import STOPWORDS_EN
except ImportError as exc:  # the client side needs no index: only building one asks for bm25s
    _BM25S_MISSING: ImportError | None = exc
    STOPWORDS_EN = ()
else:
    _BM25S_MISSING = None

_STOPWORDS = frozenset(STOPWORDS_EN)  # Lucene's 33 English ones
_WORD = re.compile(r"\w+")
_MAX_SCORES = 2**24  # floats of (queries, documents) scores held at once (64 MiB); larger batches go in chunks


def load_documents(path: str | Path) -> list[Document]:
    """The rows of a JSONL file, each an object with a string ``id`` (unique), a string
    ``text`` and optionally a string ``title``; other fields are ignored. Raises
    :class:`JsonlError` naming the file and line."""
    documents, seen = [], {}
    for line_no, row in iter_jsonl(path):
        for key in ("id", "text"):
            if not isinstance(row.get(key), str):
                raise JsonlError(f"{path}, line {line_no}: {key!r} must be a string, got {row.get(key)!r:.60}")
        if row["id"] in seen:
            raise JsonlError(f"{path}, line {line_no}: id {row['id']!r} was already used on line {seen[row['id']]}")
        if not isinstance(row.get("title", ""), str):
            raise JsonlError(f"{path}, line {line_no}: 'title' must be a string, got {row['title']!r:.60}")
        seen[row["id"]] = line_no
        documents.append(Document(row["id"], row["text"], row.get("title", "")))
    return documents


def tokenize(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOPWORDS]


class SearchIndex:
    """What the service searches — ``BM25Index`` here, ``DenseIndex`` and ``HybridIndex`` in
    ``dense.py``: immutable ``documents``, searched a batch of queries at a time
    (``_search_batch``, given ``1 <= k <= len(self)``)."""

    documents: tuple[Document, ...]

    def __len__(self) -> int:
        return len(self.documents)

    def search(self, query: str, k: int) -> list[Hit]:
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """The best ``k`` documents for each query, best first."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        return self._search_batch(queries, min(k, len(self.documents))) if queries else []

    def _search_batch(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        raise NotImplementedError

    def _hits(self, top: np.ndarray, scores: np.ndarray, *, positive: bool = False) -> list[list[Hit]]:
        """Hits from per-query document indices and their scores (``positive``: those > 0 only)."""
        return [[Hit(id=self.documents[i].id, score=float(s), text=self.documents[i].text)
                 for i, s in zip(row.tolist(), row_scores.tolist(), strict=True) if s > 0 or not positive]
                for row, row_scores in zip(top, scores, strict=True)]


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``scores`` (B, n), the indices and scores of the best ``k`` (≤ n), best first,
    ties by lower index: argpartition then a sort of the k, O(n) where a full sort is not."""
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # (B, k), unordered
    top_scores = np.take_along_axis(scores, top, axis=1)
    order = np.lexsort((top, -top_scores), axis=1)  # by score descending, then by document index
    return np.take_along_axis(top, order, axis=1), np.take_along_axis(top_scores, order, axis=1)


class BM25Index(SearchIndex):
    """An immutable BM25 index (bm25s' defaults: Lucene's variant, ``k1`` 1.5, ``b`` 0.75).
    Read-only once built, so it may be searched from a worker thread."""

    def __init__(self, documents: Iterable[Document], *, k1: float = 1.5, b: float = 0.75) -> None:
        if _BM25S_MISSING is not None:
            raise ImportError('the retrieval index needs bm25s: pip install -e ".[tools]"') from _BM25S_MISSING
        self.documents = tuple(documents)
        if not self.documents:
            raise ValueError("a BM25 index needs at least one document")
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        self._bm25.index([tokenize(f"{d.title} {d.text}") for d in self.documents], show_progress=False)

    def _search_batch(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        chunk = max(1, _MAX_SCORES // len(self.documents))
        return [hits for start in range(0, len(queries), chunk)
                for hits in self._score(queries[start:start + chunk], k)]

    def _score(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        scores = np.stack([self._bm25.get_scores_from_ids(self._bm25.get_tokens_ids(tokenize(q)))
                           for q in queries])  # (B, num_docs)
        return self._hits(*top_k(scores, k), positive=True)
