"""``asyncrl bench retokenize``: how often naive re-tokenization would change the ids a
model sampled, measured on a real BPE tokenizer (SmolLM2-135M-Instruct by default).

Why: an agent stack that keeps the conversation as text and encodes it again for
training trains on ids the model never sampled — the behavior logprobs then belong to
other tokens, and the importance ratio of every such token is wrong. ``LLMClient`` keeps
the sampled ids, so the figure here is what it avoids, not a fault of ours.

Method: ``num_conversations`` two-turn chats (a user prompt, a reply, a second user turn,
a reply), all in flight at once through ``LLMClient.chat`` on one ``TorchEngine`` (each
with its own request seed, so its tokens do not depend on the batch around it). Prompts
are of three kinds — arithmetic, short factual questions, text with numbers, code and
unicode — with follow-ups to match. Each trajectory's ids (``prompt_ids + response_ids``)
are compared with the naive ones: the conversation, its replies as the decoded text an
OpenAI server returns, rendered by the chat template (the client's own rendering) and
encoded. Where the first difference falls: inside a model ``reply`` (the model sampled
a segmentation BPE would not write, or a special token the text drops), at a
``boundary`` (a token of the re-encoding spans template text and reply, e.g. the
generation prompt's newline merged with a reply that starts with one), or in
``template`` text alone (expected never: the same text encoded alike).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field
from transformers import PreTrainedTokenizerBase

from asyncrl.bench.progress import phase
from asyncrl.rollout.client import LLMClient, Message, stop_token_ids
from asyncrl.config import ModelConfig, RolloutConfig, Section, apply_overrides, validate
from asyncrl.engine import TorchEngine
from asyncrl.engine.factory import torch_engine
from asyncrl.policy import load_policy
from asyncrl.seeding import derive_seed
from asyncrl.types import SamplingParams, Trajectory

Where = Literal["reply", "boundary", "template"]
WHERE: tuple[Where, ...] = ("reply", "boundary", "template")
Render = Callable[[list[Message], bool], str]  # (messages, generation prompt) -> the template's text


class RetokenizeModel(ModelConfig):
    path: str | None = None  # type: ignore[assignment]
    """``None``: SmolLM2-135M-Instruct, fetched once by ``asyncrl models get``."""


class RetokenizeBenchSettings(Section):
    model: RetokenizeModel = Field(default_factory=RetokenizeModel)
    num_conversations: int = Field(200, ge=1)
    reply_tokens: int = Field(24, ge=1)
    """The cap of each reply (the end-of-turn token ends one earlier)."""
    temperature: float = Field(1.0, ge=0)
    seed: int = 0
    max_batch_size: int = Field(64, ge=1)
    engine_threads: int = Field(2, ge=1)
    examples: int = Field(3, ge=0)
    """Differing spans kept for the docs, the first ones met of distinct token pairs."""


# --------------------------------------------------------------------- prompts
_FACTS = ["What is the capital of France?", "Who wrote Romeo and Juliet?", "How many legs does a spider have?",
          "What is the boiling point of water in Celsius?", "Which planet is the largest in the solar system?",
          "What language is spoken in Brazil?", "In which year did World War II end?",
          "What is the chemical symbol for gold?", "How many continents are there?",
          "Who painted the Mona Lisa?", "What is the square root of 144?", "What gas do plants take in?"]
_MIXED = ["Explain this code: `for i in range({a}): print(i ** 2)`",
          "Convert {a} °C to °F and show the formula.",
          "Translate to English: «Grüße aus München, {a} km entfernt.»",
          "What does `x = [{a}, {b}]; x[-1]` return in Python?",
          "Summarize: The café on {a}th Ave. sold {b} crêpes for €{c}.50 on 2024-03-{d}.",
          'Fix this JSON: {{"id": {a}, "tags": ["α", "β"], "ok": tru}}',
          "Is 東京 the same city as Tokyo? It has about {a} million people.",
          "What is the output of `printf(\"%05.1f\\n\", {a}.{b});`?"]
_ARITHMETIC = ["What is {a} + {b}?", "Compute {a} × {b}.", "What is {a} - {b}? Answer with the number only.",
               "If I have {a} apples and eat {d}, how many are left?", "What is {c}% of {b}?"]
_FOLLOW_UPS = {
    "arithmetic": ["Are you sure? Check it step by step.", "Now do it with {d} instead.", "Why?"],
    "factual": ["Are you sure?", "Tell me one more fact about it.", "Say it again in one sentence."],
    "mixed": ["Can you show it with {d}?", "Explain that more simply.", "Give a one-line example."],
}
KINDS = ("arithmetic", "factual", "mixed")


def conversations(n: int, seed: int) -> list[tuple[str, str, str]]:
    """(kind, first user turn, second user turn) of ``n`` chats, the kinds in turn; a
    function of ``seed`` alone."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        numbers = {"a": rng.randint(2, 999), "b": rng.randint(2, 9999), "c": rng.randint(1, 99),
                   "d": rng.randint(1, 28)}
        pool = {"arithmetic": _ARITHMETIC, "factual": _FACTS, "mixed": _MIXED}[kind]
        out.append((kind, rng.choice(pool).format(**numbers), rng.choice(_FOLLOW_UPS[kind]).format(**numbers)))
    return out


# ----------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Drift:
    """Where naive re-tokenization first leaves the recorded ids, and the span the two cut
    differently. Tokens are shown decoded; one that is only part of a character, by its
    vocabulary string (byte-level BPE: ``Ġ`` a space, ``Ċ`` a newline)."""

    index: int  # in prompt_ids + response_ids
    where: Where
    text: str  # the span's text (U+FFFD where the model sampled bytes that make no whole character)
    recorded: list[str]  # the span token by token, as sampled
    retokenized: list[str]  # the same text as the naive re-encoding cuts it


def naive_text(render: Render, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as one text, as a stack that keeps text would render it for
    training, and the character span of each assistant message in it."""
    text = render(messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(render(messages[:k], True))
            end = start + len(m["content"])
            if text[start:end] != m["content"]:
                raise ValueError("the chat template does not render assistant text as given; no spans to compare")
            spans.append((start, end))
    return text, spans


def retokenization_drift(tokenizer: PreTrainedTokenizerBase, recorded: list[int], text: str,
                         reply_spans: list[tuple[int, int]]) -> Drift | None:
    """None when encoding ``text`` gives ``recorded`` (as a prefix: the text may end with
    the template's close of the last turn, which the trajectory does not hold)."""
    naive = tokenizer.encode(text, add_special_tokens=False)
    if naive[:len(recorded)] == recorded:
        return None
    i = next((j for j, (a, b) in enumerate(zip(recorded, naive)) if a != b), min(len(recorded), len(naive)))

    def chars(ids: list[int], n: int) -> int:  # characters of the first n tokens' text
        return len(tokenizer.decode(ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False))

    # widen until both sides end at the same character: the span the two cut differently
    start, j, k = chars(recorded, i), min(i + 1, len(recorded)), min(i + 1, len(naive))
    while j - i < 16 and k - i < 16:
        ours, theirs = chars(recorded, j), chars(naive, k)
        if ours < theirs and j < len(recorded):
            j += 1
        elif theirs < ours and k < len(naive):
            k += 1
        else:
            break
    end = max(chars(recorded, j), chars(naive, k))
    inside = any(a <= start and end <= b for a, b in reply_spans)
    touches = any(start < b and a < end for a, b in reply_spans)
    where: Where = "reply" if inside else "boundary" if touches else "template"

    def pieces(ids: list[int]) -> list[str]:  # a token that is part of a character: its vocabulary string
        decoded = [tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in ids]
        return [p if "\ufffd" not in p else tokenizer.convert_ids_to_tokens(t) for p, t in zip(decoded, ids)]

    span = tokenizer.decode(recorded[i:j], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return Drift(i, where, span, pieces(recorded[i:j]), pieces(naive[i:k]))


# ------------------------------------------------------------------ generation
async def _chat(engine: TorchEngine, tokenizer: PreTrainedTokenizerBase, sampling: SamplingParams,
                first: str, second: str) -> tuple[Trajectory, list[Message], Render]:
    """One two-turn chat as a workflow holds it; returns its trajectory, the conversation
    with the replies as the text the model's API hands out, and the client's rendering."""
    llm = LLMClient(engine, tokenizer, sampling)
    messages: list[Message] = [{"role": "user", "content": first}]
    reply = await llm.chat(messages)
    texts = [{"role": "assistant", "content": reply.text}]
    messages += [reply.message, {"role": "user", "content": second}]
    last = await llm.chat(messages)
    if len(llm.trajectories) != 1:
        raise RuntimeError("the second turn did not extend the first trajectory; nothing to compare")
    conversation = [messages[0], *texts, messages[2], {"role": "assistant", "content": last.text}]
    return llm.trajectories[0], conversation, lambda m, prompt: llm.render(m, generation_prompt=prompt)


async def _generate(s: RetokenizeBenchSettings, model: Any, tokenizer: PreTrainedTokenizerBase,
                    chats: list[tuple[str, str, str]], advance: Callable[[], None]
                    ) -> tuple[list[tuple[Trajectory, list[Message], Render]], float]:
    engine = torch_engine(model, RolloutConfig(max_batch_size=s.max_batch_size), seed=s.seed,
                          num_threads=s.engine_threads)

    async def one(i: int, first: str, second: str) -> tuple[Trajectory, list[Message], Render]:
        sampling = SamplingParams(max_tokens=s.reply_tokens, temperature=s.temperature,
                                  stop_token_ids=stop_token_ids(tokenizer), seed=derive_seed(s.seed, "retokenize", i))
        out = await _chat(engine, tokenizer, sampling, first, second)
        advance()  # a tqdm update per finished chat: microseconds against seconds of decoding
        return out

    try:
        start = time.perf_counter()
        results = await asyncio.gather(*[one(i, a, b) for i, (_, a, b) in enumerate(chats)])
        return list(results), time.perf_counter() - start
    finally:
        await engine.shutdown()


def run_retokenize_bench(overrides: list[str]) -> dict[str, Any]:
    s = validate(RetokenizeBenchSettings, apply_overrides({}, overrides))
    path = s.model.path
    if path is None:
        from asyncrl.model_convert import ensure_model

        path = str(ensure_model("smollm2-135m-instruct"))
    model, tokenizer = load_policy(ModelConfig(path=path, dtype=s.model.dtype, device=s.model.device))
    chats = conversations(s.num_conversations, s.seed)
    with phase("retokenize", f"{s.num_conversations} two-turn chats, {s.reply_tokens}-token replies",
               total=s.num_conversations, unit="chat") as progress:
        results, seconds = asyncio.run(_generate(s, model, tokenizer, chats, progress.advance))
        sampled = sum(sum(t.loss_mask) for t, _, _ in results)
        progress.figure = f"{sampled:,} tokens, {sampled / seconds:,.1f} tok/s"
    where = dict.fromkeys(WHERE, 0)
    by_kind = {kind: {"conversations": 0, "differs": 0} for kind in KINDS}
    examples: list[dict[str, Any]] = []
    with phase("retokenize", "naive re-tokenization") as progress:
        for (kind, _, _), (trajectory, conversation, render) in zip(chats, results):
            text, spans = naive_text(render, conversation)
            drift = retokenization_drift(tokenizer, trajectory.prompt_ids + trajectory.response_ids, text, spans)
            by_kind[kind]["conversations"] += 1
            if drift is None:
                continue
            by_kind[kind]["differs"] += 1
            where[drift.where] += 1
            pair = (drift.recorded, drift.retokenized)
            if len(examples) < s.examples and all((e["recorded"], e["retokenized"]) != pair for e in examples):
                examples.append({"kind": kind, "where": drift.where, "text": drift.text, "recorded": drift.recorded,
                                 "retokenized": drift.retokenized})
        differs = sum(where.values())
        progress.figure = f"{differs}/{len(results)} differ"
    result = {
        "settings": s.model_dump(), "model_path": path, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "num_conversations": len(results), "retokenized_differs": differs,
        "retokenized_differs_fraction": differs / len(results), "first_difference": where, "by_kind": by_kind,
        "examples": examples, "tokens_sampled": sampled, "generation_s": seconds, "tokens_per_s": sampled / seconds,
    }
    print(f"{'conversations':>13s} {'differ':>6s} {'fraction':>8s} {'in reply':>8s} {'at boundary':>11s} "
          f"{'template':>8s} {'tokens/s':>8s}")
    print(f"{len(results):13d} {differs:6d} {differs / len(results):8.1%} {where['reply']:8d} "
          f"{where['boundary']:11d} {where['template']:8d} {sampled / seconds:8.1f}")
    print("by kind: " + ", ".join(f"{k} {v['differs']}/{v['conversations']}" for k, v in by_kind.items()))
    for e in examples:
        print(f"  {e['kind']}, {e['where']}: {e['text']!r} sampled as {e['recorded']!r}, "
              f"re-encoded as {e['retokenized']!r}")
    return result
