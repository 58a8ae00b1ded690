"""Rollout engines: the contract (``protocol.py``), the table of engine kinds and what each
can do (``kinds.py``), the one factory that builds a configured kind (``factory.py``), and
the kinds themselves: the built-in ``torch`` engine (``torch_engine.py``), vLLM in-process
(``vllm_engine.py``) and servers by URL (``remote.py``).

Names resolve on first use: ``asyncrl.config.engine_kinds`` is read by the config on the ground
floor, which must not pay for torch; vLLM is an optional, heavy dependency.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "AdapterUpdate": "asyncrl.engine.protocol", "EngineClosedError": "asyncrl.engine.protocol",
    "FullWeights": "asyncrl.engine.protocol", "LayerAdapter": "asyncrl.engine.protocol",
    "PauseMode": "asyncrl.engine.protocol", "PromptTooLongError": "asyncrl.engine.protocol",
    "RolloutEngine": "asyncrl.engine.protocol", "WeightUpdate": "asyncrl.engine.protocol",
    "TorchEngine": "asyncrl.engine.torch_engine", "VLLMEngine": "asyncrl.engine.vllm_engine",
    "RemoteEngine": "asyncrl.engine.remote", "ENGINE_KINDS": "asyncrl.config.engine_kinds",
    "EngineKind": "asyncrl.config.engine_kinds", "engine_kind": "asyncrl.config.engine_kinds",
    "build_engine": "asyncrl.engine.factory",
}

__all__ = sorted([*_LAZY, "require_engine"])


def require_engine(name: str) -> None:
    """Refuse, before any work, an engine this environment cannot run."""
    from asyncrl.config import ConfigError
    from asyncrl.config.engine_kinds import engine_kind

    if (missing := engine_kind(name).missing()) is not None:
        raise ConfigError(missing)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
