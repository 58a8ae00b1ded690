"""What the retrieval service and its client exchange. A hit is a ``TypedDict``: it is
the JSON object the service sends, typed for the agent that reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str = ""  # indexed with the text, so a search for a name ranks that name's own page first


class Hit(TypedDict):
    id: str
    score: float  # BM25 (> 0: only documents sharing a term with the query are hits), cosine, or fused rank
    text: str
