"""The refine service: a frozen model reached by URL reads a search's documents and returns
what in them bears on the question, which the agent's model reads instead of the raw hits.

The model is a :class:`~asyncrl.frozen.client.FrozenModel` (any OpenAI-compatible server:
``asyncrl serve``, vLLM), so its calls have what every frozen model's have: at most
``max_concurrency`` in flight, a deadline per try, retries, a failure that names the model,
and counts (``refine.model.stats``). Its text is the search tool's result, i.e. a ``tool``
message of the agent's conversation: environment tokens in the trajectory (loss mask 0),
never trained; the refine model's own sampling is not recorded anywhere.

When the refine fails (down, past its deadline, no usable answer), ``on_failure`` decides:

- ``"raw"`` (the default): the result says ``refine failed: <why>`` and carries the raw
  documents after it. The search itself succeeded and its documents still hold the answer;
  losing them would punish the policy for the service's outage.
- ``"fail"``: the result is ``refine failed: <why>`` alone, for a run that must not train
  on unrefined results (e.g. when raw documents would overflow the context).

Either way the result starts with ``refine failed:``, so the gateway counts it as a tool
error (``types.is_tool_error``) and the run's rows show the outage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.frozen.client import FrozenModel, FrozenModelError

REFINE_FAILED = "refine failed:"
INSTRUCTION = ("You condense search results. Given a question and documents, copy the sentences from the documents "
               "that help answer the question, with the names they mention. Write nothing else. If no sentence "
               "helps, write: nothing relevant.")


@dataclass
class Refiner:
    model: FrozenModel
    on_failure: Literal["raw", "fail"] = "raw"
    max_tokens: int = 200

    def __post_init__(self) -> None:
        if self.on_failure not in ("raw", "fail"):
            raise ValueError(f"refine on_failure must be 'raw' or 'fail', got {self.on_failure!r}")

    async def refine(self, question: str, documents: str) -> str:
        """The refined text for ``documents`` (the search's result as the model would read it)."""
        messages = [{"role": "system", "content": INSTRUCTION},
                    {"role": "user", "content": f"Question: {question}\n\nDocuments:\n{documents}"}]
        try:
            text = (await self.model.chat(messages, max_tokens=self.max_tokens, temperature=0.0)).strip()
            if not text:
                raise FrozenModelError(f"{self.model}: answered an empty refinement")
        except FrozenModelError as exc:
            if self.on_failure == "fail":
                return f"{REFINE_FAILED} {exc}"
            return f"{REFINE_FAILED} {exc}. The documents, unrefined:\n{documents}"
        return text
