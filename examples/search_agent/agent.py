"""A multi-hop search agent written against the official OpenAI SDK, as you would write your own.

It asks the model the question ("Which region is P3K in?"), runs the ``search`` tool the
model calls (BM25 over the ``multihop`` task's invented world, through
``asyncrl.tools.retrieval``), and stops at a reply with an ``Answer: <id>`` line or after
``MAX_TURNS`` model calls. A reply with neither a tool call nor an answer gets a short
nudge (``NUDGE``) and the next turn. The reward is ``multihop_reward`` of the last reply:
1 for the right identifier, else 0. asyncrl trains it unchanged
(``workflow.agent: examples/search_agent/agent.py:run``).

Where the retrieval service comes from:

- ``ASYNCRL_RETRIEVAL_URL`` set: that service (one started by hand; see the README).
- otherwise the agent starts one itself, once per process, as its own subprocess
  (``python -m asyncrl.tools.retrieval --docs <corpus> --port 0``), and terminates it at
  interpreter exit. Each process runs its own: with ``runtime: ray``, one per rollout worker.
  Its corpus is ``multihop_corpus(**options)`` written to the temp directory, with the
  options read as JSON from ``ASYNCRL_MULTIHOP_OPTIONS`` (default ``{}``, the task's
  defaults): set it to the config's ``task.options`` when those change the corpus
  (``corpus_seed``, ``num_people``). ``ASYNCRL_RETRIEVAL_LATENCY_S`` (default 0.02) is
  added to every search, to stand in for a real search backend.

``ASYNCRL_SEARCH_OFF=1`` makes every search find nothing: what a policy scores without
the tool (measured ≈ 0; the README of this folder has the figure).

Context: a tool result is the text of the top ``SEARCH_K`` hits, one per line, so a
three-search episode is ~450 characters, well inside the 512 positions of the shipped
``search-tiny``; a call the gateway refuses because the conversation no longer fits ends
the episode like the turn limit does.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
from openai import AsyncOpenAI

from asyncrl.rollout.gateway import set_turn_reward
from asyncrl.tasks.multihop import multihop_corpus, multihop_reward, write_corpus
from asyncrl.tools.retrieval import RetrievalClient, RetrievalError

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the knowledge base; returns the best matching documents.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
MAX_TURNS = 4  # three searches and the answer
SEARCH_K = 3
MAX_HIT_CHARS = 40  # a document ("P3K is in C7M.") is 14 characters
HOP_REWARD = 0.2  # run_with_turn_rewards: a search's turn, per identifier of the chain it first shows
_ANSWER_LINE = re.compile(r"\banswer\s*:", re.IGNORECASE)  # as multihop.extract_answer reads it
NUDGE = "Search with the search tool, or reply 'Answer: <id>'."

_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> AsyncOpenAI
_service_lock = threading.Lock()
_service_url: str | None = None


def is_answer(text: str) -> bool:
    """Whether a reply commits to an answer by the convention: an ``Answer:`` line."""
    return _ANSWER_LINE.search(text) is not None


def sdk_client(base_url: str) -> AsyncOpenAI:
    """An SDK client costs ~20 ms to make (more than a reply of the tiny model) and keeps a
    connection pool tied to the event loop that first used it: one per loop, pointed at
    each session by a cheap copy."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=0)
    return _clients[loop].with_options(base_url=base_url)


def retrieval_url() -> str:
    """``ASYNCRL_RETRIEVAL_URL``, or the URL of this process's own service, started on first use."""
    global _service_url
    if url := os.environ.get("ASYNCRL_RETRIEVAL_URL"):
        return url
    with _service_lock:
        if _service_url is None:
            _service_url = _start_service()
    return _service_url


def corpus_path(options: dict) -> Path:
    """The corpus of ``multihop_corpus(**options)`` as JSONL in the temp directory, written once
    (atomically: several processes may write it at once). Named by its content, so a file
    left by another version of the task is never served."""
    docs = multihop_corpus(**options)
    key = hashlib.sha256(json.dumps(docs, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / "asyncrl-search-agent" / f"multihop-{key}.jsonl"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        write_corpus(partial, docs)
        os.replace(partial, path)
    return path


def _start_service() -> str:
    options = json.loads(os.environ.get("ASYNCRL_MULTIHOP_OPTIONS") or "{}")
    latency = os.environ.get("ASYNCRL_RETRIEVAL_LATENCY_S", "0.02")
    return start_subprocess_service(["asyncrl.tools.retrieval", "--docs", str(corpus_path(options)),
                                     "--port", "0", "--latency-s", latency])


def start_subprocess_service(module_and_args: list[str]) -> str:
    """``python -m MODULE ARGS`` as this process's subprocess, stopped at interpreter exit;
    returns the URL it prints alone on its first line once listening."""
    process = subprocess.Popen([sys.executable, "-m", *module_and_args], stdout=subprocess.PIPE, text=True)
    atexit.register(_stop_service, process)
    url = process.stdout.readline().strip()
    if not url:
        raise RuntimeError(f"{module_and_args[0]} exited with {process.wait()} before printing its URL")
    return url


def _stop_service(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def format_result(texts: list[str]) -> str:
    """What the model reads: the hits' texts, best first, one per line."""
    return "\n".join(" ".join(text.split())[:MAX_HIT_CHARS] for text in texts) or "no results"


def query_of(arguments: str) -> str | None:
    """The call's non-blank ``query`` argument, or None."""
    try:
        query = json.loads(arguments).get("query")
    except (ValueError, AttributeError):
        return None
    return query if isinstance(query, str) and query.strip() else None


async def search(retrieval: RetrievalClient, arguments: str) -> str:
    """The tool's result as the model reads it; never raises (a failure is text for the model)."""
    if (query := query_of(arguments)) is None:
        return "search needs a query"
    if os.environ.get("ASYNCRL_SEARCH_OFF") == "1":
        return format_result([])
    try:
        hits = await retrieval.search(query, SEARCH_K)
    except RetrievalError as exc:
        return f"search failed: {exc}"
    return format_result([hit["text"] for hit in hits])


async def run(task, base_url: str) -> float:
    if _service_url is None and "ASYNCRL_RETRIEVAL_URL" not in os.environ:
        await asyncio.to_thread(retrieval_url)  # the first episode starts the service off the event loop
    client = sdk_client(base_url)
    # one retrieval session per episode, closed with it (a session per loop would outlive its loop)
    async with RetrievalClient(retrieval_url(), timeout_s=5.0, retries=2) as retrieval:
        final = await converse(client, retrieval, task)
    return multihop_reward(task, final)


async def run_with_turn_rewards(task, base_url: str) -> float:
    """:func:`run`, and a per-turn reward beside the outcome: each search whose result first
    shows an identifier of the question's chain (the next hop's, or the answer) earns the
    turn that asked it ``HOP_REWARD`` per identifier, posted to the gateway through the SDK
    client (``asyncrl.rollout.gateway.set_turn_reward``). A three-hop question answered
    right after three useful searches returns 1 and earned 3 × ``HOP_REWARD`` on the way;
    a critic's GAE puts each on its turn's last token, a group-relative estimator counts the
    episode's total (docs/critic.md, "Multi-turn: per-turn rewards")."""
    if _service_url is None and "ASYNCRL_RETRIEVAL_URL" not in os.environ:
        await asyncio.to_thread(retrieval_url)
    client = sdk_client(base_url)
    chain = task.data["entities"][1:]  # what a search can reveal, the answer last
    seen: set[str] = set()
    earned: dict[int, float] = {}  # turn -> its reward so far (a reply may make several calls)

    async with RetrievalClient(retrieval_url(), timeout_s=5.0, retries=2) as retrieval:
        async def run_tool(call) -> str:
            if call.function.name != "search":
                return f"unknown tool: {call.function.name}"
            result = await search(retrieval, call.function.arguments)
            found = [e for e in chain if e not in seen and e in result]
            if found:
                seen.update(found)
                turn = (await set_turn_reward(client, HOP_REWARD * len(found)))["turn"]  # the latest reply's
                earned[turn] = earned.get(turn, 0.0) + HOP_REWARD * len(found)
                if earned[turn] != HOP_REWARD * len(found):  # its second call that found one: the sum
                    await set_turn_reward(client, earned[turn], turn=turn)
            return result

        final = await converse_with_tools(client, task, TOOLS, run_tool)
    return multihop_reward(task, final)


async def converse(client: AsyncOpenAI, retrieval: RetrievalClient, task) -> str:
    """The conversation with the retrieval client's ``search``; returns the last reply's text."""
    async def run_tool(call) -> str:
        if call.function.name != "search":
            return f"unknown tool: {call.function.name}"
        return await search(retrieval, call.function.arguments)

    return await converse_with_tools(client, task, TOOLS, run_tool)


async def converse_with_tools(client: AsyncOpenAI, task, tools: list[dict],
                              run_tool: Callable[[Any], Awaitable[str]], last_call: str | None = None,
                              answer_prefill: str | None = None) -> str:
    """The conversation, whoever runs the tools (``run_tool(call)`` is a call's ``tool`` message
    content: here or ``agent_mcp.py``); returns the last reply's text.

    ``last_call``, when given, is a user message put before the last model call (after a tool
    result; in place of a nudge): "no searches left, answer now". Why: a policy that searches on
    every call never answers, its group's rewards are all 0 and it has nothing to learn from.
    ``answer_prefill`` ("Answer:"), with it, makes that last reply begin with the text (vLLM's
    ``continue_final_message``, which the gateway serves): the model writes only what follows,
    so the last reply is an answer whatever the policy has drifted into, and the prefill's
    tokens are the environment's, never trained. The reply returned is the prefill and what
    the model wrote after it."""
    messages = [{"role": "user", "content": task.prompt}]
    final = ""
    for turn in range(MAX_TURNS):
        prefill = None
        if last_call is not None and turn == MAX_TURNS - 1 and turn > 0:
            if messages[-1]["role"] == "user":  # the nudge: say this instead
                messages[-1] = {"role": "user", "content": last_call}
            else:
                messages.append({"role": "user", "content": last_call})
            prefill = answer_prefill or None
        try:
            if prefill is None:
                reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
            else:
                reply = await client.chat.completions.create(
                    model="policy", messages=[*messages, {"role": "assistant", "content": prefill}], tools=tools,
                    extra_body={"continue_final_message": True, "add_generation_prompt": False})
        except openai.BadRequestError as exc:
            if "context" not in exc.message:  # not "the conversation no longer fits": a bug, say so
                raise
            break
        message = reply.choices[0].message
        final = (prefill or "") + (message.content or "")
        if message.tool_calls:
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await run_tool(call)})
        elif is_answer(final):
            break
        else:
            messages += [{"role": "assistant", "content": final}, {"role": "user", "content": NUDGE}]
    return final
