"""``asyncrl serve-tinker`` in a test: the server on its own thread and event loop, on a
free port, ready (its URL bound) when entered, stopped when left, failed or not."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from asyncrl.config import Config
from asyncrl.tinker.server import TinkerServer, build_service

POLICY = Path(__file__).resolve().parents[1] / "models" / "addition-tiny"
NAME = "addition-tiny"
TOKENS = [6, 7, 16, 8, 9, 22, 9, 11]  # "12+34=46" in the tiny policy's characters


def tiny_config(output_dir: Path, **tinker: object) -> Config:
    """A server of the shipped tiny policy (vocabulary 261, context 32) under :data:`NAME`, on a free port."""
    return Config.model_validate({"model": {"path": str(POLICY), "device": "cpu"}, "output_dir": str(output_dir),
                                  "tinker": {"port": 0, "base_model": NAME, **tinker}})


class ServerThread:
    """The server on its own thread and event loop: entered once it serves, left stopped."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.url = cfg, ""
        self.service = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        service = None
        try:
            service = self.service = build_service(self.cfg)
            server = TinkerServer(service, self.cfg.tinker)
            self.url = await server.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            if service is not None:  # built, never served: its trainer thread ends here all the same
                await service.shutdown()
            raise
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await server.stop()
            await service.shutdown()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(120), "the server did not start in 120 s"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        # not over a failure already on its way out: that one says more
        assert exc[0] is not None or not self._thread.is_alive(), \
            f"the server at {self.url} did not stop within 60 s of being asked"
