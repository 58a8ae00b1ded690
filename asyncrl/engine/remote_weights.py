"""How new weights reach ``engine: remote``'s servers, three ways (the client picks by the
update's type and ``remote.weight_transfer``):

- :class:`FullWeights` through files: written once as safetensors under
  ``remote.weights_dir``; each server ``reload_weights`` from there, drops its prefix cache,
  takes the new label;
- :class:`FullWeights` through NCCL: vLLM's weight transfer (init once, then start →
  update while this trainer broadcasts → finish with the version; ``remote_nccl.py``);
- :class:`AdapterUpdate`: a PEFT adapter directory ``lora-v<version>`` each server loads
  through vLLM's LoRA loading, the previous one unloaded.

Invariants: what is written is written before the caller pauses the servers (a shorter
stall); every delivery ends with the server's label set to the version it now serves; a
server lost on the way is left out and gets the latest weights when it comes back
(:meth:`FleetWeights.bring_back`), except from an NCCL group, which cannot take it back.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import RemoteConfig
from asyncrl.engine.protocol import AdapterUpdate, FullWeights
from asyncrl.engine.remote_fleet import Fleet
from asyncrl.engine.remote_nccl import WeightBroadcast, free_port, local_address, update_info
from asyncrl.engine.remote_wire import (ControlError, Server, ServerLost, _describe, _write_atomically,
                                        write_peft_adapter)
from asyncrl.threads import settle_threadsafe

ADAPTER_PREFIX = "lora-v"
"""The names this client gives the LoRA adapters it loads (``lora-v<version>``)."""
LOAD_KNOB = "remote.weight_load_timeout_s"


class FleetWeights:
    """The weights the fleet serves: where they are written, the latest of each kind (what a
    revived server loads), and the NCCL group once formed. ``broadcast``: what moves the
    tensors with ``remote.weight_transfer=nccl`` (default: vLLM's own helpers, built at the
    first such update; a test passes another)."""

    def __init__(self, fleet: Fleet, settings: RemoteConfig, broadcast: WeightBroadcast | None = None) -> None:
        self.fleet, self.settings = fleet, settings
        self._own_dir = settings.weights_dir is None
        self.weights_dir = Path(settings.weights_dir or tempfile.mkdtemp(prefix="asyncrl-weights-"))
        self.weights_file: Path | None = None  # the latest weights' directory: what a revived server loads
        self.adapter: tuple[str, Path] | None = None  # the latest LoRA adapter's name and directory
        self._broadcast = broadcast
        self.nccl_group: list[Server] | None = None  # the servers in the NCCL group, once it is formed

    async def prepare(self, update: FullWeights | AdapterUpdate, version: int) -> Coroutine[Any, Any, None]:
        """Write what the servers will read (now, before any pause) and return the delivery
        to await while every server is paused."""
        if isinstance(update, AdapterUpdate):
            path = self.weights_dir / f"{ADAPTER_PREFIX}{version}"
            await asyncio.to_thread(write_peft_adapter, update, path)
            return self._adapter_update(f"{ADAPTER_PREFIX}{version}", path, version)
        if self.settings.weight_transfer == "nccl":
            return self._nccl_update([(name, t.detach()) for name, t in update.tensors.items()], version)
        path = self.weights_dir / f"v{version}"  # a directory: vLLM's reload_weights loads a checkpoint dir
        tensors_cpu = {name: t.detach().cpu().contiguous() for name, t in update.tensors.items()}
        await asyncio.to_thread(_write_atomically, tensors_cpu, path)
        return self._files_update(path, version)

    # ---------------------------------------------------------------- files
    async def _files_update(self, path: Path, version: int) -> None:
        await asyncio.gather(*[self._load(s, path, version) for s in self.fleet.usable()])
        old, self.weights_file = self.weights_file, path
        if old is not None and old != path:
            shutil.rmtree(old, ignore_errors=True)

    async def _load(self, server: Server, path: Path, version: int) -> None:
        """``reload_weights`` from ``path``, the prefix cache dropped, the label set; a server
        lost on the way is left out (it reloads when it comes back)."""
        try:
            await self._reload(server, path)
            await self.fleet.call(server, "POST", "/update_weight_version", {"new_version": str(version)})
            server.version = version
        except ServerLost as exc:
            self.fleet.lose(server, exc.reason)

    async def _reload(self, server: Server, path: Path) -> None:
        await self.fleet.call(server, "POST", "/collective_rpc",
                              {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
                              timeout=self.settings.weight_load_timeout_s, knob=LOAD_KNOB)
        await self.fleet.call(server, "POST", "/reset_prefix_cache", missing_ok=True)

    # ---------------------------------------------------------------- adapters
    async def _adapter_update(self, name: str, path: Path, version: int) -> None:
        await asyncio.gather(*[self._load_adapter(s, name, path, version) for s in self.fleet.usable()])
        old, self.adapter = self.adapter, (name, path)
        if old is not None and old[1] != path:
            shutil.rmtree(old[1], ignore_errors=True)

    async def _load_adapter(self, server: Server, name: str, path: Path, version: int,
                            loaded: set[str] | None = None) -> None:
        """``POST /v1/load_lora_adapter`` (unless ``loaded`` holds it already), the previous
        adapter unloaded, the label set; from then on the server's requests name ``name``.
        A refusal (any status but 503: vLLM answers a failed load with 500) is a
        ``ControlError``; a server lost on the way is left out (it loads when it comes back)."""
        call = self.fleet.call
        try:
            await self._refuse_replicas(server)
            if loaded is None or name not in loaded:
                await call(server, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                           timeout=self.settings.weight_load_timeout_s, knob=LOAD_KNOB, refused_5xx=True)
            old = server.adapter
            server.adapter = name
            if old is not None and old != name and (loaded is None or old in loaded):
                await call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": old}, missing_ok=True)
            await call(server, "POST", "/update_weight_version", {"new_version": str(version)})
            server.version = version
        except ServerLost as exc:
            if not self.fleet.lose(server, exc.reason):  # a revival's: the caller's to handle
                raise

    async def _refuse_replicas(self, server: Server) -> None:
        """A ``vllm serve --data-parallel-size N`` runs N engines behind one URL, and its
        ``/v1/load_lora_adapter`` reaches only the one that answered: the others would serve
        the base under the adapter's name. Refused, with the way out (``GET /get_world_size``
        with and without the data-parallel ranks; a server without the route has one)."""
        if server.replicas is None:
            both = [await self.fleet.call(server, "GET", f"/get_world_size?include_dp={flag}", missing_ok=True)
                    for flag in ("true", "false")]
            sizes = [int(b["world_size"]) for b in both if isinstance(b, dict) and "world_size" in b]
            server.replicas = sizes[0] // max(sizes[1], 1) if len(sizes) == 2 else 1
        if server.replicas > 1:
            raise ControlError(f"engine server {server.url} runs {server.replicas} data-parallel engines behind one "
                               "URL, and vLLM's /v1/load_lora_adapter loads an adapter into only the one that answers "
                               "(the others would serve the base under its name): start each as a server of its own "
                               "(one URL each in remote.urls), or set model.lora.sync=merged")

    # ---------------------------------------------------------------- NCCL
    async def _nccl_update(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """vLLM's weight transfer: start, receive while the trainer broadcasts, finish with
        the label, then the prefix cache dropped. Every server of the group must take part:
        any failure names the server and the call and fails the update."""
        group = await self._nccl_join()
        await self._on_group(group, "POST", "/start_weight_update")
        receive = [self._nccl_call(s, "POST", "/update_weights", {"update_info": update_info(tensors)})
                   for s in group]
        await _all(*receive, self._on_thread(self._broadcaster().send, tensors,
                                             what="the trainer's NCCL broadcast"))
        await self._on_group(group, "POST", "/finish_weight_update", {"weight_version": str(version)})
        for server in group:
            await self._nccl_call(server, "POST", "/reset_prefix_cache", missing_ok=True)
            server.version = version

    async def _nccl_join(self) -> list[Server]:
        """Once: the NCCL group of this trainer (rank 0) and every usable server's workers,
        each server at its rank offset (``GET /get_world_size``: its TP × PP × DP)."""
        if self.nccl_group is not None:
            return self.nccl_group
        group = self.fleet.usable()
        sizes = [int((await self._nccl_call(s, "GET", "/get_world_size"))["world_size"]) for s in group]
        address = self.settings.nccl_address or local_address(group[0].url)
        port = self.settings.nccl_port or free_port(address)
        world = 1 + sum(sizes)
        broadcast = self._broadcaster()
        offsets = [1 + sum(sizes[:i]) for i in range(len(group))]
        inits = [self._nccl_call(s, "POST", "/init_weight_transfer_engine",
                                 {"init_info": {"master_address": address, "master_port": port, "rank_offset": offset,
                                                "world_size": world, **broadcast.wire()}})
                 for s, offset in zip(group, offsets)]
        await _all(*inits, self._on_thread(broadcast.join, address, port, world,
                                           what=f"the trainer joining the NCCL group at {address}:{port}"))
        self.nccl_group = group
        return group

    def _broadcaster(self) -> WeightBroadcast:
        if self._broadcast is None:
            from asyncrl.engine.remote_nccl import VLLMBroadcast

            self._broadcast = VLLMBroadcast()
        return self._broadcast

    async def _on_group(self, group: list[Server], method: str, path: str, body: dict[str, Any] | None = None) -> None:
        await _all(*[self._nccl_call(s, method, path, body) for s in group])

    async def _nccl_call(self, server: Server, method: str, path: str, body: dict[str, Any] | None = None, *,
                         missing_ok: bool = False) -> Any:
        """A call of the NCCL choreography under ``remote.weight_load_timeout_s``; a lost
        server fails the update (the group cannot go on without its ranks)."""
        try:
            return await self.fleet.call(server, method, path, body, timeout=self.settings.weight_load_timeout_s,
                                         knob=LOAD_KNOB, missing_ok=missing_ok, refused_5xx=True)
        except ServerLost as exc:
            self.fleet.lose(server, exc.reason)
            server.revivable = False
            raise ControlError(f"engine server {server.url}: {exc.reason}, during NCCL weight transfer "
                               "(remote.weight_transfer=nccl): the transfer group needs every server it was formed "
                               "with; restart the servers and the run, or use remote.weight_transfer=files") from None

    async def _on_thread(self, fn: Any, *args: Any, what: str) -> Any:
        """``fn(*args)`` on a daemon thread of its own under ``remote.weight_load_timeout_s``:
        a collective whose peers never come blocks it for good, and an abandoned daemon never
        holds the exit."""
        limit = self.settings.weight_load_timeout_s
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the caller
                result, error = None, exc
            settle_threadsafe(loop, future, result, error)

        threading.Thread(target=run, name="asyncrl-nccl", daemon=True).start()
        try:
            async with asyncio.timeout(limit):
                return await future
        except TimeoutError:
            raise ControlError(f"{what} did not finish within {limit:g} s ({LOAD_KNOB})") from None
        except ControlError:
            raise
        except Exception as exc:
            raise ControlError(f"{what} failed: {_describe(exc)}") from exc

    # ---------------------------------------------------------------- revival and shutdown
    def check_revivable(self, server: Server) -> None:
        """``ControlError`` for a server that can never be sent weights again: once an NCCL
        group is formed, one outside it (it is then never tried again)."""
        if self.nccl_group is not None:
            server.revivable = False
            raise ControlError("it is outside the NCCL weight-transfer group formed at the first sync "
                               "(remote.weight_transfer=nccl), so it would serve stale weights: not used again")

    async def bring_back(self, server: Server, version: int, loaded: set[str]) -> None:
        """A server that answers again, paused: the current adapter loaded again (a restarted
        server has none), or the latest weights file where it serves another version; then
        its label. ``loaded``: the adapters its model card lists."""
        self.check_revivable(server)
        if self.adapter is not None:
            await self._load_adapter(server, *self.adapter, version, loaded=loaded)
            return
        info = await self.fleet.call(server, "GET", "/weight_info", missing_ok=True)
        if (info.get("weight_version") if isinstance(info, dict) else None) != str(version):
            if self.weights_file is not None:
                await self._reload(server, self.weights_file)
            await self.fleet.call(server, "POST", "/update_weight_version", {"new_version": str(version)})

    async def close(self) -> None:
        """An NCCL group's servers are told to leave it (``POST /shutdown_weight_transfer_engine``),
        so a later trainer can form its own; the weights this client wrote in a directory of its
        own are removed."""
        if self.nccl_group is not None:
            async def leave(server: Server) -> None:
                try:
                    await self.fleet.call(server, "POST", "/shutdown_weight_transfer_engine", missing_ok=True)
                except (ServerLost, ControlError):
                    pass  # closing: a server that cannot be told is gone or refusing, and it forms anew later

            if self.fleet.is_open:
                await asyncio.gather(*[leave(s) for s in self.nccl_group if s.usable])
            self.nccl_group = None
        if self._broadcast is not None:
            self._broadcast.close()
        if self._own_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


async def _all(*calls: Any) -> None:
    """Await ``calls`` together; the first to fail cancels the others (a broken NCCL group
    leaves them waiting on peers) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if (error := task.exception()) is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
