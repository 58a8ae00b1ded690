"""One episode's conversation through the gateway, recorded token-exact.

A session wraps the episode's :class:`~asyncrl.rollout.client.LLMClient`, so every call is
recorded as a workflow's would be (prompt ids, sampled ids, behavior logprobs, versions,
loss mask) and an abort for a weight sync is resumed inside the client, out of the
agent's sight. What the session adds is the translation an OpenAI agent needs:

- the agent sends our earlier replies back in OpenAI form (``content`` and/or
  ``tool_calls``, in whatever JSON spacing its SDK writes). Each one that means the same
  as a reply we gave is swapped for the reply exactly as it was sampled, so the client
  sees a conversation that extends the recorded one and continues the trajectory with
  the sampled ids untouched — model output is never re-tokenized;
- in a training session the sampling the learner must reproduce is the run's: an
  agent's ``temperature`` or ``top_p`` that would change the sampled distribution is
  overridden, its ``seed`` ignored, and both said in the reply's ``system_fingerprint``
  and counted; ``max_tokens`` is honoured up to the run's cap, ``stop`` strings always;
- ``tool_choice`` ``required`` or naming a function forces the opening of a call, written
  as environment tokens before the model samples the rest (``tool_choice.py``); so does a
  prefill (vLLM's ``continue_final_message``, an Anthropic request ending on the
  assistant's text): the reply handed back is the continuation, the turn recorded (and
  matched when the agent sends it back whole) is the prefill and the continuation;
- under a template with ``<think>``, the reasoning goes to ``reasoning_content`` and only
  the rest is read for tool calls (``reasoning.py``); the trajectory keeps it all.

A large prompt is tokenized on the gateway's threads first and refused there if it
cannot fit the context (``_check_fits``), so the event loop the episode shares with
every other session only ever tokenizes a prompt known to fit.

It also keeps the episode's :class:`~asyncrl.types.AgentDiagnostics`, as far as the
gateway can see them: calls, parsed tool calls, tool results the agent sends back marked
as failures, and the time between handing out a reply and receiving the next call — the
agent's tools and its own code, as seen from here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from concurrent.futures import Executor
from typing import Any

import asyncrl.rollout.gateway.prompt_size as prompt_size
import asyncrl.rollout.gateway.reasoning as reasoning
import asyncrl.rollout.gateway.tool_choice as tool_choice
from asyncrl.rollout.client import LLMClient, Response
from asyncrl.engine.protocol import PromptTooLongError, TokenSink
from asyncrl.json_api import Refused
from asyncrl.rollout.gateway.openai_api import ChatRequest, CompletionRequest, _Request, assistant_message
from asyncrl.rollout.gateway.tool_calls import ParsedReply, ToolFormat
from asyncrl.types import AgentDiagnostics, SamplingParams, is_duplicate_search, is_tool_error


def _canonical(message: dict[str, Any]) -> str:
    """What an assistant message means: its text and its calls' names and parsed arguments."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError, RecursionError):  # not JSON, or nested past the parser: kept as sent
            arguments = fn.get("arguments")
        calls.append([fn.get("name"), arguments])
    return json.dumps([(message.get("content") or "").strip(), calls], sort_keys=True)


@dataclasses.dataclass
class CallResult:
    response: Response
    parsed: ParsedReply  # the reply after its reasoning, read for tool calls
    notes: list[str]  # what of the request was not honoured, and why
    reasoning: str | None = None  # what the model wrote inside <think>…</think> (reasoning.py)

    @property
    def message(self) -> dict[str, Any]:
        return assistant_message(self.parsed, self.reasoning)


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What the session does with a request, decided before anything is sampled (a stream
    needs it before the first token): the sampling, what of the request is not honoured,
    the tool choice and how the template carries reasoning."""

    sampling: SamplingParams
    notes: list[str]  # what of the request was not honoured, and why
    choice: tool_choice.ToolChoice = tool_choice.AUTO
    thinking: reasoning.Thinking | None = None
    prefill: str | None = None  # the assistant text the reply continues (``continue_final_message``)

    @property
    def opening(self) -> str | None:
        """The text the reply is made to begin with: a prefill as the agent wrote it, or a
        forced call's opening. Where the generation prompt opens ``<think>``, a forced call
        closes it first: the call is the answer, after an empty reasoning."""
        if self.prefill:
            return self.prefill
        if self.choice.opening is None or self.thinking is None or not self.thinking.opened_by_prompt:
            return self.choice.opening
        return reasoning.END_THINK + "\n\n" + self.choice.opening


def read_calls(parser: ToolFormat, answer: str, response: Response,
               thinking: reasoning.Thinking | None) -> ParsedReply:
    """The reply's tool calls, read from ``answer`` (its text without special tokens, after
    any reasoning). Where that finds none but the reply holds special tokens, it is read
    again with them (``response.recorded_text``): a format whose call marker is a special
    token (Mistral's ``[TOOL_CALLS]``, ``[ARGS]``) loses it in the plain text, and a call the
    model really wrote would come back as prose. Only calls found that way are taken, so a
    reply the plain text reads is read as before."""
    parsed = parser(answer)
    if parsed.tool_calls or parsed.error is not None or response.recorded_text is None:
        return parsed
    special = parser(reasoning.split(response.recorded_text, thinking)[1])
    return special if special.tool_calls else parsed


class Session:
    def __init__(self, session_id: str, client: LLMClient, parser: ToolFormat, *, training: bool,
                 tokenize_pool: Executor | None = None) -> None:
        """``tokenize_pool``: where a large prompt is tokenized (the gateway's threads); None:
        on the loop, as the client does."""
        self.id, self.client, self.parser, self.training = session_id, client, parser, training
        self.tokenize_pool = tokenize_pool
        self.replies: dict[str, dict[str, Any]] = {}  # canonical OpenAI form -> the reply as recorded
        self.responses: dict[str, list[dict[str, Any]]] = {}  # Responses API: response id -> its conversation
        self.tool_parse_errors = 0
        self.sampling_overrides = 0
        self.calls = self.tool_calls = self.model_tokens = 0
        self.tool_latency_s = 0.0
        self.tool_results: set[tuple[str | None, str]] = set()  # (tool_call_id, content) seen in requests
        self.failed_tool_results = 0
        self.duplicate_searches = 0
        self.last_reply_called_tools = False
        self._in_flight = 0
        self._replied_at: float | None = None  # when the last reply was handed out, none in flight since

    def diagnostics(self) -> AgentDiagnostics:
        """The episode's diagnostics. ``cut_by_turn_limit``: the last reply asked for tools
        and the agent stopped there — its turn budget (which only the agent knows) ran
        out while the model still wanted to act. A tool result is only seen when the
        agent sends it back, so those of that last reply are not counted."""
        return AgentDiagnostics(
            turns=self.calls, tool_calls=self.tool_calls,
            tool_errors=self.failed_tool_results + self.tool_parse_errors,
            tool_latency_s=self.tool_latency_s, model_tokens=self.model_tokens,
            cut_by_turn_limit=self.last_reply_called_tools, duplicate_searches=self.duplicate_searches)

    def _call_starts(self, messages: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        if self._replied_at is not None and self._in_flight == 0:  # calls at once overlap: no gap
            self.tool_latency_s += now - self._replied_at
        self._in_flight += 1
        for m in messages:  # the agent resends the conversation: count each tool result once
            if m["role"] == "tool" and (key := (m.get("tool_call_id"), m["content"])) not in self.tool_results:
                self.tool_results.add(key)
                self.failed_tool_results += is_tool_error(m["content"])
                self.duplicate_searches += is_duplicate_search(m["content"])

    def _call_ends(self, response: Response | None, parsed: ParsedReply | None) -> None:
        self._in_flight -= 1
        self._replied_at = time.monotonic() if self._in_flight == 0 else None
        if response is not None and parsed is not None:
            self.calls += 1
            self.tool_calls += len(parsed.tool_calls)
            self.model_tokens += len(response.token_ids)
            self.last_reply_called_tools = bool(parsed.tool_calls)

    def sampling(self, request: _Request, default_max_tokens: int) -> tuple[SamplingParams, list[str]]:
        """The sampling for ``request`` and what of it was not honoured. Penalties are never
        applied (the engine has none) and always said so."""
        base = self.client.sampling
        notes = [f"{name} ignored" for name in ("frequency_penalty", "presence_penalty", "top_k")
                 if getattr(request, name, None)]
        if not self.training:  # nobody trains on it: the request's sampling, as asked
            return dataclasses.replace(
                base, temperature=base.temperature if request.temperature is None else request.temperature,
                top_p=request.top_p or 1.0, max_tokens=request.token_cap or default_max_tokens,
                seed=base.seed if request.seed is None else request.seed % 2**63), notes
        for name, asked, run in (("temperature", request.temperature, base.temperature),
                                 ("top_p", request.top_p, base.top_p)):
            if asked is not None and asked != run:
                notes.append(f"{name}={asked} overridden by the run's {run}")
        if request.seed is not None:
            notes.append("seed ignored")
        self.sampling_overrides += bool(notes)
        cap = min(request.token_cap or base.max_tokens, base.max_tokens)
        return dataclasses.replace(base, max_tokens=cap), notes

    def _recorded_form(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.replies.get(_canonical(m), m) if m["role"] == "assistant" else m for m in messages]

    def plan(self, request: ChatRequest | CompletionRequest, default_max_tokens: int) -> CallPlan:
        """What this call will do; raises ``Refused`` for a ``tool_choice`` that cannot be
        honoured. Counts a sampling override: once per call."""
        sampling, notes = self.sampling(request, default_max_tokens)
        if isinstance(request, CompletionRequest):
            return CallPlan(sampling, notes)
        choice = tool_choice.resolve(request.tool_choice, request.tools, self.parser)
        if request.prefill is not None and choice.opening is not None:
            raise Refused(400, "continue_final_message with a tool_choice that forces a call: the reply cannot begin "
                               "with both the prefill and the call's opening; leave one out", "tool_choice")
        return CallPlan(sampling, notes, choice, reasoning.thinking(self.client.tokenizer), request.prefill)

    async def chat(self, request: ChatRequest, plan: CallPlan, on_tokens: TokenSink | None = None) -> CallResult:
        """``on_tokens``: the sampled ids as they come (``LLMClient.chat``)."""
        plain = [m.plain() for m in request.messages]
        self._call_starts(plain)
        response = parsed = None
        try:
            # A prefill is not a turn of the conversation but the start of the reply (the opening).
            messages = self._recorded_form(plain if plan.prefill is None else plain[:-1])
            await self._check_fits(messages, request.tools or None)
            response = await self.client.chat(messages, tools=request.tools or None, sampling=plan.sampling,
                                              stop=request.stops or None, opening=plan.opening, on_tokens=on_tokens)
            thought, answer = reasoning.split(response.text, plan.thinking)
            parsed = read_calls(self.parser, answer, response, plan.thinking) if plan.choice.parse else (
                ParsedReply(answer))
        finally:
            self._call_ends(response, parsed)
        self.tool_parse_errors += parsed.error is not None
        result = CallResult(response, parsed, plan.notes, thought or None)
        # The agent sends the whole turn back (prefill and continuation): that is the reply recorded.
        self.replies[_canonical(result.message)] = response.message
        if plan.prefill and parsed.content is not None and parsed.content.startswith(plan.prefill):
            # What vLLM hands back for a prefill: the continuation only.
            result = dataclasses.replace(result, parsed=dataclasses.replace(
                parsed, content=parsed.content[len(plan.prefill):]))
        return result

    async def complete(self, request: CompletionRequest, plan: CallPlan,
                       on_tokens: TokenSink | None = None) -> CallResult:
        sampling, notes = plan.sampling, plan.notes
        self._call_starts([])
        response = parsed = None
        try:
            prompt: str | list[int] = request.prompt
            if self.tokenize_pool is not None and not prompt_size.is_small(1, len(prompt)):
                encode = functools.partial(self.client.tokenizer.encode, prompt, add_special_tokens=False)
                prompt = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, encode)
            response = await self.client.generate(prompt, sampling=sampling, stop=request.stops or None,
                                                  on_tokens=on_tokens)
            parsed = ParsedReply(response.text)
        finally:
            self._call_ends(response, parsed)
        return CallResult(response, parsed, notes)

    async def _check_fits(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Raise ``PromptTooLongError`` for a large prompt that does not fit the context,
        counted on the gateway's threads: the loop then only ever tokenizes a prompt known
        to fit, a cost bounded by the context (``LLMClient.chat`` takes no token ids, so a
        large prompt that fits is tokenized twice). The count is the conversation rendered
        afresh; one continued from recorded turns holds the tokens as sampled, which the
        engine counts exactly once the prompt passes here."""
        context = prompt_size.context_of(self.client.engine)
        if (self.tokenize_pool is None or context is None
                or prompt_size.is_small(len(messages), prompt_size.text_chars(messages))):
            return
        ids = await asyncio.get_running_loop().run_in_executor(
            self.tokenize_pool, self.client._render_ids, messages, tools)  # the client's own rendering
        if len(ids) >= context:
            raise PromptTooLongError(len(ids), context)
