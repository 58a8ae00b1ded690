"""The critic's value model on the shipped tiny policy: built from the policy, saved as a
Hugging Face directory and reloaded to the same values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Olmo2Config

from asyncrl.config import ConfigError
from asyncrl.learner.value_model import load_value_model, token_values

POLICY = str(Path(__file__).resolve().parents[1] / "models" / "countdown-tiny")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of the tiny policy's ids (vocabulary 261), the second right-padded by 3."""
    ids = torch.randint(4, 261, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0
    ids[1, 9:] = 0  # the policy's pad id
    return ids, attention


def test_a_value_model_from_the_policy_saves_and_reloads_to_identical_values(tmp_path):
    torch.manual_seed(0)
    critic = load_value_model(POLICY).eval()
    ids, attention = batch()
    with torch.no_grad():
        values = token_values(critic, ids, attention)
    assert values.shape == (2, 12) and values.dtype == torch.float32 and torch.isfinite(values).all()
    # the backbone is the policy's, to the bit; the head is new: Linear(hidden 128, 1)
    policy = AutoModelForCausalLM.from_pretrained(POLICY).model.state_dict()
    backbone = critic.model.state_dict()
    assert backbone.keys() == policy.keys() and all(torch.equal(backbone[k], policy[k]) for k in policy)
    assert (critic.score.in_features, critic.score.out_features) == (128, 1)

    critic.save_pretrained(tmp_path)
    reloaded = load_value_model(str(tmp_path)).eval()
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()  # an ordinary HF checkpoint
    with torch.no_grad():
        assert torch.equal(token_values(reloaded, ids, attention), values)
        assert torch.equal(token_values(plain, ids, attention), values)


def test_the_value_head_has_no_dropout():
    # the value clip compares V with V_old of the same weights: train mode must not add noise
    critic = load_value_model(POLICY)
    ids, attention = batch()
    with torch.no_grad():
        trained = token_values(critic.train(), ids, attention)
        evaluated = token_values(critic.eval(), ids, attention)
    assert critic.dropout.p == 0.0 and torch.equal(trained, evaluated)


def test_a_policy_without_a_token_classification_class_is_refused_naming_its_type(tmp_path):
    Olmo2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=32).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"no token-classification model for its type 'olmo2'"):
        load_value_model(str(tmp_path))
