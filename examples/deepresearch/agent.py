"""The DeepResearch agent on SmolLM2-135M-Instruct: search (hybrid retrieval) + refine, with the
duplicate-search guard. Written against the official OpenAI SDK; asyncrl trains it unchanged
(``workflow.agent: examples/deepresearch/agent.py:run``).

One tool, ``search(query)``. What the model reads as its result:

1. the duplicate guard first (``asyncrl/tools/retrieval/duplicates.py``): a query that repeats
   one of the episode's earlier searches gets the note ``duplicate search: ...`` and no search
   is made (the gateway counts it: ``rollout/duplicate_searches``);
2. else the retrieval service's top ``SEARCH_K`` hits (their texts, one per line), from
   every endpoint in ``ASYNCRL_RETRIEVAL_URL`` (comma-separated: least-loaded first, a dead
   one skipped); unset, the agent starts its own service per process over the task's
   corpus, with ``ASYNCRL_RESEARCH_INDEX`` (``hybrid``, the default; ``dense``; ``bm25``) and
   ``ASYNCRL_RESEARCH_ENCODER`` (``minilm`` when the research extra is installed, else the
   cached SmolLM2's pooled hidden states; or a model path);
3. then, when ``ASYNCRL_REFINE_URL`` names an OpenAI-compatible server (``asyncrl serve``,
   vLLM), the refine model's condensation of those hits (``asyncrl/tools/retrieval/refine.py``;
   ``ASYNCRL_REFINE_ON_FAILURE`` ``raw`` — the default — or ``fail``;
   ``ASYNCRL_REFINE_TIMEOUT_S``, default 30). The text is the tool message: environment tokens,
   never trained.

An episode ends at an ``Answer:`` line or after the search agent's ``MAX_TURNS`` (4) model calls;
before the last of them the agent says ``LAST_CALL`` ("No searches left. Reply with one line:
Answer: <name>"). Why: a policy that searches on every call never answers, every reward of its
group is 0 and GRPO has nothing to reward; told, some episodes answer and the right ones win
(README.md, "Asked for the answer at the last call"). The SFT traces (``make_traces.py``) hold
the same note. That last reply is made to begin with ``ASYNCRL_ANSWER_PREFILL`` (default
``Answer:``; empty: off), a prefill the model continues, so it names an answer whatever the
policy has drifted into (README.md, "The last reply made to answer").

The reward is ``multihop_reward`` of the last reply (the ``Answer:`` line equals the answer)
less ``ASYNCRL_DUPLICATE_PENALTY`` (default 0) per duplicate search and less
``ASYNCRL_UNANSWERED_PENALTY`` (default 0) when it has no answer (``episode_reward``): workflow options do not
reach an ``openai_agent``, so the agent reads its settings from the environment, as the search
agent does. The corpus is ``ASYNCRL_RESEARCH_DATA``/corpus.jsonl (default: ``data/`` beside
this file, written by ``make_data.py``). ``ASYNCRL_RETRIEVAL_LATENCY_S`` (default 0) is added
to every search of the agent's own service, to stand in for a remote search API; with
``ASYNCRL_RETRIEVAL_LATENCY_P99_S`` it is the median of a lognormal with that 99th percentile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import threading
import weakref
from pathlib import Path

from asyncrl.frozen.client import FrozenModel
from asyncrl.plugins import load_named
from asyncrl.tasks.multihop import extract_answer, multihop_reward
from asyncrl.tools.retrieval import RetrievalClient, RetrievalError
from asyncrl.tools.retrieval.duplicates import DuplicateGuard
from asyncrl.tools.retrieval.refine import Refiner

# the search agent's SDK client, service launcher and conversation loop (the same module object asyncrl loads)
plain = sys.modules[load_named(f"{Path(__file__).parents[1] / 'search_agent' / 'agent.py'}:run",
                               key="deepresearch").__module__]

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the knowledge base; returns the best matching documents.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
SEARCH_K = 3
INSTRUCTION = ("Use the search tool to look up each fact you need, one search at a time. "
               "When you know the answer, reply with one line: Answer: <name>")
LAST_CALL = "No searches left. Reply with one line: Answer: <name>"  # before the last of MAX_TURNS calls
DATA = Path(os.environ.get("ASYNCRL_RESEARCH_DATA") or Path(__file__).with_name("data"))

_lock = threading.Lock()
_urls: list[str] | None = None
_refiners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> Refiner (its session's loop)


def encoder_name() -> str:
    """``ASYNCRL_RESEARCH_ENCODER``, else MiniLM when installed, else the cached SmolLM2 (pooled)."""
    from asyncrl.model_store import cached_model
    from asyncrl.tools.retrieval.dense import minilm_available

    if name := os.environ.get("ASYNCRL_RESEARCH_ENCODER"):
        return name
    if minilm_available():
        return "minilm"
    path = cached_model("smollm2-135m-instruct")
    if path is None:
        raise RuntimeError("no encoder for dense retrieval: pip install -e '.[research]', or "
                           "`asyncrl models get smollm2-135m-instruct`, or ASYNCRL_RESEARCH_INDEX=bm25")
    return str(path)


def retrieval_urls() -> list[str]:
    """``ASYNCRL_RETRIEVAL_URL`` (comma-separated), or this process's own service, started once."""
    global _urls
    if spec := os.environ.get("ASYNCRL_RETRIEVAL_URL"):
        return [u.strip() for u in spec.split(",") if u.strip()]
    with _lock:
        if _urls is None:
            index = os.environ.get("ASYNCRL_RESEARCH_INDEX", "hybrid")
            args = ["asyncrl.tools.retrieval", "--docs", str(DATA / "corpus.jsonl"), "--port", "0", "--index", index,
                    "--latency-s", os.environ.get("ASYNCRL_RETRIEVAL_LATENCY_S", "0")]
            if p99 := os.environ.get("ASYNCRL_RETRIEVAL_LATENCY_P99_S"):  # lognormal, the median as above
                args += ["--latency-p99-s", p99]
            if index != "bm25":
                args += ["--encoder", encoder_name()]
            _urls = [plain.start_subprocess_service(args)]
    return _urls


def refiner() -> Refiner | None:
    """This event loop's refine client, or None when no ``ASYNCRL_REFINE_URL`` is set."""
    url = os.environ.get("ASYNCRL_REFINE_URL")
    if not url:
        return None
    loop = asyncio.get_running_loop()
    if loop not in _refiners:
        model = FrozenModel("refine", url, model=os.environ.get("ASYNCRL_REFINE_MODEL"),
                            timeout_s=float(os.environ.get("ASYNCRL_REFINE_TIMEOUT_S", "30")), retries=1)
        _refiners[loop] = Refiner(model, on_failure=os.environ.get("ASYNCRL_REFINE_ON_FAILURE", "raw"))
    return _refiners[loop]


async def search(retrieval: RetrievalClient, guard: DuplicateGuard, question: str, arguments: str) -> str:
    """The tool's result as the model reads it; never raises (a failure is text for the model)."""
    if (query := plain.query_of(arguments)) is None:
        return "search needs a query"
    if note := guard.check(query):
        return note
    try:
        hits = await retrieval.search(query, SEARCH_K)
    except RetrievalError as exc:
        return f"search failed: {exc}"
    documents = "\n".join(" ".join(hit["text"].split()) for hit in hits) or "no results"
    refine = refiner()
    return documents if refine is None or not hits else await refine.refine(question, documents)


async def run(task, base_url: str) -> float:
    urls = _urls if _urls is not None and "ASYNCRL_RETRIEVAL_URL" not in os.environ \
        else await asyncio.to_thread(retrieval_urls)  # the first episode starts the service off the event loop
    guard = DuplicateGuard()

    async def run_tool(call) -> str:
        if call.function.name != "search":
            return f"unknown tool: {call.function.name}"
        return await search(retrieval, guard, task.prompt, call.function.arguments)

    asked = dataclasses.replace(task, prompt=f"{task.prompt}\n{INSTRUCTION}")
    async with RetrievalClient(urls, timeout_s=10.0, retries=2) as retrieval:
        final = await plain.converse_with_tools(plain.sdk_client(base_url), asked, TOOLS, run_tool,
                                                last_call=LAST_CALL,
                                                answer_prefill=os.environ.get("ASYNCRL_ANSWER_PREFILL", "Answer:"))
    return episode_reward(task, final, guard.duplicates,
                          duplicate_penalty=float(os.environ.get("ASYNCRL_DUPLICATE_PENALTY", "0")),
                          unanswered_penalty=float(os.environ.get("ASYNCRL_UNANSWERED_PENALTY", "0")))


def episode_reward(task, final: str, duplicates: int, duplicate_penalty: float = 0.0,
                   unanswered_penalty: float = 0.0) -> float:
    """``multihop_reward`` of the last reply, less ``duplicate_penalty`` per duplicate search and
    ``unanswered_penalty`` when the last reply commits to no answer (``extract_answer``, the
    reward's own reading: a tool call, a paragraph; the episode searched on after ``LAST_CALL``).

    Why the second: without it an episode that ignores the last-call note scores what a wrong
    answer scores (0), so a drift into searching on every call costs nothing until a whole
    group has stopped answering — and then GRPO has nothing left to prefer (README.md, "Every
    hop count in training: looped"). With it, answering, even wrongly, beats not answering
    while some of a group still answer. It rewards no answer over another: a guess without a
    search still scores 0 unless right."""
    unanswered = 0.0 if extract_answer(final) is not None else unanswered_penalty
    return multihop_reward(task, final) - duplicate_penalty * duplicates - unanswered
