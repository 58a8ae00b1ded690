"""What crosses the wire between ``engine: remote``'s client (``asyncrl/engine/remote.py``) and
its servers: a server as the client knows it, the two ways a call fails (a server lost, a
refusal), the fleet's counts, vLLM's spelling of a token, and the weights file a server loads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.engine.vllm_engine import VLLMStats
from asyncrl.types import FinishReason

TOKEN_PREFIX = "token_id:"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class ServerLost(Exception):
    """A server stopped answering; ``tokens``/``logprobs``: what the request had received."""

    def __init__(self, reason: str, tokens: list[int] | None = None, logprobs: list[float] | None = None) -> None:
        super().__init__(reason)
        self.reason, self.tokens, self.logprobs = reason, tokens or [], logprobs or []


class ControlError(RuntimeError):
    """A control call that failed on a server that is up (a refusal, not a lost server)."""


@dataclass(eq=False)
class Server:
    url: str
    model: str = ""
    max_model_len: int = 0
    version: int | None = None  # the label this client last set there (None: unknown)
    usable: bool = False
    lost_reason: str | None = None
    in_flight: int = 0
    requests: int = 0


class RemoteStats(VLLMStats):
    """What the trainer reads (``busy_s``: wall time with a request in flight and the client
    not paused, as for vLLM in-process; the servers' own step times stay with them), and
    the fleet's counts."""

    def __init__(self) -> None:
        super().__init__()
        self.received = 0  # token ids that came over the wire, those without logprobs (yet) included
        self.servers_lost = 0
        self.lost: dict[str, int] = {}  # each server lost so far (its URL) and how many times
        self.reissued_requests = 0  # requests sent again to another server after theirs was lost
        self.reissued_tokens = 0  # tokens carried over to another server instead of sampled again


def _write_atomically(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """``directory/model.safetensors``, written beside it and renamed into place: a server
    never reads half a file, and a checkpoint-format loader sees one complete file."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".model.safetensors.tmp{os.getpid()}"
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / "model.safetensors")


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_PREFIX):
        raise ControlError(f"a completion token {token!r} is not 'token_id:<id>': the server ignored "
                           "return_tokens_as_token_ids")
    return int(token[len(TOKEN_PREFIX):])


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:300]
    return str(error)[:300]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
