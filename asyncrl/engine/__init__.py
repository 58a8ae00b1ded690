"""Rollout engines: the protocol, the built-in torch engine (vLLM joins later)."""

from asyncrl.engine.protocol import EngineClosedError, PauseMode, RolloutEngine
from asyncrl.engine.torch_engine import TorchEngine

__all__ = ["EngineClosedError", "PauseMode", "RolloutEngine", "TorchEngine"]


def __getattr__(name: str):
    """``VLLMEngine`` on first use: vLLM is an optional, heavy dependency."""
    if name == "VLLMEngine":
        from asyncrl.engine.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
