"""``asyncrl sft``: the mask by hand, the key property (SFT trains on exactly the ids the
gateway records as the model's tokens for a turn, and the parser reads them back as the
conversation's calls), bad input named ``file:line`` before anything loads, and the
example end to end on the shipped tiny model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import yaml
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.cli import main
from asyncrl.config import ConfigError
from asyncrl.learner.core import TrainEngine
from asyncrl.model_store import cached_model
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.rollout.gateway import Gateway, get_format
from asyncrl.sft.batches import micro_batches, step_order
from asyncrl.sft.config import load_sft_config
from asyncrl.sft.data import DataError, load_conversations
from asyncrl.sft.render import Example, TemplateError, build_example, render_chat, tokenize_pieces, turn_pieces
from asyncrl.sft.trainer import SFTRun
from asyncrl.types import Completion, SamplingParams

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples/sft/conversations.yaml"
TRAIN = REPO / "examples/sft/conversations.jsonl"
HELD_OUT = REPO / "examples/sft/heldout.jsonl"
TINY = REPO / "models/search-tiny"  # a template that renders tools and calls itself


def tokenizers() -> list:
    """search-tiny (its own tool template) and, when fetched, SmolLM2 (no tool support: the
    hermes fallback of chat_format renders tools, calls and results)."""
    found = [pytest.param(TINY, id="search-tiny")]
    smollm2 = cached_model("smollm2-135m-instruct")
    found.append(pytest.param(smollm2, id="smollm2", marks=pytest.mark.skipif(
        smollm2 is None, reason="smollm2-135m-instruct not fetched (asyncrl models get smollm2-135m-instruct)")))
    return found


# -- the mask, by hand --------------------------------------------------------------------
def toy_render(messages, generation_prompt):
    """A ChatML-like template: each turn ``<role>text</s>`` and a newline after the end of turn."""
    text = "".join(f"<{m['role']}>{m['content']}</s>\n" for m in messages)
    return text + ("<assistant>" if generation_prompt else "")


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "tool", "content": "r"}, {"role": "assistant", "content": "ok"}]


def test_turn_pieces_are_the_assistant_turns_through_the_end_of_turn():
    assert turn_pieces(toy_render, CHAT, "</s>") == [
        ("<user>hi</s>\n<assistant>", False), ("yo</s>", True),
        ("\n<tool>r</s>\n<assistant>", False), ("ok</s>", True)]  # the newline after </s> is context
    assert turn_pieces(toy_render, CHAT[:2] + [{"role": "user", "content": "x"}], "</s>") == [
        ("<user>hi</s>\n<assistant>", False), ("yo</s>", True)]  # nothing after the last turn


def test_tokenize_pieces_masks_each_piece_on_its_own():
    encode = {"ab": [1, 2], "c": [3], "de": [4, 5]}.__getitem__
    assert tokenize_pieces([("ab", False), ("c", True), ("de", False)], encode) == ([1, 2, 3, 4, 5], [0, 0, 1, 0, 0])
    ids, mask = tokenize_pieces(turn_pieces(toy_render, CHAT, "</s>"), lambda text: [ord(c) for c in text])
    assert len(ids) == len(toy_render(CHAT, False)) - 1  # all but the final newline
    assert "".join(chr(i) for i, m in zip(ids, mask) if m) == "yo</s>ok</s>"


def test_a_template_that_is_not_append_only_is_refused():
    def rewrites(messages, generation_prompt):  # drops earlier replies once a user turns up after them
        kept = [m for i, m in enumerate(messages) if m["role"] != "assistant" or i == len(messages) - 1]
        return toy_render(kept, generation_prompt)

    with pytest.raises(TemplateError, match="rewrites earlier turns"):
        turn_pieces(rewrites, CHAT, "</s>")
    with pytest.raises(TemplateError, match="generation prompt differently"):
        turn_pieces(lambda m, g: toy_render(m, False) + ("<assistant>\n" if g else ""), CHAT, "</s>")
    with pytest.raises(TemplateError, match="no end-of-turn '<eot>'"):
        turn_pieces(toy_render, CHAT, "<eot>")


def test_a_template_error_names_the_conversation_and_the_template():
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no end of turn
    [conversation] = load_conversations([str(HELD_OUT)])[:1]
    with pytest.raises(TemplateError, match=rf"heldout.jsonl:1: .*no end-of-turn.*chat template of '{TINY}'"):
        build_example(tokenizer, conversation, 512)


# -- the key property: SFT's tokens are the ones the gateway records ----------------------
def model_turns(example: Example) -> list[tuple[int, list[int]]]:
    """(start, ids) of each run of mask 1: the tokens the model writes, turn by turn."""
    turns, start = [], None
    for i, m in enumerate([*example.mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            turns.append((start, example.ids[start:i]))
            start = None
    return turns


class ScriptedEngine:
    """Writes, turn after turn, the ids SFT trains the model to write, and keeps each prompt."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    version = 0

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.prompts = iter(turns), []

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        ids = next(self.turns)
        return Completion(list(ids), [0.0] * len(ids), [0] * len(ids), "stop")


@pytest.mark.parametrize("model_dir", tokenizers())
def test_sft_trains_on_the_ids_the_gateway_records_and_the_parser_reads_back(model_dir):
    """Each example conversation replayed through the gateway by an OpenAI-SDK agent: the
    model's replies are SFT's trained ids; the agent sends the data's own messages. The
    recorded trajectory is then SFT's example id for id and mask for mask, and every reply
    parses back into the data's content and tool calls."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = load_conversations([str(TRAIN), str(HELD_OUT)])
    # the bare list without tools, a call with object arguments, two calls in one turn, two turns of calls
    assert len(conversations) == 15

    async def replay(gateway, conversation, example):
        engine = ScriptedEngine([ids for _, ids in model_turns(example)])
        llm = LLMClient(engine, tokenizer, SamplingParams(max_tokens=512, stop_token_ids=stop_token_ids(tokenizer)))
        replies = []
        async with gateway.session(llm) as base_url:
            agent = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
            for i, message in enumerate(conversation.messages):
                if message["role"] == "assistant":
                    reply = await agent.chat.completions.create(
                        model="policy", messages=conversation.messages[:i], tools=conversation.tools or [])
                    replies.append((message, reply.choices[0].message))
        return llm, engine, replies

    async def replay_all(examples):
        gateway = Gateway(tokenizer, get_format("hermes"), model_name="policy")
        await gateway.start()
        try:
            return [await replay(gateway, c, e) for c, e in zip(conversations, examples)]
        finally:
            await gateway.stop()

    examples = [build_example(tokenizer, c, max_length=10_000) for c in conversations]
    for conversation, example, (llm, engine, replies) in zip(conversations, examples,
                                                             asyncio.run(replay_all(examples))):
        [trajectory] = llm.trajectories  # every turn continued the one trajectory: nothing re-rendered
        assert trajectory.prompt_ids + trajectory.response_ids == example.ids, conversation.source
        assert [0] * len(trajectory.prompt_ids) + trajectory.loss_mask == example.mask, conversation.source
        assert [len(p) for p in engine.prompts] == [start for start, _ in model_turns(example)]
        for wanted, got in replies:
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls or []]
            assert calls == [(c["function"]["name"], _arguments(c)) for c in wanted.get("tool_calls", [])]
            assert (got.content or "").strip() == wanted["content"].strip(), conversation.source


def _arguments(call):
    arguments = call["function"]["arguments"]
    return json.loads(arguments) if isinstance(arguments, str) else arguments


@pytest.mark.parametrize("model_dir", tokenizers())
def test_sft_renders_as_the_client_renders(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = LLMClient(ScriptedEngine([]), tokenizer, SamplingParams())
    for c in load_conversations([str(TRAIN)]):
        for prompt in (True, False):
            assert render_chat(tokenizer, c.messages, c.tools, generation_prompt=prompt) == client.render(
                c.messages, c.tools, generation_prompt=prompt)


# -- bad input, before anything loads -----------------------------------------------------
BAD_LINES = [
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}',  # 1: fine
    '{"messages": [{"role": "user", "content": "hi"}',  # 2: not JSON
    '{"conversation": []}',  # 3: no messages
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": '
     '[{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}'),  # 4: arguments
    '[{"role": "human", "content": "x"}, {"role": "assistant", "content": "y"}]',  # 5: role
    '',  # 6: blank, skipped
    '[{"role": "user", "content": "x"}]',  # 7: nothing to train on
    '[{"role": "assistant", "content": "y"}]',  # 8: a reply with no prompt
]


def test_bad_lines_are_each_named_file_line_before_the_model_loads(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(BAD_LINES) + "\n")
    code = main(["sft", str(EXAMPLE), f"data.train={data}", "model.path=/no/such/model", f"output_dir={tmp_path}/o"])
    err = capsys.readouterr().err
    assert code == 2, err
    for line, what in [(2, "not JSON"), (3, "no 'messages'"), (4, "tool_calls[0].function.arguments is not JSON"),
                       (5, "role 'human' is not one of"), (7, "no assistant message"),
                       (8, "messages[0] is an assistant message")]:
        assert f"{data}:{line}: " in err and what in err, (line, err)
    assert f"{data}:1:" not in err and f"{data}:6:" not in err
    assert "nothing was trained" in err and not (tmp_path / "o").exists()


def test_config_errors_exit_2_with_the_closest_key(tmp_path, capsys):
    assert main(["sft", str(EXAMPLE), "optim.learning_rate=1e-4"]) == 2
    assert "did you mean 'optim.lr'" in capsys.readouterr().err
    assert main(["sft", str(EXAMPLE), "data.trian=x.jsonl"]) == 2
    assert "did you mean 'data.train'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="data.train: name at least one"):
        load_sft_config(EXAMPLE, ["data.train=[]"])
    with pytest.raises(ConfigError, match="model.path: name the model"):
        load_sft_config(EXAMPLE, ["model={}"])
    with pytest.raises(ConfigError, match="both set"):
        load_sft_config(EXAMPLE, ["data.eval_fraction=0.2"])
    with pytest.raises(DataError, match="no such file"):
        load_conversations([str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit):
        main(["sft", str(EXAMPLE), "--keys"])
    keys = capsys.readouterr().out
    assert "data.max_length = 2048" in keys and "optim.micro_batch_size = 4" in keys and "mode =" not in keys


# -- batching ------------------------------------------------------------------------------
def test_step_order_is_seeded_and_covers_each_epoch():
    order = step_order(10, 4, epochs=2, seed=3)
    assert [len(s) for s in order] == [4, 4, 2, 4, 4, 2]
    assert sorted(i for s in order[:3] for i in s) == list(range(10)) and order == step_order(10, 4, epochs=2, seed=3)
    assert order != step_order(10, 4, epochs=2, seed=4)


def test_micro_batches_group_similar_lengths_within_the_budgets():
    examples = [Example(str(n), [0] * n, [0] * n) for n in (5, 50, 6, 48, 7)]
    parts = micro_batches(examples, max_rows=2, max_tokens=60)
    assert [[len(e.ids) for e in p] for p in parts] == [[5, 6], [7], [48], [50]]


@pytest.mark.slow
def test_any_micro_batch_split_takes_the_same_step(tmp_path):
    """One step with SGD (lr 1): the change of every weight is its gradient, which must not
    depend on how the step is cut into micro-batches."""
    def step(micro):
        cfg = load_sft_config(EXAMPLE, [f"optim.micro_batch_size={micro}", "optim.micro_batch_tokens=null"])
        run = SFTRun(cfg)
        tokenizer = AutoTokenizer.from_pretrained(TINY)
        examples = [build_example(tokenizer, c, 512) for c in load_conversations([str(TRAIN)])[:4]]
        model = AutoModelForCausalLM.from_pretrained(TINY)
        before = [p.detach().clone() for p in model.parameters()]
        engine = TrainEngine(model, model, tokenizer, torch.optim.SGD(model.parameters(), lr=1.0), None,
                             grad_clip=cfg.optim.grad_clip)
        loss, tokens, _ = run._train_step(engine, examples, 0)
        return loss, tokens, [p.detach() - b for p, b in zip(model.parameters(), before)]

    whole, split = step(4), step(1)
    assert whole[:2] == pytest.approx(split[:2], rel=1e-5)
    for a, b in zip(whole[2], split[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


# -- end to end ----------------------------------------------------------------------------
@pytest.mark.slow
def test_the_example_overfits_a_small_set_and_saves_a_model_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the example names its files relative to the repository root
    out = tmp_path / "sft"
    assert main(["sft", str(EXAMPLE), f"output_dir={out}", "total_steps=6", "batch_size=4", "optim.lr=3e-3",
                 "optim.warmup_steps=0", "optim.schedule=constant", "eval_every=3", "data.max_length=300"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7))
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 3, 6]  # before, every eval_every, at the end
    losses = [r["loss"] for r in rows[1:]]
    assert losses[-1] < losses[0] and rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert all(r["tokens"] > 0 and r["time/step"] > 0 for r in rows[1:])
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["total_steps"] == 6 and saved["data"]["train"] == ["examples/sft/conversations.jsonl"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) and tokenizer.chat_template == AutoTokenizer.from_pretrained(
        TINY).chat_template
    again = SFTRun(load_sft_config(EXAMPLE, [f"output_dir={out}"]))
    with pytest.raises(ConfigError, match="holds an earlier run"):
        again.run()


@pytest.mark.slow
def test_a_stop_saves_the_model_and_a_failure_says_where_the_last_one_is(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    run = SFTRun(load_sft_config(EXAMPLE, [f"output_dir={tmp_path}/stop", "eval_every=0"]))
    run.stop()  # as a first Ctrl-C does
    saved = run.run()
    assert run.interrupted and run.step == 1 and saved == tmp_path / "stop/checkpoints/step_1"
    AutoModelForCausalLM.from_pretrained(saved)

    real = SFTRun._train_step

    def fails_at_step_3(self, *args):
        if self.step == 3:
            raise RuntimeError("boom")
        return real(self, *args)

    monkeypatch.setattr(SFTRun, "_train_step", fails_at_step_3)
    assert main(["sft", str(EXAMPLE), f"output_dir={tmp_path}/fail", "batch_size=2", "save_every=1",
                 "keep_last=1"]) == 1
    err = capsys.readouterr().err
    assert f"failed at step 3; last saved model: {tmp_path}/fail/checkpoints/step_2" in err
    assert [p.name for p in (tmp_path / "fail/checkpoints").iterdir()] == ["step_2"]


@pytest.mark.slow
def test_sft_with_lora_writes_a_peft_adapter_checkpoint(tmp_path, monkeypatch):
    """``model.lora.rank=4`` is honoured: only adapters train, and both a checkpoint and the
    final save are PEFT adapter directories (no full weights) holding trained adapters."""
    from peft import PeftModel

    from asyncrl.policy import peft_reads_deprecated

    monkeypatch.chdir(REPO)
    out = tmp_path / "lora"
    assert main(["sft", str(EXAMPLE), f"output_dir={out}", "total_steps=2", "batch_size=4", "save_every=1",
                 "eval_every=0", "optim.lr=1e-2", "model.lora.rank=4"]) == 0
    for saved in (out / "checkpoints/step_1", out):
        assert json.loads((saved / "adapter_config.json").read_text())["r"] == 4
        assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
    with peft_reads_deprecated():
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY), out)
    lora_b = [p for name, p in tuned.named_parameters() if "lora_B" in name]
    assert lora_b and max(float(p.abs().max()) for p in lora_b) > 0  # B starts at 0: the adapters trained
    base = dict(AutoModelForCausalLM.from_pretrained(TINY).named_parameters())
    for name, p in tuned.get_base_model().named_parameters():  # the base stays as loaded
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name


@pytest.mark.slow
def test_a_kill_mid_save_leaves_the_last_complete_step_and_resume_takes_the_same_steps(tmp_path, monkeypatch):
    """A fault between a checkpoint's write and its rename (what a kill mid-save leaves):
    ``step_2.tmp`` is there, ``step_2`` is not, ``step_1`` is whole; ``resume=true`` goes on
    from step 1 and ends on the uninterrupted run's weights and losses."""
    import os

    monkeypatch.chdir(REPO)
    args = ["sft", str(EXAMPLE), "total_steps=4", "batch_size=4", "save_every=1", "keep_last=4", "eval_every=0",
            "optim.lr=1e-3", "optim.schedule=cosine"]
    assert main([*args, f"output_dir={tmp_path / 'whole'}"]) == 0
    real_replace = os.replace

    def killed_before_step_2_lands(src, dst):
        if Path(dst).name == "step_2":
            raise RuntimeError("killed mid-save")
        return real_replace(src, dst)

    cut = tmp_path / "cut"
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", killed_before_step_2_lands)
        assert main([*args, f"output_dir={cut}"]) == 1
    checkpoints = cut / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2.tmp"]
    with pytest.raises(ConfigError, match="resume=true"):
        SFTRun(load_sft_config(EXAMPLE, [f"output_dir={cut}"])).run()
    assert main([*args, f"output_dir={cut}", "resume=true"]) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2", "step_3"]
    rows = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("whole", "cut")}
    assert [r["step"] for r in rows["cut"]] == [r["step"] for r in rows["whole"]] == [0, 1, 2, 3, 4]
    for key in ("loss", "eval_loss"):
        logged = {run: [r[key] for r in rows[run] if key in r] for run in rows}
        assert logged["cut"] and logged["cut"] == pytest.approx(logged["whole"], rel=1e-5)
    whole, resumed = (dict(AutoModelForCausalLM.from_pretrained(tmp_path / run).named_parameters())
                      for run in ("whole", "cut"))
    for name, p in whole.items():
        torch.testing.assert_close(resumed[name], p, atol=1e-6, rtol=1e-5)
