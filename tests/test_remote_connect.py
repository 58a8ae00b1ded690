"""What ``engine: remote`` checks when it connects: nothing listening is a usage error said
in seconds; a server on another model is refused naming both; a fresh run on servers a
previous run left serves the base model, not the previous run's weights."""

from __future__ import annotations

import asyncio
import copy
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_model

from asyncrl.config import ConfigError, EngineServerConfig, RemoteConfig
from asyncrl.engine import TorchEngine
from asyncrl.engine.remote import RemoteEngine, ServersUnusable
from asyncrl.rollout.engine_server import EngineServer
from asyncrl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on: bound, then released (a race only with another binder)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_is_a_usage_error_said_in_seconds():
    url = f"http://127.0.0.1:{free_port()}"

    async def main():
        start = time.monotonic()
        with pytest.raises(ServersUnusable) as refused:
            await RemoteEngine.connect(RemoteConfig(urls=[url], control_timeout_s=60))
        return time.monotonic() - start, str(refused.value)

    took, said = asyncio.run(main())
    assert isinstance(ServersUnusable("x"), ConfigError)  # the CLI's exit 2
    assert f"nothing is listening at {url}" in said and "Start the server first" in said
    assert took < 30, f"waited {took:.1f} s, not the 60 s of remote.control_timeout_s"


@pytest.mark.slow
def test_the_cli_says_nothing_listening_in_one_line_and_exits_2(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", str(ROOT / "examples/addition/async.yaml"),
                           "engine=remote", f"remote.urls=[{url}]", f"output_dir={tmp_path / 'run'}",
                           "total_steps=1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"nothing is listening at {url}" in done.stderr
    assert "Traceback" not in done.stderr


class _Shifted:
    """A tokenizer that is not the servers': every id one higher."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [i + 1 for i in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]


def test_a_server_on_another_model_is_refused_at_connect_naming_both(char_tokenizer):
    async def main():
        server = EngineServer(TorchEngine(make_model(), seed=0), model_name="tiny-a",
                              settings=EngineServerConfig(port=0), tokenizer=char_tokenizer)
        await server.start()
        try:
            same = await RemoteEngine.connect(RemoteConfig(urls=[server.base_url]), tokenizer=char_tokenizer,
                                              model_path="tiny-a")
            await same.shutdown()  # the same tokenizer: accepted
            with pytest.raises(ServersUnusable) as refused:
                await RemoteEngine.connect(RemoteConfig(urls=[server.base_url]), tokenizer=_Shifted(char_tokenizer),
                                           model_path="models/other")
            return str(refused.value)
        finally:
            await server.stop()
            await server.engine.shutdown()

    said = asyncio.run(main())
    assert "serves 'tiny-a'" in said and "model.path 'models/other'" in said


def test_a_fresh_run_on_servers_a_previous_run_left_serves_the_base(tmp_path):
    """A previous run trained the server to version 3 and exited; a fresh run (version 0, no
    weights to send) once relabelled it 0 and sampled the old weights."""
    base = make_model()
    base.save_pretrained(tmp_path / "base")
    trained = {name: p.detach() + 0.5 for name, p in base.named_parameters()}
    prompt, sampling = [5, 6, 7], SamplingParams(max_tokens=8, temperature=1.0, seed=3)

    async def main():
        server = EngineServer(TorchEngine(copy.deepcopy(base), seed=0), model_name="tiny",
                              settings=EngineServerConfig(port=0), base_path=tmp_path / "base")
        reference = TorchEngine(copy.deepcopy(base), seed=0)
        await server.start()
        try:
            previous = await RemoteEngine.connect(RemoteConfig(urls=[server.base_url]))
            await previous.update_weights(trained, 3)
            old = await previous.generate(prompt, sampling)
            await previous.shutdown()
            fresh = await RemoteEngine.connect(RemoteConfig(urls=[server.base_url]), fresh=True)
            try:
                got = await fresh.generate(prompt, sampling)
            finally:
                await fresh.shutdown()
            return old, got, await reference.generate(prompt, sampling)
        finally:
            await reference.shutdown()
            await server.stop()
            await server.engine.shutdown()

    old, got, want = asyncio.run(main())
    assert old.token_ids != want.token_ids or old.logprobs != want.logprobs  # the previous run's weights differ
    assert got.token_ids == want.token_ids and got.versions == [0] * len(got.token_ids)
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_a_never_used_server_is_reloaded_with_a_message_that_says_no_run_trained_it(capsys):
    """A server whose label is none an asyncrl run sets (a fresh ``vllm serve``'s) is reloaded
    to be sure, and the message no longer calls its weights "a previous run's"."""
    from aiohttp import web

    from asyncrl.json_api import listen

    calls: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        calls.append(f"{request.method} {request.path}")
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "root": "/models/m", "max_model_len": 64}]})
        if request.path == "/weight_info":
            return web.json_response({"weight_version": "default"})
        return web.json_response({})

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner, url = await listen(app, "127.0.0.1", 0)
        try:
            remote = await RemoteEngine.connect(RemoteConfig(urls=[url]), fresh=True)
            await remote.shutdown()
            return url
        finally:
            await runner.cleanup()

    url = asyncio.run(main())
    err = capsys.readouterr().err
    assert "POST /collective_rpc" in calls  # reloaded from its own directory all the same
    assert (f"engine server {url} had its weights labelled 'default', a label no asyncrl run sets (never trained "
            "by one): reloaded m's own weights for this fresh run") in err
    assert "previous run" not in err


def test_the_documented_vllm_server_commands_are_the_ones_plan_prints_and_the_lane_starts():
    """docs/vllm.md, docs/planner.md and docs/scaling.md show the commands ``vllm_serve``
    makes; the vLLM lane (tests/test_vllm_remote.py) starts its servers from the same function."""
    from asyncrl.plan.fleet import _args, vllm_serve

    docs = {name: (ROOT / "docs" / name).read_text() for name in ("vllm.md", "planner.md", "scaling.md")}
    for on_cpu in (False, True):
        env, words = vllm_serve("MODEL_DIR", host="0.0.0.0", port=8100, dtype="float32", on_cpu=on_cpu,
                                api_key="$ASYNCRL_REMOTE_KEY")
        command = " ".join(f"{k}={v}" for k, v in env.items()) + " " + _args(words)
        for name, text in docs.items():
            assert command in text, (name, command)
        assert "--model" in words and words[words.index("--model") + 1] == "MODEL_DIR"
        assert ("--no-enable-chunked-prefill" in words and "VLLM_CPU_KVCACHE_SPACE" in env) == on_cpu
    lane = (ROOT / "tests" / "test_vllm_remote.py").read_text()
    assert "vllm_serve(" in lane and '"--logprobs-mode"' not in lane  # the lane does not restate the flags


def test_a_request_that_reached_a_paused_server_carries_the_version_it_ran_on(monkeypatch):
    """A request that passed the client's gate just before a pause reaches the server after
    it; the server (vLLM) queues it and runs it after the resume, on the new weights. From a
    server that stamps no versions (``vllm serve``: here ``serve-engine`` with its record
    withheld) its tokens once carried the old label."""
    model = make_model()
    new = {name: p.detach() + 0.5 for name, p in model.named_parameters()}
    original = EngineServer._reply

    def as_vllm(self, completion, *, final):  # every token and logprob at the end, and no versions
        reply = original(self, completion, final=True)
        del reply["choices"][0]["completion"]
        return reply

    monkeypatch.setattr(EngineServer, "_reply", as_vllm)

    async def main():
        server = EngineServer(TorchEngine(copy.deepcopy(model), seed=0), model_name="tiny",
                              settings=EngineServerConfig(port=0))
        await server.start()
        remote = await RemoteEngine.connect(RemoteConfig(urls=[server.base_url]))
        try:
            await remote.pause("abort")
            remote._open.set()  # the race: a request past the client's gate as the pause went out
            late = asyncio.create_task(remote.generate([5, 6, 7], SamplingParams(max_tokens=6, seed=1)))
            while server.engine.num_in_flight == 0:  # it waits in the paused server's queue
                await asyncio.sleep(0.01)
            await remote.update_weights(new, 1)
            await remote.resume()
            return await late
        finally:
            await remote.shutdown()
            await server.stop()
            await server.engine.shutdown()

    completion = asyncio.run(main())
    assert completion.token_ids and completion.versions == [1] * len(completion.token_ids)


def test_adapters_are_refused_on_a_server_with_data_parallel_engines_behind_one_url():
    """``vllm serve --data-parallel-size 2`` behind one URL: a LoRA load reaches one engine."""
    from aiohttp import web

    from asyncrl.engine.protocol import AdapterUpdate, LayerAdapter
    from asyncrl.engine.remote_wire import ControlError
    from asyncrl.json_api import listen

    calls: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        calls.append(f"{request.method} {request.path_qs}")
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})
        if request.path == "/get_world_size":  # TP 2 x DP 2
            return web.json_response({"world_size": 4 if request.query.get("include_dp") == "true" else 2})
        return web.json_response({})

    update = AdapterUpdate({"model.layers.0.mlp.down_proj.weight": LayerAdapter(torch.zeros(2, 8), torch.zeros(8, 2),
                                                                                2.0)}, rank=2, alpha=4.0)

    async def main(tmp):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner, url = await listen(app, "127.0.0.1", 0)
        remote = await RemoteEngine.connect(RemoteConfig(urls=[url], weights_dir=str(tmp)))
        try:
            with pytest.raises(ControlError) as refused:
                await remote.update_weights(update, 1)
            return str(refused.value)
        finally:
            await remote.shutdown()
            await runner.cleanup()

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        said = asyncio.run(main(tmp))
    assert "runs 2 data-parallel engines behind one URL" in said and "model.lora.sync=merged" in said
    assert not any("load_lora_adapter" in c for c in calls)
