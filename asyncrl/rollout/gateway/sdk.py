"""What an agent written against the official ``openai`` SDK calls to reach the gateway's
own endpoints, with the client it already has (pointed at its session's base URL): no
second HTTP client, and the SDK's key, timeouts and retries apply."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI


def set_turn_reward(client: AsyncOpenAI | OpenAI, reward: float, turn: int = -1) -> Any:
    """``POST <session>/v1/turn_reward``: model call ``turn`` of the session's episode
    (default -1, the latest reply) gets its own ``reward`` (``LLMClient.set_turn_reward``:
    set, not added, so the SDK's retry of a lost answer cannot count it twice). Returns the
    gateway's answer ``{"turn": index, "reward": reward}`` — a coroutine to await with
    ``AsyncOpenAI``. A refusal raises the SDK's ``BadRequestError`` naming the fault."""
    return client.post("turn_reward", body={"reward": reward, "turn": turn}, cast_to=dict)
