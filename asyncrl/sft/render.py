"""A conversation as the token ids and loss mask SFT trains on.

The promise: for every assistant turn, the ids with mask 1 are exactly the ids the
rollout client records as the model's tokens for that turn when the model writes it, and
the ids around them are the ids the client records as context. Three things keep it:

- the text is rendered by ``chat_format.render_chat``, the one renderer the client's
  ``LLMClient.render`` calls too: the chat template after ``chat_format.prepare`` has spelled out, in the hermes
  ``<tool_call>`` format the gateway's parser reads back, whatever the template drops
  (tools, tool calls, tool results). SFT thus teaches the very format the parser reads;
- a turn is located by rendering prefixes, as the client continues a conversation: the
  prompt is ``render(messages[:i], generation_prompt=True)``; the turn is what
  ``render(messages[:i + 1])`` adds to it, through the end-of-turn token (the client's
  stop token, ``tokenizer.eos_token``); what the template writes after that token is
  context (mask 0), as the client appends it;
- each piece is tokenized on its own, as the client does (the prompt once, the model's
  tokens as sampled, the text between two turns once), so no id straddles a boundary the
  client never tokenizes across.

A template that is not append-only (one that rewrites earlier turns once the
conversation goes on) has no such ids: :class:`TemplateError` names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.rollout import chat_format
from asyncrl.sft.data import Conversation, DataError, data_error

Message = dict[str, Any]
Render = Callable[[list[Message], bool], str]  # (messages, generation_prompt) -> text


class TemplateError(DataError):
    """The chat template renders a conversation in a way SFT cannot mask token-exactly."""


@dataclass(frozen=True)
class Example:
    """One conversation as trained: ``ids`` and ``mask`` of equal length, mask 1 on the
    tokens the model writes (each assistant turn through its end-of-turn token)."""

    source: str
    ids: list[int]
    mask: list[int]
    truncated: bool = False  # cut at data.max_length

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.mask):
            raise ValueError(f"{self.source}: {len(self.ids)} ids but {len(self.mask)} mask entries")


render_chat = chat_format.render_chat
"""The one chat renderer, the rollout client's (``LLMClient.render`` calls it too)."""


def turn_pieces(render: Render, messages: list[Message], end_of_turn: str) -> list[tuple[str, bool]]:
    """The conversation as consecutive (text, trained) pieces through the last assistant
    turn's end-of-turn string: context pieces (False) and assistant turns (True), each
    turn its text through ``end_of_turn``. Pure: ``render`` is the only thing it asks.

    Raises :class:`TemplateError` where a prefix does not extend: the prompt of a turn must
    extend the text before it, the rendered turn must extend its prompt, and the turn must
    hold ``end_of_turn`` (else the model never learns to stop where sampling stops)."""
    pieces: list[tuple[str, bool]] = []
    done = ""  # text covered so far: ends with the last assistant turn's end-of-turn string
    closed_before = ""  # the conversation through that turn, rendered whole
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        closed = render(messages[: i + 1], False)
        if not prompt.startswith(closed_before):
            raise TemplateError(f"messages[{i}]: the template rewrites earlier turns once the conversation goes on "
                                f"(the prompt of this turn does not start with the text before it)")
        if not closed.startswith(prompt):
            raise TemplateError(f"messages[{i}]: the template renders the generation prompt differently once the "
                                "reply follows it")
        turn = closed[len(prompt):]
        end = turn.find(end_of_turn)
        if end < 0:
            raise TemplateError(f"messages[{i}]: the rendered assistant turn holds no end-of-turn "
                                f"{end_of_turn!r} (the token sampling stops at): {turn[-80:]!r}")
        turn = turn[: end + len(end_of_turn)]
        pieces += [(prompt[len(done):], False), (turn, True)]
        done, closed_before = prompt + turn, closed
    return [(text, trained) for text, trained in pieces if text]


def tokenize_pieces(pieces: list[tuple[str, bool]], encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
    """(ids, mask): each piece encoded on its own, its ids masked 1 when it is trained."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        piece = encode(text)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


def build_example(tokenizer: PreTrainedTokenizerBase, conversation: Conversation, max_length: int) -> Example:
    """The conversation's ids and mask, cut at ``max_length``; raises :class:`TemplateError`
    naming the conversation's ``file:line`` and the template."""
    if tokenizer.chat_template is None:
        raise TemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; SFT on conversations "
                            "renders them with it (model.path must name an instruct/chat model)")
    if tokenizer.eos_token is None:
        raise TemplateError(f"tokenizer {tokenizer.name_or_path!r} has no eos_token: the rollout client stops "
                            "sampling there, so SFT needs it to end each assistant turn")

    def render(messages: list[Message], generation_prompt: bool) -> str:
        return render_chat(tokenizer, messages, conversation.tools, generation_prompt=generation_prompt)

    try:
        pieces = turn_pieces(render, conversation.messages, tokenizer.eos_token)
    except TemplateError as exc:
        raise TemplateError(f"{conversation.source}: {exc} (chat template of {tokenizer.name_or_path!r}); "
                            "SFT cannot train this conversation token-exactly: use a model whose template "
                            "only appends turns, or set its chat_template") from None
    except Exception as exc:  # noqa: BLE001 (the template is arbitrary Jinja)
        raise TemplateError(f"{conversation.source}: the chat template of {tokenizer.name_or_path!r} failed on "
                            f"this conversation: {type(exc).__name__}: {exc}") from None
    ids, mask = tokenize_pieces(pieces, lambda text: tokenizer.encode(text, add_special_tokens=False))
    truncated = len(ids) > max_length
    return Example(conversation.source, ids[:max_length], mask[:max_length], truncated)


def build_examples(tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation],
                   max_length: int) -> list[Example]:
    """:func:`build_example` of each; raises :class:`DataError` listing every conversation
    the template cannot render token-exactly."""
    examples, problems = [], []
    for conversation in conversations:
        try:
            examples.append(build_example(tokenizer, conversation, max_length))
        except TemplateError as exc:
            problems.append(str(exc))
    if problems:
        raise data_error("conversations the chat template cannot render for SFT", problems)
    return examples
