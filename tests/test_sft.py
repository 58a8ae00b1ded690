"""Supervised warm-up that makes the tiny Countdown base policy: fast checks only.

The solver behind its targets is tested with the tasks (test_tasks.py); the scoring here is
checked against a plain ``model.generate`` loop, the reference it replaced."""

from __future__ import annotations

import asyncio

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.tasks import countdown_reward, generate_countdown
from asyncrl.tasks.countdown import solve_countdown
from asyncrl.tiny import (
    build_char_tokenizer,
    build_tiny_model,
    chat_prompt_ids,
    save_tiny_policy,
)
from asyncrl.tiny.scoring import evaluate_policy, greedy_accuracy, mean_reward
from asyncrl.tiny.sft import (
    IGNORE_INDEX,
    batch_loss,
    collate,
    sft_examples,
    supervised_warmup,
    wrong_expressions,
)
from asyncrl.tasks import Task

SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
         "max_position_embeddings": 64}


def test_sft_examples_mask_exactly_the_prompt(char_tokenizer):
    tasks = generate_countdown(20, seed=1)
    examples = sft_examples(char_tokenizer, tasks)
    eos = char_tokenizer.eos_token_id
    for task, (ids, labels) in zip(tasks, examples):
        prompt = chat_prompt_ids(char_tokenizer, [{"role": "user", "content": task.prompt}])
        assert len(ids) == len(labels)
        assert ids[: len(prompt)] == prompt
        assert labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
        assert labels[len(prompt):] == ids[len(prompt):]
        assert IGNORE_INDEX not in labels[len(prompt):]
        assert labels[-1] == eos
        answer = char_tokenizer.decode(ids[len(prompt):-1])
        assert answer == solve_countdown(task)


def test_wrong_expressions_use_the_numbers_and_miss_the_target():
    task = Task(id="t", prompt="1 2 3 -> 6", data={"numbers": [1, 2, 3], "target": 6})
    wrong = wrong_expressions(task)
    # 1+2+3 = 1*2*3 = 6 in every order: never a wrong answer; 1+2*3 = 7 and 3-2-1 = 0 are.
    assert not {"1+2+3", "1*2*3", "3*2*1", "2*(1+2)"} & set(wrong)
    assert {"1+2*3", "3-2-1", "(1+2)*3"} <= set(wrong)
    assert all(countdown_reward(task, text) == 0.1 for text in wrong)
    assert wrong == sorted(set(wrong))


def test_noisy_examples_replace_about_label_noise_of_targets(char_tokenizer):
    tasks = generate_countdown(10, seed=2)
    copies = 100
    noisy = sft_examples(char_tokenizer, tasks, label_noise=0.5, copies=copies, seed=3)
    assert len(noisy) == copies * len(tasks)
    assert noisy == sft_examples(char_tokenizer, tasks, label_noise=0.5, copies=copies, seed=3)
    assert noisy != sft_examples(char_tokenizer, tasks, label_noise=0.5, copies=copies, seed=4)
    num_wrong = 0
    for i, task in enumerate(tasks):
        prompt_len = len(chat_prompt_ids(char_tokenizer, [{"role": "user", "content": task.prompt}]))
        answers = [char_tokenizer.decode(ids[prompt_len:-1]) for ids, _ in noisy[i * copies:(i + 1) * copies]]
        wrong = [a for a in answers if a != solve_countdown(task)]
        assert set(wrong) <= set(wrong_expressions(task))
        assert len(set(wrong)) > 5  # each copy draws its own wrong answer
        num_wrong += len(wrong)
    # 1,000 Bernoulli(0.5) draws: 5 standard deviations is +-79.
    assert abs(num_wrong - 500) < 79
    clean = sft_examples(char_tokenizer, tasks, label_noise=0.0, copies=3)
    assert clean == [example for example in sft_examples(char_tokenizer, tasks) for _ in range(3)]


def test_warmup_lowers_loss_and_round_trips(tmp_path):
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model, tokenizer = build_tiny_model(tokenizer, seed=0, **SMALL)
    tasks = generate_countdown(256, seed=5)
    probe = collate(sft_examples(tokenizer, tasks[:32]), tokenizer.pad_token_id)
    with torch.no_grad():
        before = batch_loss(model, *probe).item()

    history = supervised_warmup(model, tokenizer, tasks, steps=30, batch_size=16, lr=1e-2,
                                warmup_steps=5, seed=0, log_every=0)
    assert history["steps"] == 30 and history["stopped_by"] == "steps"
    model.eval()
    with torch.no_grad():
        after = batch_loss(model, *probe).item()
    assert after < before - 1.0, (before, after)  # ~5.5 (uniform) -> well under 4

    out = save_tiny_policy(model, tokenizer, tmp_path / "policy")
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    loaded_tok = AutoTokenizer.from_pretrained(out)
    assert chat_prompt_ids(loaded_tok, [{"role": "user", "content": tasks[0].prompt}]) == \
        chat_prompt_ids(tokenizer, [{"role": "user", "content": tasks[0].prompt}])
    with torch.no_grad():
        assert abs(batch_loss(loaded, *probe).item() - after) < 1e-5
    # Greedy decoding runs end to end on the reloaded pair (accuracy itself is ~0 here).
    acc = greedy_accuracy(loaded, loaded_tok, tasks[:8], max_new_tokens=8)
    assert 0.0 <= acc <= 1.0


def test_warmup_is_deterministic_given_seed():
    tokenizer = build_char_tokenizer()
    tasks = generate_countdown(64, seed=2)
    losses = []
    for _ in range(2):
        model, _ = build_tiny_model(tokenizer, seed=0, **SMALL)
        losses.append(supervised_warmup(model, tokenizer, tasks, steps=5, batch_size=8,
                                        warmup_steps=2, seed=7, log_every=0)["final_loss"])
    assert losses[0] == losses[1]


@torch.no_grad()
def generate_greedy(model, tokenizer, tasks, max_new_tokens):
    """Reference: greedy ``model.generate`` over one left-padded batch, cut at EOS."""
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": t.prompt}]) for t in tasks]
    width, pad, eos = max(map(len, prompts)), tokenizer.pad_token_id, tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad, eos_token_id=eos)
    rows = [row[: row.index(eos)] if eos in row else row for row in out[:, width:].tolist()]
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]


def test_greedy_scoring_matches_model_generate():
    """The engine path must answer token for token what ``model.generate`` answers, on a
    half-trained model whose answers are varied (a random one mostly repeats one token)."""
    tokenizer = build_char_tokenizer()
    model, tokenizer = build_tiny_model(tokenizer, seed=0, **SMALL)
    tasks = generate_countdown(48, seed=5)
    supervised_warmup(model, tokenizer, tasks, steps=40, batch_size=16, lr=1e-2, warmup_steps=5, seed=0,
                      log_every=0)
    model.train()
    result = asyncio.run(evaluate_policy(model, tokenizer, tasks, temperature=0.0, max_new_tokens=12,
                                         max_batch_size=16))
    assert model.training  # the engine's switch to eval mode is undone
    reference = generate_greedy(model.eval(), tokenizer, tasks, max_new_tokens=12)
    assert [e.task_id for e in result.episodes] == [t.id for t in tasks]
    assert [e.metadata["response"] for e in result.episodes] == reference
    assert len(set(reference)) > 1
    expected = sum(countdown_reward(t, r) == 1.0 for t, r in zip(tasks, reference)) / len(tasks)
    assert greedy_accuracy(model, tokenizer, tasks, max_new_tokens=12) == expected == result.pass_at[1]


def test_sampled_mean_reward_is_seeded():
    tokenizer = build_char_tokenizer()
    model, tokenizer = build_tiny_model(tokenizer, seed=0, **SMALL)
    tasks = generate_countdown(16, seed=1)
    first = mean_reward(model, tokenizer, tasks, seed=3, max_new_tokens=8)
    assert first == mean_reward(model, tokenizer, tasks, seed=3, max_new_tokens=8)
    assert 0.0 <= first <= 1.0
