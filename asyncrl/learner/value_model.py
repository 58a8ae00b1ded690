"""The critic's model: a causal LM's backbone with a scalar value head, V per position.

It is a Hugging Face token-classification model with one label
(``AutoModelForTokenClassification``, ``num_labels=1``): the backbone under ``model.*`` as
the policy's checkpoint names it, the head a ``Linear(hidden, 1)`` named ``score``. Built
from a policy (a causal LM directory), the backbone is the policy's weights and the head is
new; built from a directory this model saved, both are loaded. Why this form rather than
a backbone and a separate head file: it *is* a ``PreTrainedModel``, so what the learner
does with the policy applies unchanged — ``save_pretrained`` writes one ordinary model
directory (reloaded by ``from_pretrained``, here or anywhere), parameters are named for the
optimizer's checkpoint, sharding and LoRA see a Hugging Face model. The price: only
architectures that transformers gives a token-classification class (Qwen2/3, Llama —
SmolLM2 — Mistral, Phi-3, Gemma 2 among them, not every causal LM) can have a critic;
another is refused naming its type.

Dropout before the head is off: V and the V_old it is clipped against must be one function
of the weights, or the value clip measures noise.

Alignment: ``token_values(...)[:, j]`` reads the hidden state after token j, the state in
which token j + 1 is chosen, so ``[:, :-1]`` lies on the learner's target axis beside the
loss mask (``learner/batch.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

from asyncrl.config import ConfigError
from asyncrl.policy import resolve_model_path


def load_value_model(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The value model at ``path`` (resolved as ``model.path`` is): a causal LM's backbone
    with a new head, or a value model saved with ``save_pretrained``, head included."""
    directory = resolve_model_path(path)
    config = AutoConfig.from_pretrained(directory)
    if config.model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        raise ConfigError(f"value model {path!r}: transformers has no token-classification model for its type "
                          f"{config.model_type!r}, so it cannot carry a value head; give a Qwen2/Qwen3/Llama-like "
                          "model as the critic's path")
    saved_critic = any(name.endswith("ForTokenClassification") for name in config.architectures or ())
    if saved_critic and config.num_labels != 1:
        raise ConfigError(f"value model {path!r} is a token classifier with {config.num_labels} labels, not a "
                          "value model (1 label)")
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(directory, config=config, dtype=dtype)


def token_values(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """V at every position, (B, L) float32, of input_ids and attention_mask (B, L).
    Padding's values are whatever the head makes of it: GAE and the value loss mask them."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, L, 1)
    return logits.squeeze(-1).float()
