"""The LLM client a workflow talks to: token in, token out.

Three promises, because each one, when broken, silently corrupts off-policy training:
- the trajectory holds exactly the ids the engine sampled — model output is never
  re-tokenized, so behavior logprobs stay aligned with the trained tokens;
- tool/environment text, and the forced opening of a reply, is appended as tokens with
  loss mask 0 (logprob 0, no version);
- a generation the engine aborts for a weight update is resumed here with prompt +
  partial tokens and the remaining budget, and stitched token for token; the workflow
  never sees it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.rollout import chat_format
from asyncrl.engine.protocol import RolloutEngine, TokenSink
from asyncrl.rollout.deadline import EngineWait, EpisodeDeadline
from asyncrl.rollout.journal import Journal
from asyncrl.types import NO_VERSION, Completion, FinishReason, SamplingParams, Step, Trajectory

Message = dict[str, Any]

logger = logging.getLogger(__name__)
_warned_rewrites: set[str] = set()  # tokenizers whose rewriting template was already reported


@dataclass(frozen=True)
class Response:
    text: str  # decoded without special tokens, cut before a stop string
    token_ids: list[int]  # what was sampled and recorded (through the token that completed a stop string)
    finish_reason: FinishReason
    logprobs: tuple[float, ...] = ()  # behavior logprob of each token in token_ids
    prompt_tokens: int = 0  # the context the model saw for this reply
    recorded_text: str | None = None  # token_ids (less the end-of-turn token) decoded with special tokens,
    # when that differs from text: a stop string cut it, or the model sampled a special token mid-reply

    @property
    def message(self) -> Message:
        """The assistant message to append to the conversation (a fresh dict each time). It
        holds what was recorded, so a later turn continues the trajectory token-exact."""
        return {"role": "assistant", "content": self.text if self.recorded_text is None else self.recorded_text}


@dataclass
class _Conversation:
    """What the client remembers of the running chat, to append only the new turns."""

    trajectory: Trajectory
    messages: list[Message]  # own deep copy, ending with the assistant reply
    tools: list[dict[str, Any]] | None
    last_output_ids: list[int]  # the reply's tokens as the context holds them: a forced opening, then the sampled


class _PromptCache:
    """The ids of recently rendered prompts, per tokenizer. The n samples of a GRPO group
    open with the same messages, and rendering them (the chat template is Jinja) and
    tokenizing holds the GIL on the event loop — time the engine's thread waits for
    (the profile: docs/history.md, "A group's prompt rendered once"). Keyed by the
    messages' exact JSON (those that are not JSON are rendered every time) and cleared
    when the tokenizer's template changes; shared by the gateway's threads, hence the lock."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        # tokenizer -> (the template the entries were rendered with, rendered key -> ids)
        self._by_tokenizer: weakref.WeakKeyDictionary[Any, tuple[Any, OrderedDict[str, tuple[int, ...]]]] = (
            weakref.WeakKeyDictionary())

    def get(self, tokenizer: PreTrainedTokenizerBase, key: str | None) -> tuple[int, ...] | None:
        if key is None:
            return None
        with self._lock:
            template, entries = self._by_tokenizer.get(tokenizer, (None, None))
            if entries is None or template is not tokenizer.chat_template or key not in entries:
                return None
            entries.move_to_end(key)
            return entries[key]

    def put(self, tokenizer: PreTrainedTokenizerBase, key: str | None, ids: list[int]) -> None:
        if key is None:
            return
        with self._lock:
            template, entries = self._by_tokenizer.get(tokenizer, (None, None))
            if entries is None or template is not tokenizer.chat_template:
                entries = OrderedDict()
                self._by_tokenizer[tokenizer] = (tokenizer.chat_template, entries)
            entries[key] = tuple(ids)
            while len(entries) > self.capacity:
                entries.popitem(last=False)


_PROMPTS = _PromptCache()


def _prompt_key(messages: list[Message], tools: list[dict[str, Any]] | None) -> str | None:
    try:
        return json.dumps([messages, tools], ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None


def takes_sink(engine: object) -> bool:
    """Whether ``engine.generate`` takes ``on_tokens`` (``StreamingEngine``: both built-in
    engines). A wrapper that does not pass it on (a test double, a timing wrapper) gets
    none, and its caller each part's tokens at once."""
    try:
        return "on_tokens" in inspect.signature(engine.generate).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def _append_environment(trajectory: Trajectory, ids: list[int]) -> None:
    """Tokens the model did not sample (template text, tool results, a forced opening):
    mask 0, logprob 0, no version, so the learner never trains on them."""
    trajectory.response_ids += ids
    trajectory.loss_mask += [0] * len(ids)
    trajectory.logprobs += [0.0] * len(ids)
    trajectory.versions += [NO_VERSION] * len(ids)


def _watched(on_tokens: TokenSink | None, wait: EngineWait | None) -> TokenSink | None:
    """The sink an engine call gets: the caller's, and the deadline's (a call's first token
    tells it the call left the queue)."""
    if wait is None:
        return on_tokens
    if on_tokens is None:
        return wait.on_tokens

    def both(ids: list[int]) -> None:
        wait.on_tokens(ids)
        on_tokens(ids)
    return both


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The ids that end a model turn: the tokenizer's EOS (and the generation config's, when
    a caller adds them); sampling stops there and keeps the stop token in the trajectory."""
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()


class LLMClient:
    """One per episode. Each ``generate`` call, and each ``chat`` call that does not extend
    the previous conversation, opens a new trajectory in ``self.trajectories``. So does a
    ``chat`` call that extends it when the chat template rewrites what it rendered before
    (``template_rewrites`` counts those): see :meth:`_tokens_after_reply`.

    Every render goes through :mod:`asyncrl.rollout.chat_format`, so tools, tool calls, tool
    results and ``content: None`` reach the model also through a template not written for
    them."""

    def __init__(self, engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, sampling: SamplingParams) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.trajectories: list[Trajectory] = []
        self.template_rewrites = 0  # chat turns that had to start a new trajectory (see _tokens_after_reply)
        self.journal: Journal | None = None  # records each completion (and replays one after a restart): journal.py
        self.deadline: EpisodeDeadline | None = None  # the episode's clock, stopped while a call is queued: deadline.py
        self._conversation: _Conversation | None = None
        self._calls: list[Step] = []  # every model call's step, in the order the calls returned

    async def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                       stop: list[str] | None = None, *, on_tokens: TokenSink | None = None) -> Response:
        """One completion of ``prompt``; ``on_tokens`` as in :meth:`chat`."""
        prompt_ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
        trajectory = Trajectory(prompt_ids=list(prompt_ids))
        self.trajectories.append(trajectory)
        self._conversation = None
        return await self._extend(trajectory, sampling or self.sampling, messages=None, stop=stop,
                                  on_tokens=on_tokens)

    async def chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, stop: list[str] | None = None, *, opening: str | None = None,
        on_tokens: TokenSink | None = None,
    ) -> Response:
        """One reply. ``stop`` strings end it early: the reply is recorded through the token
        that completed the stop string (what the model sampled) and returned without it.

        ``on_tokens``: gets the sampled ids as the engine samples them (a streaming engine:
        each step's; another: each part it returns), all of them before this returns —
        those past a stop string too, and those of a part aborted and resumed, which are
        kept. It only watches: the response and the trajectory are the same without it.

        ``opening``: text the reply is made to begin with (a forced tool call's opening).
        It is written after the generation prompt as environment tokens — mask 0, logprob
        0, ``NO_VERSION``: the model did not sample it, so the learner never trains on it —
        and the model samples what follows, conditioned on it. The response's text and
        message are the opening followed by the sampled text (the model's turn as the next
        call renders it, so that call still continues token-exact); its ``token_ids`` and
        ``logprobs`` are the sampled tokens only, and ``prompt_tokens`` counts the opening."""
        conv = self._conversation
        new_ids = None
        if conv is not None and messages[: len(conv.messages)] == conv.messages and tools == conv.tools:
            new_ids = self._tokens_after_reply(conv, messages)
        if conv is not None and new_ids is not None:
            trajectory = conv.trajectory
            _append_environment(trajectory, new_ids)
        else:
            trajectory = Trajectory(prompt_ids=self._render_ids(messages, tools))
            self.trajectories.append(trajectory)
        forced = self.tokenizer.encode(opening, add_special_tokens=False) if opening else []
        _append_environment(trajectory, forced)
        response = await self._extend(trajectory, sampling or self.sampling, messages=messages, stop=stop,
                                      on_tokens=on_tokens)
        if opening:
            response = dataclasses.replace(
                response, text=opening + response.text,
                recorded_text=None if response.recorded_text is None else opening + response.recorded_text)
        self._conversation = _Conversation(trajectory, copy.deepcopy(messages) + [response.message],
                                           copy.deepcopy(tools), forced + response.token_ids)
        return response

    def set_turn_reward(self, reward: float, turn: int = -1) -> int:
        """Give model call ``turn`` of this episode its own reward (``Step.reward``), on top
        of the episode's outcome; returns the call's index. ``turn`` counts the calls that
        have returned, in the order they returned, from 0 (negative: from the latest; -1,
        the default, is the latest). Setting it again replaces it, so a retried request
        cannot count a reward twice.

        Where it goes: a critic's GAE puts it on the call's last sampled token; a
        group-relative estimator adds it into the episode's total (``Episode.total_reward``).
        Refused in one line: a reward that is not a finite number, a turn not made yet, a
        non-zero reward for a call that sampled no token (nothing to carry it)."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"a turn's reward must be a finite number, got {reward!r}")
        n = len(self._calls)
        if isinstance(turn, bool) or not isinstance(turn, int) or not -n <= turn < n:
            made = f"turns 0..{n - 1}, or -1 for the latest" if n else "none yet: reward a turn after its reply"
            raise ValueError(f"turn {turn!r} is not a model call of this episode ({made})")
        index = turn % n
        step = self._calls[index]
        if reward and step.response_tokens == 0:
            raise ValueError(f"turn {index} sampled no token, so no token can carry its reward {reward!r}")
        step.reward = float(reward)
        return index

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None = None, *,
               generation_prompt: bool) -> str:
        """The text ``chat`` tokenizes for ``messages``: :func:`chat_format.render_chat`, the
        one renderer (SFT's too). ``generation_prompt``: end with the opening of the model's
        next turn, as a prompt does."""
        if self.tokenizer.chat_template is None:
            raise ValueError(f"tokenizer {self.tokenizer.name_or_path!r} has no chat template; "
                             "chat workflows need one (use generate() for plain prompts)")
        return chat_format.render_chat(self.tokenizer, messages, tools, generation_prompt=generation_prompt)

    # -------------------------------------------------------------------------
    async def _extend(self, trajectory: Trajectory, sampling: SamplingParams, messages: list[Message] | None,
                      stop: list[str] | None = None, on_tokens: TokenSink | None = None) -> Response:
        context = trajectory.prompt_ids + trajectory.response_ids
        completion, num_resumes = await self._complete(context, sampling, on_tokens)
        visible = None
        if stop:
            completion, visible = self._cut_at_stop(completion, stop)
        n = len(completion.token_ids)
        trajectory.response_ids += completion.token_ids
        trajectory.loss_mask += [1] * n
        trajectory.logprobs += completion.logprobs
        trajectory.versions += completion.versions
        trajectory.finish_reason = completion.finish_reason
        trajectory.num_resumes += num_resumes
        step = Step(copy.deepcopy(messages), len(context), n, completion.finish_reason, num_resumes)
        trajectory.steps.append(step)
        self._calls.append(step)
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True) if visible is None else visible
        body = completion.token_ids
        if body and body[-1] in sampling.stop_token_ids and body[-1] in self.tokenizer.all_special_ids:
            body = body[:-1]  # the end-of-turn token: the template writes it back itself
        recorded = self.tokenizer.decode(body, skip_special_tokens=False)
        return Response(text, list(completion.token_ids), completion.finish_reason, tuple(completion.logprobs),
                        len(context), None if recorded == text else recorded)

    def _cut_at_stop(self, completion: Completion, stop: list[str]) -> tuple[Completion, str | None]:
        """Keep the tokens through the first one whose text completes a stop string; the
        text returned ends before the stop string. The tokens after it are never recorded,
        and the ones kept keep their exact logprobs (a causal model's earlier tokens do
        not depend on later ones)."""
        ids = completion.token_ids
        for n in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
            if cut >= 0:
                kept = Completion(ids[:n], completion.logprobs[:n], completion.versions[:n], "stop")
                return kept, text[:cut]
        return completion, None

    async def _complete(self, prompt_ids: list[int], sampling: SamplingParams,
                        on_tokens: TokenSink | None = None) -> tuple[Completion, int]:
        """Generate, resuming after every ``abort`` (a weight update) with prompt + partial
        tokens and the remaining budget, until the sequence really ends. With a journal,
        each part is recorded as it returns, and a completion replayed from before a
        restart starts from its recorded tokens (or is returned whole, when it had ended)."""
        journal = self.journal
        segment = journal.begin(prompt_ids) if journal is not None else None
        ids, logprobs, versions = (list(segment.token_ids), list(segment.logprobs), list(segment.versions)) \
            if segment is not None else ([], [], [])
        num_resumes = segment.num_resumes if segment is not None else 0
        if on_tokens is not None and ids:  # replayed: they are the reply's first tokens
            on_tokens(list(ids))
        if segment is not None and segment.finish_reason is not None:
            return Completion(ids, logprobs, versions, segment.finish_reason), num_resumes
        # cut off by a checkpoint: it goes on as after that checkpoint's abort (counted then)
        finish: FinishReason | None = "length" if len(ids) >= sampling.max_tokens else None
        while finish is None:
            remaining = dataclasses.replace(sampling, max_tokens=sampling.max_tokens - len(ids))
            if journal is not None:
                journal.calls_sent += 1
            wait = self._engine_wait(len(prompt_ids) + len(ids))
            sink = _watched(on_tokens, wait)
            streams = sink is not None and takes_sink(self.engine)
            try:
                if streams:
                    part = await self.engine.generate(prompt_ids + ids, remaining, on_tokens=sink)
                else:
                    part = await self.engine.generate(prompt_ids + ids, remaining)
            finally:
                if journal is not None:
                    journal.calls_returned += 1
                if wait is not None:
                    wait.close()
            if on_tokens is not None and not streams and part.token_ids:
                on_tokens(list(part.token_ids))
            ids += part.token_ids
            logprobs += part.logprobs
            versions += part.versions
            if segment is not None:
                segment.extend(part)
            if part.finish_reason != "abort":
                finish = part.finish_reason
            elif len(ids) >= sampling.max_tokens:
                finish = "length"
            else:
                num_resumes += 1
                if segment is not None:
                    segment.num_resumes = num_resumes
        if segment is not None:
            segment.finish_reason, segment.num_resumes = finish, num_resumes
        return Completion(ids, logprobs, versions, finish), num_resumes

    def _engine_wait(self, context_tokens: int) -> EngineWait | None:
        """The episode's deadline told of one engine call: its clock stops until the call's
        first token (the wait in the engine's queue), unless the engine does no work at all."""
        if self.deadline is None:
            return None
        engine = self.engine
        return self.deadline.engine_call(context_tokens, progress=lambda: engine.stats.busy_s,
                                         queue=engine.queue_state)

    def _render_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[int]:
        key = _prompt_key(messages, tools)
        ids = _PROMPTS.get(self.tokenizer, key)
        if ids is None:
            ids = self.tokenizer.encode(self.render(messages, tools, generation_prompt=True), add_special_tokens=False)
            _PROMPTS.put(self.tokenizer, key, ids)
        return list(ids)

    def _tokens_after_reply(self, conv: _Conversation, messages: list[Message]) -> list[int] | None:
        """Ids for what follows the model's last reply: the end-of-turn text the template
        adds after the reply that the model did not sample, then the new messages and the
        next generation prompt. Found by rendering the template and taking text suffixes,
        so the reply's own ids are never re-tokenized.

        None when the template does not only append (Qwen3's drops ``<think>`` from
        earlier replies once a new user turn comes): the caller then starts a new
        trajectory from the conversation rendered afresh, which is what the model sees at
        inference. Appending anyway would train on a context the template never produces;
        re-tokenizing the rewritten history into this trajectory would break the sampled
        ids. The earlier trajectory keeps its own tokens and is still trained."""
        opened = self.render(conv.messages[:-1], conv.tools, generation_prompt=True)
        closed = self.render(conv.messages, conv.tools, generation_prompt=False)
        following = self.render(messages, conv.tools, generation_prompt=True)
        sampled = self.tokenizer.decode(conv.last_output_ids, skip_special_tokens=False)
        reply = closed[len(opened):]
        if not closed.startswith(opened):
            rewrite = "renders the generation prompt differently once the reply follows it"
        elif not reply.startswith(sampled):
            rewrite = "does not render the model's reply as it was sampled"
        elif not following.startswith(closed):
            rewrite = "rewrites earlier turns when the conversation goes on"
        else:
            suffix = reply[len(sampled):] + following[len(closed):]
            return self.tokenizer.encode(suffix, add_special_tokens=False)
        self._template_rewrote(rewrite)
        return None

    def _template_rewrote(self, what: str) -> None:
        """Count a turn the template made us start afresh; warn once per tokenizer per process
        (every episode of a run would say the same)."""
        self.template_rewrites += 1
        name = str(self.tokenizer.name_or_path)
        if name not in _warned_rewrites:
            _warned_rewrites.add(name)
            logger.warning(
                "the chat template of %r %s: each such chat turn starts a new trajectory from the "
                "conversation rendered afresh (earlier turns keep their sampled tokens and are still "
                "trained; counted in LLMClient.template_rewrites)", name, what)
