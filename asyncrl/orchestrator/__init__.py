"""Orchestration between rollouts and the learner: when groups may start, how staleness stays bounded."""

from asyncrl.orchestrator.staleness import AsyncStalenessGate, StalenessGate

__all__ = ["AsyncStalenessGate", "StalenessGate"]
