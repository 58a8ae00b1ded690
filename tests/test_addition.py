"""The addition example: its warm-up data, the exact expected reward it records, the
shipped policy matching its record, and the three configs training end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_examples import in_repo, train  # noqa: F401 (in_repo is a fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.tasks import load_tasks
from asyncrl.tiny import build_char_tokenizer
from asyncrl.tiny.addition_sft import COPIES, NUM_VALIDATION, expected_reward, noisy_addition_examples
from asyncrl.tiny.sft import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "models" / "addition-tiny"


def test_warm_up_labels_are_the_sum_or_noise_in_the_answer_range():
    tokenizer = build_char_tokenizer()
    examples = noisy_addition_examples(tokenizer, max_operand=9, label_noise=0.5)
    assert len(examples) == COPIES * 100
    correct = 0
    for i, (ids, labels) in enumerate(examples):
        a, b = divmod(i % 100, 10)
        prompt = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)  # as the client renders it
        assert ids[:len(prompt)] == prompt and labels[:len(prompt)] == [IGNORE_INDEX] * len(prompt)
        assert ids[-1] == labels[-1] == tokenizer.eos_token_id  # the loss teaches it to stop
        answer = int(tokenizer.decode(ids[len(prompt):-1]))
        assert 0 <= answer <= 18
        correct += answer == a + b
    # right with probability 0.5 + 0.5/19 (a noisy label can hit the sum); 2,000 draws: s.e. 0.011
    assert abs(correct / len(examples) - (0.5 + 0.5 / 19)) < 0.05


def test_expected_reward_is_the_probability_of_the_exact_answer_then_stop():
    model = AutoModelForCausalLM.from_pretrained(SHIPPED).eval()
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    pairs = [(3, 4), (19, 19), (0, 0), (12, 7)]
    by_hand = []
    with torch.no_grad():
        for a, b in pairs:  # one token at a time, multiplying the softmax probabilities
            ids = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
            p = 1.0
            for token in tokenizer.encode(str(a + b), add_special_tokens=False) + [tokenizer.eos_token_id]:
                p *= torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)[token].item()
                ids.append(token)
            by_hand.append(p)
    assert expected_reward(model, tokenizer, pairs) == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-4)


def test_shipped_policy_matches_its_record():
    record = json.loads((SHIPPED / "base_policy.json").read_text())
    assert record["command"].startswith("python -m asyncrl.tiny.addition_sft")
    model = AutoModelForCausalLM.from_pretrained(SHIPPED).eval()
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    validation = load_tasks("arithmetic", seed=0, num_train=1, num_validation=NUM_VALIDATION,
                            options=record["options"]).validation
    pairs = [tuple(int(x) for x in t.prompt.rstrip("=").split("+")) for t in validation]
    expected = expected_reward(model, tokenizer, pairs)
    assert expected == pytest.approx(record["expected_val_reward"], abs=1e-3)
    assert 0.2 <= expected <= 0.5  # room to learn, and a signal to learn from


@pytest.mark.parametrize("mode", ["async", "one_step_off", "sync"])
@pytest.mark.slow
def test_addition_example_trains(in_repo, tmp_path, mode):  # noqa: F811 (in_repo is a fixture)
    samples = train(f"examples/addition/{mode}.yaml", tmp_path / mode)
    assert len(samples) == 2 * 2 * 4
    assert {s["reward"] for s in samples} <= {0.0, 1.0}
    assert all(s["response_tokens"] <= 4 for s in samples)
    bound = {"sync": 0, "one_step_off": 1, "async": 2}[mode]
    assert all(s["trained_version"] - s["behavior_version_min"] <= bound for s in samples)
