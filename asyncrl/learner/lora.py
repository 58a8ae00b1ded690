"""LoRA on the policy (``model.lora``): the adapters put on, what the engines are sent,
and a checkpoint's merged model (``docs/scaling.md``, LoRA).

The learner trains ΔW = B·A·s (s = alpha / rank) on each targeted linear layer through
``peft``; the base weights stay frozen and bit-identical. The engines run a plain model,
so a sync sends each targeted layer's **merged** weight W = W_base + s·B·A under the base
model's own parameter name, and nothing else: every other weight (embeddings, norms, the
LM head) is the base's, which the engines loaded from ``model.path`` and LoRA never
changes (a :class:`~asyncrl.engine.protocol.FullWeights` of those names: any engine loads
it). Merged weights cost out × in per targeted layer
instead of r × (in + out), and are the same function as the learner's adapter forward up
to float rounding (x·Wᵀ + s·(x·Aᵀ)·Bᵀ versus x·(W + s·B·A)ᵀ: the two round differently,
so engine and learner logprobs agree within 1e-4 in float32, not bit for bit: the bound
tests/test_lora.py checks). Where the engine takes them (the default, ``export.py``
decides) a sync sends A, B and the scale alone instead (:func:`adapter_update`, an
:class:`~asyncrl.engine.protocol.AdapterUpdate`) and the built-in engine merges them into
its own copy of the base with the same :func:`merged_weight`: bit for bit the merged
sync's weights (``asyncrl/engine/adapters.py`` argues it).

``peft`` is an optional dependency (the ``lora`` extra): it is imported only when
``model.lora`` is set, so full fine-tuning never needs it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from asyncrl.config import ConfigError, LoraConfig, ModelConfig
from asyncrl.engine.adapters import merged_weight
from asyncrl.weight_updates import AdapterUpdate, LayerAdapter
from asyncrl.policy import adapter_base, merged_adapters, peft_reads_deprecated, resolve_model_path

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig, PeftModel
    from transformers import PreTrainedModel

ADAPTER = "default"
"""peft's name of the one adapter the learner trains."""


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs peft: pip install 'asyncrl[lora]' (or peft>=0.17)") from None
    return peft


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of ``model``'s linear layers (``q_proj``, ``down_proj``,
    ``lm_head`` …): what ``target_modules`` can name."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(cfg: LoraConfig, model: torch.nn.Module) -> None:
    """``cfg.target_modules`` each name a linear layer of ``model`` (a ``ConfigError``
    naming those it has otherwise); ``all-linear`` always does."""
    if cfg.target_modules == "all-linear":
        return
    targets = [cfg.target_modules] if isinstance(cfg.target_modules, str) else cfg.target_modules
    have = linear_names(model)
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in have]
    if missing or not targets:
        raise ConfigError(f"model.lora.target_modules {missing or targets} match no linear layer of "
                          f"{type(model).__name__}; it has {have} (or use all-linear)")


def check_lora(cfg: ModelConfig, model: torch.nn.Module | None) -> None:
    """Pre-flight for ``model.lora`` (exit 2 before any work): peft is installed and the
    targets exist in ``model``, or, where this process loads no weights (Ray, vLLM), in
    the architecture ``model.path`` describes, built on the meta device (no memory)."""
    if cfg.lora is None:
        return
    _peft()
    if model is None:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model_path(cfg.path)))
    check_targets(cfg.lora, model)


def add_adapters(model: PreTrainedModel, cfg: LoraConfig, seed: int = 0) -> PeftModel:
    """``model`` with a fresh adapter on each layer ``cfg.target_modules`` names (B = 0, so
    the wrapped model computes exactly what ``model`` did until the first step; A drawn
    from ``seed`` alone, not from whatever the global RNG holds, so a run's adapters
    depend on its seed only); only the adapters require gradients. ``model`` is changed in
    place (its layers wrapped). Target names that match no linear layer are a
    ``ConfigError`` naming those there are. A value model (a critic, ``value_model.py``)
    is peft's token classifier: its new head ``score`` trains whole and is saved with the
    adapters (peft's ``modules_to_save``)."""
    peft = _peft()
    check_targets(cfg, model)
    value_model = type(model).__name__.endswith("ForTokenClassification")
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=cfg.target_modules, task_type="TOKEN_CLS" if value_model else "CAUSAL_LM",
                             bias="none", modules_to_save=["score"] if value_model else None)
    device = next(model.parameters()).device
    with peft_reads_deprecated(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def peft_model(module: torch.nn.Module) -> PeftModel:
    """``module`` as the ``PeftModel`` it is when ``model.lora`` is set (the learner's
    ``module``, typed as the Hugging Face model it stands in for)."""
    return cast("PeftModel", module)


# peft sets fan_in_fan_out in each LoraLayer subclass's __init__, and declares it on none (the ignores below)
def _weight(layer: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight (nn.Module types an attribute as a tensor or a module)."""
    return cast(torch.Tensor, layer.weight)


def merged_targets(model: PeftModel, *, every_weight: bool = False) -> dict[str, torch.Tensor]:
    """Each adapted layer's merged weight (:func:`merged_weight`), under the base model's
    parameter name (``model.layers.0.self_attn.q_proj.weight``): what the engines load.
    New tensors; the learner goes on training while they are sent. ``every_weight``: the
    frozen rest of the base too, under its own names (as views: it never changes), for an
    engine that takes whole models only (vLLM)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    if every_weight:
        for name, p in model.get_base_model().named_parameters():
            if not p.requires_grad:  # the base's (the adapters are the trainable ones)
                out[name.replace(".base_layer.", ".")] = p.detach()
    with torch.no_grad():
        for name, layer in model.get_base_model().named_modules():
            if not isinstance(layer, LoraLayer) or ADAPTER not in layer.lora_A:
                continue
            a, b = _weight(layer.lora_A[ADAPTER]), _weight(layer.lora_B[ADAPTER])  # (r, in), (out, r)
            out[f"{name}.weight"] = merged_weight(_weight(layer.get_base_layer()), a, b, layer.scaling[ADAPTER],
                                                  transposed=layer.fan_in_fan_out)  # type: ignore[attr-defined]
    return out


def adapter_update(model: PeftModel) -> AdapterUpdate:
    """Each adapted layer's A, B and scale under its base parameter's name, as the engine
    contract's :class:`~asyncrl.engine.protocol.AdapterUpdate` (the built-in engine merges
    them itself: ``asyncrl/engine/adapters.py``). New tensors."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, layer in model.get_base_model().named_modules():
        if isinstance(layer, LoraLayer) and ADAPTER in layer.lora_A:
            a, b = _weight(layer.lora_A[ADAPTER]), _weight(layer.lora_B[ADAPTER])  # (r, in), (out, r)
            layers[f"{name}.weight"] = LayerAdapter(a.detach().clone(), b.detach().clone(),
                                                    float(layer.scaling[ADAPTER]),
                                                    bool(layer.fan_in_fan_out))  # type: ignore[attr-defined]
    config = cast("PeftLoraConfig", model.peft_config[ADAPTER])  # a LoRA model's adapter config
    return AdapterUpdate(layers, rank=config.r, alpha=float(config.lora_alpha))


def base_copy(model: PeftModel) -> PreTrainedModel:
    """A plain model of the base weights alone (adapters removed, not merged), ``model``
    untouched: an in-process engine's start when it is sent adapters alone."""
    return copy.deepcopy(model).unload()


def merged_copy(model: PeftModel) -> PreTrainedModel:
    """A plain model with the adapters merged in (the engine's own copy when it shares the
    learner's process), ``model`` untouched."""
    return copy.deepcopy(model).merge_and_unload()


def load_adapter_weights(model: PeftModel, path: Path) -> None:
    """The adapter weights of a checkpoint's ``adapter_model.safetensors`` into ``model``;
    every adapter weight must be there (a checkpoint of another rank or targets is named)."""
    from safetensors.torch import load_file

    result = _peft().set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ConfigError(f"{path} holds adapters of another shape or targets than model.lora (missing "
                          f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}); resume with the "
                          "model.lora the run was started with")


def save_merged(checkpoint: str | Path, out: str | Path, base: str | Path | None = None) -> Path:
    """Write a LoRA checkpoint's policy as a plain Hugging Face model directory at ``out``
    (base + adapters merged, with the checkpoint's tokenizer), loadable as any
    ``model.path`` (``asyncrl eval``, vLLM, ``from_pretrained``). ``base``: the base model
    (default: the one the adapter's ``adapter_config.json`` names)."""
    from transformers import AutoTokenizer

    checkpoint, out = Path(checkpoint), Path(out)
    base = resolve_model_path(str(base)) if base is not None else adapter_base(checkpoint)
    if base is None:
        raise ConfigError(f"{checkpoint} is not a PEFT adapter directory (no {checkpoint / 'adapter_config.json'})")
    merged_adapters(checkpoint, base).save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    return out

