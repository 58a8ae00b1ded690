"""A Hugging Face causal LM's forward over a KV cache we own: the one place that knows how
the installed transformers takes that cache, so the engine's prefill and decode and the
learner's shared-prompt forward (``asyncrl/learner/shared_prompts.py``) work across the
whole range ``pyproject.toml`` declares.

Why a helper and not a higher lower bound: transformers 5.24 renamed the forward's
``past_key_values`` argument to ``cache`` (the old name warns on every call and goes in
5.40), and every release before 5.24 knows only ``past_key_values``. Requiring 5.24 would
refuse every older release of the range (and any package pinned to one) over one word.
The name is read from the model class's own ``forward`` signature rather than from the
version number, so a model whose code (``trust_remote_code``) still declares
``past_key_values`` is called with that name on any version.

Invariant: the cache handed in is the cache the forward extends, in place (every version of
the range appends to its layers' tensors), so callers keep their own reference and never
read it back from the output, whose attribute was renamed too (``out.past_key_values`` →
``out.cache``, the old one warning).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Protocol, cast

import torch
from transformers import DynamicCache, PreTrainedModel

CACHE_ARGUMENTS = ("cache", "past_key_values")  # the current name first


@functools.cache
def cache_argument(model_class: type[PreTrainedModel]) -> str:
    """The name under which ``model_class.forward`` takes its KV cache."""
    parameters = inspect.signature(model_class.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise TypeError(f"{model_class.__name__}.forward takes no KV cache (neither `cache` nor `past_key_values` in "
                    f"its signature): the built-in engine and learner.share_prompts call the policy with one; use "
                    f"a transformers causal LM (a *ForCausalLM class), or engine=vllm and learner.share_prompts=false")


class CausalLMOutput(Protocol):
    """What a causal LM's forward returns, as the callers read it: its logits are always set
    (``CausalLMOutputWithPast`` types every field optional)."""

    logits: torch.Tensor


class FilledLayer(Protocol):
    """A full-attention cache layer a forward has written: its keys and values are tensors."""

    keys: torch.Tensor
    values: torch.Tensor


def filled_layers(cache: DynamicCache) -> list[FilledLayer]:
    """``cache``'s layers once a forward has written them: keys and values per layer (transformers
    types a layer as any kind, filled or not)."""
    return cast("list[FilledLayer]", cache.layers)


def forward_with_cache(model: PreTrainedModel, cache: DynamicCache, **inputs: Any) -> CausalLMOutput:
    """``model(**inputs)`` attending over ``cache`` and appending this forward's keys and
    values to it, in place."""
    # a class is hashable, but mypy does not take type[PreTrainedModel] for Hashable
    argument = cache_argument(type(model))  # type: ignore[arg-type]
    return model(**inputs, **{argument: cache}, use_cache=True)
