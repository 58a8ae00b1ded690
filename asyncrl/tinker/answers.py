"""The answers given to the SDK's requests, by the idempotency key it sends, kept on disk: a
request the server accepted is never run again, also when its retry reaches a restarted server.

Tinker's SDK (its Stainless base client) sends every POST with an ``X-Idempotency-Key`` drawn
once per call and sent again, unchanged, with each retry of it (a lost reply, a timeout, a
server that restarted under it). The first request with a key is run; its answer (a request id,
a session or sampler id) is written here, in memory and as one line of ``answers.jsonl`` beside
the saved states (``tinker.checkpoint_dir``), before it goes out; a retry gets that same answer
back and runs nothing. After a restart the answer names a request of the dead server, whose
poll then says it died with it (``futures.py``): the call is not applied a second time behind
the client's back. Training calls are also deduplicated by their sequence id (``service.py``);
the key covers every call, samples and creations included, and survives a restart.

Only answers that accepted the request are kept: a refused one (4xx) can be sent again fixed,
or unchanged to the same refusal. A retry that arrives while its first is being answered waits
for that answer. The last :data:`KEEP` answers are kept; the file is cut back to them at start.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

KEEP = 16384
"""Answers remembered (an RL step sends a sample request a prompt: thousands a step at most)."""
HEADER = "X-Idempotency-Key"
FILE = "answers.jsonl"

Answer = tuple[int, str, bytes]
"""An answered request: status, content type, body."""


class Answers:
    """Idempotency key → the answer the first request with it got (module docstring)."""

    def __init__(self, directory: Path, keep: int = KEEP) -> None:
        self.path, self.keep = directory / FILE, keep
        self._done: OrderedDict[str, Answer] = OrderedDict()
        self._pending: dict[str, asyncio.Future[Answer]] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines()[-keep:]:
                try:
                    saved = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a crash mid-write: its request was never answered
                    continue
                self._done[saved["key"]] = (saved["status"], saved["type"], saved["body"].encode())
            self.path.write_text("".join(self._line(key, answer) for key, answer in self._done.items()))

    @staticmethod
    def _line(key: str, answer: Answer) -> str:
        status, content_type, body = answer
        return json.dumps({"key": key, "status": status, "type": content_type, "body": body.decode()}) + "\n"

    async def once(self, key: str, answer: Callable[[], Awaitable[Answer]]) -> Answer:
        """The answer for ``key``: the one given before, or ``answer()``'s, kept if it accepted."""
        if key in self._done:
            return self._done[key]
        if key in self._pending:
            return await asyncio.shield(self._pending[key])
        pending = self._pending[key] = asyncio.get_running_loop().create_future()
        try:
            result = await answer()
            if result[0] < 400:
                self._keep(key, result)
            pending.set_result(result)
            return result
        except BaseException as exc:
            pending.set_exception(exc)
            pending.exception()  # retrieved: a retry waiting on it re-raises; none waiting is fine
            raise
        finally:
            del self._pending[key]

    def _keep(self, key: str, answer: Answer) -> None:
        """On disk first, then in memory: a crash between the two loses nothing answered."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.write(self._line(key, answer))
        self._done[key] = answer
        while len(self._done) > self.keep:
            self._done.popitem(last=False)
