"""Search for agents: a BM25, dense or hybrid service over a document collection (``service.py``,
batched, runnable as ``python -m asyncrl.tools.retrieval --docs FILE.jsonl``; ``dense.py``) and the
client an agent calls it with (``client.py``, one endpoint or several), whose failures come back as
text for the model; ``refine.py`` a refine model, ``duplicates.py`` the duplicate-search guard.

Building an index needs ``bm25s`` (``pip install -e ".[tools]"``); the client does not."""

from asyncrl.tools.retrieval.client import EndpointPool, RetrievalClient, RetrievalError, format_hits
from asyncrl.tools.retrieval.index import BM25Index, SearchIndex, load_documents
from asyncrl.tools.retrieval.service import MAX_K, RetrievalService
from asyncrl.tools.retrieval.types import Document, Hit

__all__ = ["MAX_K", "BM25Index", "Document", "EndpointPool", "Hit", "RetrievalClient", "RetrievalError",
           "RetrievalService", "SearchIndex", "format_hits", "load_documents"]
