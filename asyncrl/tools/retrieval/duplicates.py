"""The duplicate-search guard: a search an episode has already made is answered with a note,
not with the same results again.

A query is reduced to its set of index tokens (``index.tokenize``: lower case, ``\\w+``
runs, Lucene's English stopwords dropped), so case, punctuation, word order and filler
words do not make a query new. Two queries are the same search when the Jaccard
similarity of those sets, ``|A ∩ B| / |A ∪ B|``, is at least ``threshold`` (default 0.8):
"Which town is Alma Reyes in?" and "alma reyes town which" are one search (1.0);
"Alma Reyes" and "Alma Reyes town" are not (0.67): the second adds a word that can change
the hits. A query of stopwords only (an empty set) repeats only the same normalised text.

The note starts with ``types.DUPLICATE_SEARCH`` ("duplicate search:"), which is how the
gateway counts it per episode (``AgentDiagnostics.duplicate_searches``, the step row's
``rollout/duplicate_searches``) without knowing the agent; it is not a tool error.
One guard per episode: it keeps the episode's queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.tools.retrieval.index import tokenize
from asyncrl.types import DUPLICATE_SEARCH

DEFAULT_THRESHOLD = 0.8


def query_terms(query: str) -> frozenset[str]:
    return frozenset(tokenize(query))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """|a ∩ b| / |a ∪ b|; two empty sets are 1.0 (nothing tells them apart)."""
    return len(a & b) / len(a | b) if a | b else 1.0


@dataclass
class DuplicateGuard:
    """An episode's searches; :meth:`check` says whether a new one repeats one of them."""

    threshold: float = DEFAULT_THRESHOLD
    queries: list[tuple[str, frozenset[str]]] = field(default_factory=list)
    duplicates: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"the duplicate threshold must be in (0, 1], got {self.threshold}")

    def check(self, query: str) -> str | None:
        """The note for a repeated search (counted), or None for a new one (remembered)."""
        terms = query_terms(query)
        text = " ".join(query.lower().split())
        for earlier, earlier_terms in self.queries:
            same = (text == " ".join(earlier.lower().split()) if not (terms or earlier_terms)
                    else jaccard(terms, earlier_terms) >= self.threshold)
            if same:
                self.duplicates += 1
                return (f"{DUPLICATE_SEARCH} you already searched for {earlier!r}; its results are above. "
                        "Search for something else, or answer.")
        self.queries.append((query, terms))
        return None
