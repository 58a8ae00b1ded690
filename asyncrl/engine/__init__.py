"""Rollout engines: the protocol, the built-in torch engine (vLLM joins later)."""

from asyncrl.engine.protocol import EngineClosedError, PauseMode, RolloutEngine
from asyncrl.engine.torch_engine import TorchEngine

__all__ = ["EngineClosedError", "PauseMode", "RolloutEngine", "TorchEngine"]
