"""When ``engine: remote`` calls a server lost (``asyncrl/engine/remote_fleet.py``): never for
a request that did not reach it (sent once more on a fresh connection), never for a stream our
own pause cut, and only when its ``/health`` fails too. Against raw sockets that close or
reset a reused connection, and in-process ``serve-engine`` servers (``EngineServer``, the
code ``asyncrl serve-engine`` runs) made to close idle connections or end an aborted stream
as ``vllm serve`` does (no finish reason)."""

from __future__ import annotations

import asyncio
import copy
import random
import socket
import struct

import aiohttp
import pytest
from aiohttp import web
from conftest import make_model

from asyncrl.config import EngineServerConfig, RemoteConfig
from asyncrl.engine import TorchEngine
from asyncrl.engine.remote import FAILURES_LIMIT, RemoteEngine
from asyncrl.engine.remote_fleet import Fleet
from asyncrl.engine.remote_wire import RemoteStats, Server, Wire
from asyncrl.rollout import engine_server
from asyncrl.rollout.engine_server import EngineServer
from asyncrl.types import SamplingParams


class _DropsReusedConnections:
    """An HTTP server that answers the first request of each connection (keep-alive) and, when
    a second request arrives on it, closes it unanswered (``reset``: with a TCP reset, as a
    server whose socket is gone): what a server closing idle keep-alive connections looks
    like to a client that reuses one just then."""

    def __init__(self, reset: bool) -> None:
        self.reset = reset
        self.answered = 0
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not first:  # dropped before its body is read: the client may still be writing it
                    self.dropped += 1
                    if self.reset:
                        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                                   struct.pack("ii", 1, 0))
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                first = False
                self.answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                             b"Connection: keep-alive\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away: nothing of this test's is lost
        finally:
            writer.close()


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_request_on_a_connection_the_server_dropped_is_sent_again_and_the_server_not_lost(reset):
    async def main():
        peer = _DropsReusedConnections(reset)
        listener = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        fleet = Fleet(RemoteConfig(urls=[f"http://127.0.0.1:{port}"], control_timeout_s=10), RemoteStats())
        fleet.open()
        try:
            server: Server = fleet.servers[0]
            server.usable = True
            for _ in range(4):  # each call after the first reuses the connection the server then drops
                assert await fleet.call(server, "POST", "/pause?mode=abort", {"pad": "x" * 4096}) == {}
            return peer.answered, peer.dropped, fleet.live().resent, server.usable, fleet.stats.servers_lost
        finally:
            await fleet.close()
            listener.close()
            await listener.wait_closed()

    answered, dropped, resent, usable, lost = asyncio.run(main())
    assert dropped >= 1, "the client never reused a connection: the case is not exercised"
    assert answered == 4 and resent == dropped and usable and lost == 0


class _FailsFirst:
    """A session whose first request fails with ``error`` before reaching any server."""

    def __init__(self, error: BaseException, session: aiohttp.ClientSession) -> None:
        self.error, self.session, self.calls = error, session, 0

    async def request(self, method: str, url: str, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return await self.session.request(method, url, **kwargs)


@pytest.mark.parametrize("error, resent", [
    (aiohttp.ClientOSError(32, "Can not write request body"), True),  # the vLLM lane's false loss on 83737f1
    (aiohttp.ServerDisconnectedError(), True),
    (ConnectionResetError(104, "Connection reset by peer"), True),
    (aiohttp.ServerTimeoutError("Timeout on reading data from socket"), False),  # it had the request
], ids=["write-failed", "disconnected", "reset", "read-timeout"])
def test_only_a_request_that_never_reached_its_server_is_sent_once_more_on_a_fresh_connection(error, resent):
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def main():
        from asyncrl.json_api import listen

        app = web.Application()
        app.router.add_get("/x", ok)
        runner, url = await listen(app, "127.0.0.1", 0)
        wire = Wire({})
        wire.pooled = _FailsFirst(error, wire.pooled)  # type: ignore[assignment]
        try:
            async with await wire.request("GET", f"{url}/x") as response:
                return await response.json(), wire.resent
        finally:
            await wire.pooled.session.close()
            await wire.fresh.close()
            await runner.cleanup()

    if resent:
        assert asyncio.run(main()) == ({"ok": True}, 1)
    else:
        with pytest.raises(type(error)):
            asyncio.run(main())


# ------------------------------------------------------- in-process serve-engine servers
def _as_vllm(monkeypatch) -> None:
    """serve-engine's replies as ``vllm serve``'s: tokens and logprobs, no per-token versions,
    and an aborted stream that ends with no finish reason."""
    original = EngineServer._reply

    def reply(self, completion, *, final):
        out = original(self, completion, final=True)
        choice = out["choices"][0]
        del choice["completion"]
        if completion.finish_reason == "abort":
            choice["finish_reason"] = None
        return out

    monkeypatch.setattr(EngineServer, "_reply", reply)


def _keep_alive(monkeypatch, seconds: float) -> None:
    """serve-engine closing a connection idle for ``seconds`` (vLLM's server: 5 s)."""
    original = engine_server.listen
    monkeypatch.setattr(engine_server, "listen",
                        lambda app, host, port, **kw: original(app, host, port, keepalive_timeout=seconds, **kw))


class _Servers:
    def __init__(self, n: int, server_class: type[EngineServer] = EngineServer) -> None:
        self.n, self.server_class, self.servers = n, server_class, []

    async def __aenter__(self) -> list[str]:
        model = make_model()
        for _ in range(self.n):
            server = self.server_class(TorchEngine(copy.deepcopy(model), seed=0), model_name="tiny",
                                       settings=EngineServerConfig(port=0))
            self.servers.append(server)
            await server.start()
        return [s.base_url for s in self.servers]

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers:
            await server.stop()
            await server.engine.shutdown()


async def _first_tokens(remote: RemoteEngine, before: int, limit_s: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while remote.stats.received <= before:
        assert asyncio.get_running_loop().time() < deadline, f"no token streamed within {limit_s:g} s"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_stream_our_own_pause_cut_is_a_paused_request_even_on_one_server(monkeypatch, mode):
    """vLLM ends a stream its pause aborted with no finish reason; that once read as a lost
    server (7 in 16 steps), and with one server the requests failed (``EngineClosedError``)."""
    _as_vllm(monkeypatch)

    async def main():
        async with _Servers(1) as urls:
            remote = await RemoteEngine.connect(RemoteConfig(urls=urls))
            try:
                tasks = [asyncio.create_task(remote.generate([5 + i, 6], SamplingParams(max_tokens=150, seed=i)))
                         for i in range(6)]
                await _first_tokens(remote, 0)
                await remote.pause(mode)
                await remote.resume()  # before the gather: a request that reached the paused server waits for it
                done = await asyncio.gather(*tasks)
                after = await remote.generate([9, 9], SamplingParams(max_tokens=4, seed=0))
                return done, after, remote.stats.servers_lost, remote.stats.suspected
            finally:
                await remote.shutdown()

    done, after, lost, suspected = asyncio.run(main())
    assert lost == 0 and suspected == 0
    if mode == "abort":
        assert all(c.finish_reason in ("abort", "length") for c in done)
        assert any(c.finish_reason == "abort" for c in done), [c.finish_reason for c in done]
    else:
        assert [len(c.token_ids) for c in done] == [150] * 6
    assert len(after.token_ids) == 4


def test_rounds_across_the_servers_keep_alive_with_pauses_that_abort_lose_no_server(monkeypatch):
    """The vLLM lane's stress test in small (tests/test_vllm_remote.py): bursts of requests
    after idle gaps drawn around the servers' keep-alive timeout, each burst cut by a pause
    with abort; no server is ever called lost."""
    _as_vllm(monkeypatch)
    keep_alive = 0.3
    _keep_alive(monkeypatch, keep_alive)
    rng = random.Random(0)

    async def main():
        async with _Servers(2) as urls:
            remote = await RemoteEngine.connect(RemoteConfig(urls=urls))
            finishes: list[str] = []
            try:
                for r in range(12):
                    await asyncio.sleep(rng.uniform(0.9 * keep_alive, 1.1 * keep_alive))
                    before = remote.stats.received
                    tasks = [asyncio.create_task(remote.generate([3 + i % 40, 1 + r], SamplingParams(
                        max_tokens=40, seed=i))) for i in range(16)]
                    await _first_tokens(remote, before)
                    await remote.pause("abort")
                    await remote.resume()  # a request that reached a paused server waits for the resume
                    finishes += [c.finish_reason for c in await asyncio.gather(*tasks)]
                return finishes, remote.stats.servers_lost, [s.usable for s in remote.servers]
            finally:
                await remote.shutdown()

    finishes, lost, usable = asyncio.run(main())
    assert len(finishes) == 12 * 16 and set(finishes) <= {"abort", "length"}
    assert lost == 0 and usable == [True, True]


class _FailsCompletions(EngineServer):
    """serve-engine whose ``/v1/completions`` answers 503 to the first ``failures`` requests
    (``None``: every one) while its ``/health`` answers."""

    failures: int | None = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed = 0

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if self.failures is None or self.failed < self.failures:
            self.failed += 1
            return web.Response(status=503, text="busy")
        return await super()._completions(request)


def test_a_server_whose_health_check_answers_is_not_lost_for_one_failed_request():
    async def main():
        async with _Servers(1, _FailsCompletions) as urls:
            remote = await RemoteEngine.connect(RemoteConfig(urls=urls))
            try:
                done = await remote.generate([5, 6], SamplingParams(max_tokens=5, seed=0))
                return done, remote.stats.servers_lost, remote.stats.suspected, remote.servers[0].usable
            finally:
                await remote.shutdown()

    done, lost, suspected, usable = asyncio.run(main())
    assert len(done.token_ids) == 5 and lost == 0 and suspected == 1 and usable


def test_a_server_that_answers_health_but_fails_every_request_is_lost_after_a_bounded_number(monkeypatch, capsys):
    monkeypatch.setattr(_FailsCompletions, "failures", None)

    async def main():
        async with _Servers(1, _FailsCompletions) as urls:
            fine = EngineServer(TorchEngine(make_model(), seed=0), model_name="tiny",
                                settings=EngineServerConfig(port=0))
            await fine.start()
            remote = await RemoteEngine.connect(RemoteConfig(urls=[*urls, fine.base_url]))
            try:
                remote._fleet.pick((5, 6))  # the first server is the prompt's own (the least loaded: both idle)
                done = await remote.generate([5, 6], SamplingParams(max_tokens=5, seed=0))
                return done, remote.stats.servers_lost, urls[0], [s.usable for s in remote.servers]
            finally:
                await remote.shutdown()
                await fine.stop()
                await fine.engine.shutdown()

    done, lost, url, usable = asyncio.run(main())
    assert len(done.token_ids) == 5 and lost == 1 and usable == [False, True]
    assert (f"engine server {url} lost (POST /v1/completions answered 503: busy; {FAILURES_LIMIT} times for one "
            "request, though GET /health answers)") in capsys.readouterr().err


STOPPED_AFTER_STEP_1: list = []


async def stop_the_only_server_after_step_1(event) -> None:
    """``hooks.on_step_end``: the run's one server goes away after step 1."""
    if event.step == 1 and STOPPED_AFTER_STEP_1:
        await STOPPED_AFTER_STEP_1.pop().stop(0)


@pytest.mark.slow
def test_a_run_that_loses_its_whole_fleet_early_names_a_checkpoint_to_resume_from(tmp_path, capsys):
    """The lost fleet of 83737f1 ended a run with no checkpoint (``save_every`` 0, the first
    one 10 minutes in) and advice to resume. Now the first step is checkpointed on a fleet,
    and the failure names that checkpoint."""
    from test_remote_engine import ThreadFleet, _policy

    from asyncrl.cli import main

    fleet = ThreadFleet(_policy("models/addition-tiny"), 1)
    try:
        STOPPED_AFTER_STEP_1.append(fleet)
        code = main(["train", "examples/addition/async.yaml", f"output_dir={tmp_path}", "total_steps=6",
                     "eval_every=0", "engine=remote", f"remote.urls=[{fleet.fleet.urls[0]}]",
                     "remote.health_interval_s=0.2", "remote.control_timeout_s=10",
                     "hooks.on_step_end=test_remote_losses:stop_the_only_server_after_step_1"])
    finally:
        STOPPED_AFTER_STEP_1.clear()
        fleet.close()
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert "no engine server is left" in err
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved and saved[-1] in ("step_1", "step_2"), saved  # the early one (a step may finish meanwhile)
    assert (f"last good checkpoint: {tmp_path / 'checkpoints' / saved[-1]}; continue from it with the same command "
            "and resume=true") in err
