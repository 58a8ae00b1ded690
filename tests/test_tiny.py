"""Round-trip tests for the locally built tiny policy (no hub access)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.tiny import (
    CHARSET,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    build_tiny_model,
    chat_prompt_ids,
    save_char_tokenizer,
    save_tiny_policy,
    tiny_qwen2_config,
)

TEXTS = [
    "Hi there, 3 + 4 = 7.\n  ok?\nnew\n",
    "  lead\n\n\ntrail  ",
    "don't (12*3)/4 => 9. A:b!?",
    "<|im_start|>user\n2+2<|im_end|>\n<|endoftext|><|pad|>",
    "x<|im_end|>y",
    "off-charset: a_b{\"k\": [1]} café 🙂\t",
    "",
]
CONVO = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_charset_small_and_one_id_per_char(tok):
    assert len(CHARSET) < 100 and len(set(CHARSET)) == len(CHARSET)
    ids = tok.encode(CHARSET, add_special_tokens=False)
    assert ids == list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHARSET)))
    assert len(tok) == len(SPECIAL_TOKENS) + 256  # specials + byte fallback


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_exact(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.encode(special, add_special_tokens=False) == [i]
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|pad|>", "<|im_end|>", None)
    assert tok.pad_token_id == 0 and tok.eos_token_id == 3
    assert tok.encode("ab", add_special_tokens=True) == tok.encode("ab", add_special_tokens=False)
    assert tok.decode(tok.encode(TEXTS[3]), skip_special_tokens=True) == "user\n2+2\n"


def test_chat_template_exact(tok):
    assert tok.apply_chat_template(CONVO, tokenize=False) == (
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
    )
    assert tok.apply_chat_template(CONVO, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_tools_and_tool_role(tok):
    tools = [
        {"type": "function", "function": {"name": "calc", "parameters": {}}},
        {"type": "function", "function": {"name": "search", "parameters": {}}},
    ]
    msgs = [{"role": "user", "content": "2*21?"}, {"role": "tool", "content": "42"}]
    assert tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\ntools: calc, search<|im_end|>\n<|im_start|>user\n2*21?<|im_end|>\n"
        "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_prompt_ids_is_flat_list(tok):
    ids = chat_prompt_ids(tok, CONVO[:1])
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tok.decode(ids) == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    # transformers 5.x: tokenize=True returns a BatchEncoding (dict) by default.
    out = tok.apply_chat_template(CONVO[:1], add_generation_prompt=True, tokenize=True)
    got = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert list(got) == ids


def _assert_same_tokenizer(a, b):
    assert type(b).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2Tokenizer")
    assert a.get_vocab() == b.get_vocab() and len(a) == len(b)
    assert a.chat_template == b.chat_template
    assert (a.pad_token_id, a.eos_token_id, a.bos_token_id, a.unk_token_id) == (
        b.pad_token_id, b.eos_token_id, b.bos_token_id, b.unk_token_id
    )
    assert sorted(a.all_special_ids) == sorted(b.all_special_ids)
    for text in TEXTS:
        ids = a.encode(text, add_special_tokens=False)
        assert b.encode(text, add_special_tokens=False) == ids
        assert b.decode(ids) == text
    assert chat_prompt_ids(a, CONVO) == chat_prompt_ids(b, CONVO)


def test_tokenizer_save_load(tok, tmp_path):
    save_char_tokenizer(tmp_path)
    _assert_same_tokenizer(tok, AutoTokenizer.from_pretrained(tmp_path))


def test_config_defaults(tok):
    cfg = tiny_qwen2_config(len(tok), tokenizer=tok, rms_norm_eps=1e-5)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (64, 2, 2)
    assert cfg.pad_token_id == 0 and cfg.eos_token_id == 3 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings


def test_model_small_and_deterministic(tok):
    model, _ = build_tiny_model(tok, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny policy params: {n_params}")
    assert n_params < 1_500_000
    assert model.dtype == torch.float32 and model.config._attn_implementation == "sdpa"
    assert model.generation_config.eos_token_id == 3 and model.generation_config.pad_token_id == 0
    same, _ = build_tiny_model(tok, seed=0)
    other, _ = build_tiny_model(tok, seed=1)
    for (k, v), v2 in zip(model.state_dict().items(), same.state_dict().values()):
        assert torch.equal(v, v2), k
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_policy_save_load_identical(tok, tmp_path):
    model, _ = build_tiny_model(tok, seed=3)
    save_tiny_policy(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)  # Qwen2Tokenizer in transformers 5.x
    _assert_same_tokenizer(tok, loaded_tok)
    batch = loaded_tok(["1+2=", "Hello there\nok"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)
    out = loaded.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 2 and batch["input_ids"].shape[1] < out.shape[1] <= batch["input_ids"].shape[1] + 4
