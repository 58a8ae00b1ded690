"""Seeds derived from where a random draw sits in a run, never from when or where it ran.

Every episode's sampling seed is a hash of the run's seed and the episode's coordinates
(training or evaluation, task, which draw of that task, sample index in its group,
attempt). The engine turns a request seed into counter-based noise
(``engine/sampling.py``), so an episode's tokens are a function of the weights, the
prompt and these coordinates alone: not of the batch around it, the worker that ran it,
the order groups finished in, or an abort-and-resume. That is what makes ``mode=async``
with ``max_staleness=0`` train on exactly the samples ``mode=sync`` does, and a run
repeat itself.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

Purpose = Literal["train", "eval"]
"""A salt: an evaluation never reuses a training episode's noise."""


def derive_seed(*parts: int | str) -> int:
    """A seed in ``[0, 2**63)`` that is a stable function of ``parts`` (blake2b of their
    JSON, so ``("1", 2)`` and ``(1, "2")`` differ and no two tuples collide by concatenation):
    the same in any process, on any machine, with any ``PYTHONHASHSEED``."""
    digest = hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def episode_seed(run_seed: int, purpose: Purpose, task_id: str, draw: int, sample: int, attempt: int) -> int:
    """The sampling seed of one attempt of one episode. ``draw``: which time this task is
    handed out (its train epoch; 0 for evaluation, so every evaluation of a task meets the
    same noise and steps compare with less variance); ``sample``: its index in the group
    (or among an evaluation's samples of the task); ``attempt``: 1 for the first, a retry
    samples anew. Every turn of a multi-turn episode shares the seed: the engine keys the
    noise on the token's position too, so turns still draw distinct noise."""
    return derive_seed(run_seed, purpose, task_id, draw, sample, attempt)


def rollout_worker_seed(run_seed: int, worker: int, version: int, restarts: int = 0) -> int:
    """A rollout worker's engine seed: the noise of requests without their own seed and, on
    vLLM, the seed of its Python, NumPy and torch generators (NumPy takes at most 32 bits,
    hence the modulus). ``worker``: its index (0 for the local runtime's one worker);
    ``version``: the policy version it starts at; ``restarts``: the replacements of dead
    workers so far, so a replacement does not replay its predecessor's noise. Episodes
    never depend on it: each samples with its own :func:`episode_seed`."""
    return derive_seed(run_seed, "rollout_worker", worker, version, restarts) % 2**32
