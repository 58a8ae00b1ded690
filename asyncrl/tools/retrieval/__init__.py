"""Search for agents: a BM25 service over a document collection (``service.py``, batched,
runnable as ``python -m asyncrl.tools.retrieval --docs FILE.jsonl``) and the client an
agent calls it with (``client.py``), whose failures come back as text for the model.

Building an index needs ``bm25s`` (``pip install -e ".[tools]"``); the client does not."""

from asyncrl.tools.retrieval.client import RetrievalClient, RetrievalError, format_hits
from asyncrl.tools.retrieval.index import BM25Index, load_documents
from asyncrl.tools.retrieval.service import MAX_K, RetrievalService
from asyncrl.tools.retrieval.types import Document, Hit

__all__ = ["MAX_K", "BM25Index", "Document", "Hit", "RetrievalClient", "RetrievalError", "RetrievalService",
           "format_hits", "load_documents"]
