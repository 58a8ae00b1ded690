"""Character-level tokenizer for the tiny policy, built locally with `tokenizers`.

One id per character (per byte outside ASCII) keeps the vocabulary tiny, so the
model is tiny, and makes every string exactly reversible, which the RL loss
relies on when it re-tokenizes rollouts. Nothing is downloaded from a hub.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOT, IM_START, IM_END, UNK = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
# Order fixes the ids: pad=0, endoftext=1, im_start=2, im_end=3, unk=4.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOT, IM_START, IM_END, UNK)

# Only what the arithmetic / tool tasks print; every extra char costs an embedding row.
CHARSET: str = (
    string.digits + " +-*/()=>.\n" + string.ascii_lowercase + string.ascii_uppercase + ",:?!'"
)

# Copy of transformers' Qwen2Tokenizer PRETOKENIZE_REGEX (see build_char_tokenizer).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Compact ChatML: every char is a token, so template overhead lengthens every prompt.
# Tools are listed by name only on a leading system line; `tool` turns render like any role;
# an assistant turn given as tool_calls renders as Hermes-style <tool_call>{...}</tool_call>.
CHAT_TEMPLATE: str = (
    # All literal text lives inside {{ }} so Jinja whitespace control can't eat the "\n"s.
    "{% if tools %}{{ '<|im_start|>system\\ntools: ' }}"
    "{% for t in tools %}{{ t['function']['name'] if t['function'] is defined else t['name'] }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    # an assistant turn written by the caller with tool_calls: the Hermes <tool_call> form
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{{ '<tool_call>{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}{{ '}</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table, as used by the `ByteLevel` pre-tokenizer."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def char_vocab() -> dict[str, int]:
    """Specials, then CHARSET (compact ids 5..), then the other 178 bytes.

    Byte fallback means no text is ever unknown, so decode(encode(s)) == s
    for any NFC string and the ids survive any reload; `<|unk|>` stays
    registered but is never produced.
    """
    b2u = _byte_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in [b2u[ord(c)] for c in CHARSET] + [b2u[b] for b in range(256)]:
        vocab.setdefault(sym, len(vocab))
    return vocab


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the char tokenizer as a merge-free byte-level BPE.

    Why not WordLevel + `Split` + `Fuse`: `AutoTokenizer` in transformers 5.x
    forces `Qwen2Tokenizer` for any dir whose config.json says `qwen2`, and that
    class rebuilds the backend as NFC + Qwen split + ByteLevel + BPE from the
    saved vocab, ignoring the saved pipeline. Mirroring that pipeline exactly
    (with no merges, so one token per byte) keeps ids identical either way.
    """
    tok = Tokenizer(models.BPE(vocab=char_vocab(), merges=[], unk_token=None, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()  # bytes -> text, no inserted spaces
    # Registered as special so they match as one id before pre-tokenization.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,  # end of an assistant turn is the stop token
        unk_token=UNK,
        bos_token=None,
        additional_special_tokens=[EOT, IM_START],  # v5 renames it extra_special_tokens
        # The default cleanup would rewrite " ." / " '" and break exact round-trips.
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="left",  # generation batches are left-padded
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_char_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Build and `save_pretrained` the tokenizer to `path`; returns it."""
    tok = build_char_tokenizer()
    tok.save_pretrained(str(path))
    return tok


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Render `messages` + generation prompt to a flat ``list[int]``.

    In transformers 5.x ``apply_chat_template(tokenize=True)`` returns a
    ``BatchEncoding`` (``return_dict`` defaults to True), not a list, so we
    render text and encode it ourselves, without re-adding special tokens.
    """
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
