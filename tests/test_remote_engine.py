"""``engine: remote`` (``asyncrl/engine/remote.py``) against ``asyncrl serve-engine``
(``asyncrl/rollout/engine_server.py``): the engine contract kept over vLLM's HTTP verbs.

The fast tests serve an in-process ``TorchEngine`` on a free loopback port; the slow ones
start ``python -m asyncrl.cli serve-engine`` processes (free ports, stopped in ``finally``)
and kill one with SIGKILL. Every comparison is against the in-process engine on the same
weights and seeds: seeded sampling makes a request's tokens a function of the weights,
the prompt, the seed and the position alone, so the two must agree token for token."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from aiohttp import web
from conftest import make_model, reference_logprobs

from asyncrl.config import ConfigError, EngineServerConfig, RemoteConfig, load_config
from asyncrl.engine import EngineClosedError, TorchEngine
from asyncrl.engine.protocol import AdapterUpdate, LayerAdapter
from asyncrl.engine.remote import ControlError, RemoteEngine
from asyncrl.json_api import listen
from asyncrl.rollout.engine_server import EngineServer, check_exposure
from asyncrl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], [9, 3], [11, 12, 13, 14], [2]]


def perturbed(model: torch.nn.Module, seed: int = 1, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """Every parameter moved by noise: weights whose samples differ from the model's."""
    gen = torch.Generator().manual_seed(seed)
    return {name: p.detach() + scale * torch.randn(p.shape, generator=gen)
            for name, p in model.named_parameters()}


class Fleet:
    """In-process servers, each its own ``TorchEngine`` on a copy of ``model``."""

    def __init__(self, model: torch.nn.Module, n: int = 1, settings: EngineServerConfig | None = None) -> None:
        self.model, self.n, self.settings = model, n, settings or EngineServerConfig(port=0)
        self.servers: list[EngineServer] = []

    async def __aenter__(self) -> Fleet:
        for _ in range(self.n):
            server = EngineServer(TorchEngine(copy.deepcopy(self.model), seed=0), model_name="tiny",
                                  settings=self.settings)
            await server.start()
            self.servers.append(server)
        return self

    @property
    def urls(self) -> list[str]:
        return [s.base_url for s in self.servers]

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers:
            await server.stop()
            await server.engine.shutdown()


async def in_process(model: torch.nn.Module, requests: list[tuple[list[int], SamplingParams]],
                     weights: dict[str, torch.Tensor] | None = None) -> list:
    engine = TorchEngine(copy.deepcopy(model), seed=0)
    try:
        if weights is not None:
            await engine.update_weights(weights, 1)
        return [await engine.generate(prompt, sampling) for prompt, sampling in requests]
    finally:
        await engine.shutdown()


def seeded(max_tokens: int, seed: int, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)


async def until(condition, what: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {limit_s:g} s for {what}")
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------- fast: in-process servers
def test_logprobs_and_tokens_equal_the_in_process_engine():
    model = make_model()
    requests = [(p, seeded(12, seed=i, temperature=t)) for i, p in enumerate(PROMPTS) for t in (1.0, 0.6, 0.0)]

    async def main():
        async with Fleet(model) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))
            try:
                got = [await remote.generate(p, s) for p, s in requests]
            finally:
                await remote.shutdown()
        return got, await in_process(model, requests)

    got, want = asyncio.run(main())
    for (prompt, sampling), g, w in zip(requests, got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert g.versions == [0] * len(g.token_ids)
        if sampling.temperature:  # the contract: log softmax(logits / T) of the sampled tokens
            ref = reference_logprobs(model, prompt, g.token_ids, sampling.temperature)
            assert g.logprobs == pytest.approx(ref.tolist(), abs=1e-4)


def test_max_tokens_is_capped_by_the_servers_context_and_a_full_prompt_refused():
    model = make_model(max_positions=16)

    async def main():
        async with Fleet(model) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))
            try:
                assert remote.max_model_len == 16
                done = await remote.generate(list(range(1, 11)), seeded(100, seed=0))
                assert len(done.token_ids) == 6 and done.finish_reason == "length"
                from asyncrl.engine.protocol import PromptTooLongError
                with pytest.raises(PromptTooLongError):
                    await remote.generate(list(range(1, 17)), seeded(4, seed=0))
                with pytest.raises(ValueError, match="top-k/top-p"):
                    await remote.generate([1, 2], SamplingParams(max_tokens=4, top_k=5))
            finally:
                await remote.shutdown()

    asyncio.run(main())


def test_a_file_weight_update_changes_the_samples_to_the_in_process_engines_on_those_weights():
    model = make_model()
    new = perturbed(model)
    requests = [(p, seeded(10, seed=i, temperature=0.0)) for i, p in enumerate(PROMPTS)]

    async def main():
        async with Fleet(model, n=2) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))
            try:
                before = [await remote.generate(p, s) for p, s in requests]
                await remote.update_weights(new, 1)  # not paused by the caller: the client pauses itself
                assert remote.version == 1 and [s.engine.version for s in fleet.servers] == [1, 1]
                after = [await remote.generate(p, s) for p, s in requests]
            finally:
                await remote.shutdown()
        return before, after, await in_process(model, requests, weights=new)

    before, after, want = asyncio.run(main())
    assert [c.token_ids for c in before] != [c.token_ids for c in after]
    assert [c.token_ids for c in after] == [c.token_ids for c in want]
    for g, w in zip(after, want):
        assert g.versions == [1] * len(g.token_ids)
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def _pause_round(mode: str):
    """Eight long seeded requests; once tokens flow: pause(mode), a file update to v1,
    resume. Returns the completions, the new weights and the requests."""
    model = make_model()
    new = perturbed(model)
    requests = [([3 + i, 4, 5], seeded(150, seed=i)) for i in range(8)]

    async def main():
        async with Fleet(model) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))
            try:
                tasks = [asyncio.create_task(remote.generate(p, s)) for p, s in requests]
                await until(lambda: remote.stats.received > 0, "the first token")
                await remote.pause(mode)
                await remote.update_weights(new, 1)
                await remote.resume()
                return await asyncio.gather(*tasks), model
            finally:
                await remote.shutdown()

    done, model = asyncio.run(main())
    return done, model, new, requests


def test_pause_abort_returns_partial_tokens_of_the_old_version():
    done, model, new, requests = _pause_round("abort")
    aborted = [c for c in done if c.finish_reason == "abort"]
    assert aborted, [c.finish_reason for c in done]
    for c in done:
        assert c.versions == [0] * len(c.token_ids)  # all sampled before the update
    want = asyncio.run(in_process(model, requests))
    for c, w in zip(done, want):  # the partial tokens are the old weights' own
        assert c.token_ids == w.token_ids[:len(c.token_ids)]


def test_pause_keep_holds_requests_over_an_update_with_exact_versions():
    done, model, new, requests = _pause_round("keep")
    assert all(c.finish_reason != "abort" for c in done)
    switched = [c for c in done if 0 in c.versions and 1 in c.versions]
    assert switched, [c.versions[:1] + c.versions[-1:] for c in done]
    old = asyncio.run(in_process(model, requests))
    for c, (prompt, sampling), o in zip(done, requests, old):
        k = c.versions.count(0)
        assert c.versions == [0] * k + [1] * (len(c.versions) - k)
        assert c.token_ids[:k] == o.token_ids[:k]  # before the switch: the old weights' tokens
        if k < len(c.token_ids):  # after it: the new weights' tokens, continuing from there
            tail = asyncio.run(in_process(model, [(prompt + c.token_ids[:k], seeded(150 - k, sampling.seed))], new))
            assert c.token_ids[k:] == tail[0].token_ids
            assert c.logprobs[k:] == pytest.approx(tail[0].logprobs, abs=1e-3)  # batched vs alone: float32 sums


def test_a_control_call_past_its_deadline_names_the_server_the_call_and_the_wait(capsys):
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response()

    async def main():
        async with Fleet(make_model()) as fleet:
            app = web.Application()
            app.router.add_post("/pause", hang)
            runner, url = await listen(app, "127.0.0.1", 0)
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls, control_timeout_s=0.5))
            try:
                remote.servers[0].url = url  # the server now stops answering its control plane
                await remote.pause("abort")
                await remote.resume()
                with pytest.raises(EngineClosedError, match=re.escape(url)):
                    await remote.generate([1, 2], seeded(2, 0))
            finally:
                release.set()
                await remote.shutdown()
                await runner.cleanup()
        return url

    url = asyncio.run(main())
    err = capsys.readouterr().err
    assert f"engine server {url} lost (POST /pause?mode=abort did not answer within 0.5 s " \
           "(remote.control_timeout_s))" in err


def test_a_server_that_refuses_a_weight_load_is_named_and_adapters_alone_are_refused():
    async def main():
        async with Fleet(make_model()) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))
            try:
                with pytest.raises(ControlError, match=re.escape(fleet.urls[0]) + ".*collective_rpc.*not_a_weight"):
                    await remote.update_weights({"not_a_weight": torch.zeros(2)}, 1)
                adapters = AdapterUpdate({"model.layers.0.mlp.up_proj.weight": LayerAdapter(
                    torch.zeros(2, 64), torch.zeros(128, 2), 1.0)}, rank=2, alpha=2.0)
                with pytest.raises(TypeError, match="model.lora.sync=merged"):
                    await remote.update_weights(adapters, 1)
            finally:
                await remote.shutdown()

    asyncio.run(main())


def test_the_key_guards_the_server_and_beyond_loopback_it_is_required():
    with pytest.raises(ConfigError, match="engine_server.api_key"):
        check_exposure(EngineServerConfig(host="0.0.0.0"))
    check_exposure(EngineServerConfig(host="0.0.0.0", api_key="k"))

    async def main():
        async with Fleet(make_model(), settings=EngineServerConfig(port=0, api_key="sesame")) as fleet:
            with pytest.raises(ControlError, match="401"):
                await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls, api_key="sesame"))
            try:
                assert (await remote.generate([1, 2], seeded(3, 0))).token_ids
            finally:
                await remote.shutdown()

    asyncio.run(main())


def test_engine_remote_config_needs_urls_and_one_client():
    with pytest.raises(ConfigError, match="remote.urls"):
        load_config(ROOT / "examples/addition/async.yaml", ["engine=remote"])
    cfg = load_config(ROOT / "examples/addition/async.yaml", ["engine=remote", "remote.urls=[http://h1:1,http://h2:2]"])
    assert cfg.remote.urls == ["http://h1:1", "http://h2:2"]
    with pytest.raises(ConfigError, match="top-k/top-p"):
        load_config(ROOT / "examples/addition/async.yaml", ["engine=remote", "remote.urls=[http://h:1]",
                                                              "sampling.top_k=5"])


def test_a_groups_samples_go_to_one_server_and_other_prompts_to_the_least_loaded():
    model = make_model()

    async def main():
        async with Fleet(model, n=2) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))
            try:
                group = [asyncio.create_task(remote.generate([7, 8, 9], seeded(20, seed=i))) for i in range(6)]
                await asyncio.gather(*group)
                counts = sorted(s.requests for s in remote.servers)
                other = [asyncio.create_task(remote.generate([7, 8, 9 + i], seeded(20, seed=i))) for i in range(1, 5)]
                await asyncio.gather(*other)
                return counts, [s.requests for s in remote.servers]
            finally:
                await remote.shutdown()

    counts, after = asyncio.run(main())
    assert counts == [0, 6]
    assert min(after) >= 1  # the idle one took some of the other prompts


def test_a_lost_servers_requests_are_reissued_from_the_tokens_received_and_counted_for_the_step_row(capsys):
    """A server that streams three tokens with their logprobs (as ``vllm serve`` does) and then
    ends the stream with no finish reason: it is named and left out, the request goes on on
    the other server from those three tokens, and the fleet's counts say so."""
    model = make_model()
    carried = [(21, -0.5), (22, -0.25), (23, -1.0)]

    async def dies_mid_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token, logprob in carried:
            chunk = {"choices": [{"index": 0, "logprobs": {"tokens": [f"token_id:{token}"],
                                                           "token_logprobs": [logprob]}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write_eof()  # no finish reason, no [DONE]: the server went away
        return response

    async def down(request: web.Request) -> web.Response:
        return web.Response(status=503, text="down")

    async def main():
        async with Fleet(model, n=2) as fleet:
            app = web.Application()
            app.router.add_post("/v1/completions", dies_mid_stream)
            app.router.add_get("/health", down)  # never back: the health watch leaves it out
            runner, url = await listen(app, "127.0.0.1", 0)
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls, health_interval_s=0.05))
            try:
                assert remote.fleet() == {"servers_up": 2, "servers_lost_total": 0, "reissued_requests_total": 0,
                                          "reissued_tokens_total": 0, "lost_servers": ""}
                remote.servers[0].url = url  # the first pick (both idle): it dies three tokens in
                done = await remote.generate([5, 6, 7], seeded(10, seed=3))
                return done, remote.fleet(), url
            finally:
                await remote.shutdown()
                await runner.cleanup()

    done, fleet, url = asyncio.run(main())
    assert fleet == {"servers_up": 1, "servers_lost_total": 1, "reissued_requests_total": 1,
                     "reissued_tokens_total": 3, "lost_servers": url}
    assert done.token_ids[:3] == [t for t, _ in carried] and done.logprobs[:3] == [lp for _, lp in carried]
    assert len(done.token_ids) == 10 and done.versions == [0] * 10
    want = asyncio.run(in_process(model, [([5, 6, 7, 21, 22, 23], seeded(7, seed=3))]))[0]
    assert done.token_ids[3:] == want.token_ids  # the rest sampled on the other server, from there
    assert f"engine server {url} lost (POST /v1/completions: the stream ended without a finish reason)" \
        in capsys.readouterr().err


# ------------------------------------------------------- slow: serve-engine processes
class ServeEngine:
    """``python -m asyncrl.cli serve-engine CONFIG`` on a free port (or ``port``), one engine
    thread: several share the machine (docs/scaling.md)."""

    def __init__(self, config: str, *overrides: str, port: int = 0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve-engine", config,
                                      f"engine_server.port={port}", "rollout.num_threads=1", *overrides],
                                     cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        found = threading.Event()

        def read() -> None:  # drained for the process's life: a full pipe would stall it
            for line in self.proc.stderr:
                self.lines.append(line)
                match = re.search(r" at (http://127\.0\.0\.1:\d+) ", line)
                if match and self.url is None:
                    self.url = match.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(300) or self.url is None:  # loading on a loaded 2-core machine
            self.stop()
            raise AssertionError("serve-engine printed no address:\n" + "".join(self.lines))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _policy(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ROOT / path, torch_dtype=torch.float32).eval()


@pytest.mark.slow
def test_serve_engine_on_the_tiny_policy_gives_the_in_process_engines_logprobs():
    server = ServeEngine("examples/addition/async.yaml")
    try:
        requests = [([1 + i % 10, 2, 3], seeded(4, seed=i)) for i in range(16)]

        async def main():
            remote = await RemoteEngine.connect(RemoteConfig(urls=[server.url]))
            try:
                return await asyncio.gather(*[remote.generate(p, s) for p, s in requests])
            finally:
                await remote.shutdown()

        got = asyncio.run(main())
    finally:
        server.stop()
    want = asyncio.run(in_process(_policy("models/addition-tiny"), requests))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


@pytest.mark.slow
def test_a_server_killed_mid_run_is_named_its_requests_reissued_and_when_back_used_again(capsys):
    servers = [ServeEngine("examples/countdown/async.yaml") for _ in range(2)]
    try:
        requests = [([3 + i, 4, 5], seeded(100, seed=i)) for i in range(12)]
        victim = servers[0]

        async def main():
            remote = await RemoteEngine.connect(RemoteConfig(urls=[s.url for s in servers], health_interval_s=0.2))
            try:
                tasks = [asyncio.create_task(remote.generate(p, s)) for p, s in requests]
                await until(lambda: remote.stats.received > 0 and remote.servers[0].in_flight > 0,
                            "tokens from the first server")
                victim.kill()
                done = await asyncio.gather(*tasks)
                lost = remote.stats.servers_lost, remote.stats.reissued_requests
                port = int(victim.url.rsplit(":", 1)[1])
                servers.append(ServeEngine("examples/countdown/async.yaml", port=port))  # back on its address
                await until(lambda: remote.servers[0].usable, "the server to be used again", 300)
                before = remote.servers[0].requests
                again = await asyncio.gather(*[remote.generate([40 + i], seeded(5, seed=i)) for i in range(8)])
                return done, lost, remote.servers[0].requests - before, again
            finally:
                await remote.shutdown()

        done, (lost, reissued), used_again, again = asyncio.run(main())
    finally:
        for server in servers:
            server.stop()
    assert lost == 1 and reissued >= 1
    assert used_again >= 1 and all(c.token_ids for c in again)
    err = capsys.readouterr().err
    assert f"engine server {victim.url} lost" in err and f"engine server {victim.url} is back" in err
    want = asyncio.run(in_process(_policy("models/countdown-tiny"), requests))
    for g, w in zip(done, want):  # re-issued from what had arrived: the same tokens as without the kill
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)  # batched vs alone: float32 sums


class ThreadFleet:
    """In-process servers on an event loop of their own (a thread), for a training run in
    this process to reach: ``stop(i)`` stops server i from the trainer's loop."""

    def __init__(self, model: torch.nn.Module, n: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fleet = Fleet(model, n)
        asyncio.run_coroutine_threadsafe(self.fleet.__aenter__(), self.loop).result(120)

    async def stop(self, i: int) -> None:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.fleet.servers[i].stop(), self.loop))

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.fleet.__aexit__(None, None, None), self.loop).result(120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)


STOPPED_AFTER_STEP_1: list[ThreadFleet] = []


async def stop_the_first_server_after_step_1(event) -> None:
    """``hooks.on_step_end``: server 0 of the run's fleet goes away after step 1."""
    if event.step == 1 and STOPPED_AFTER_STEP_1:
        await STOPPED_AFTER_STEP_1.pop().stop(0)


@pytest.mark.slow
def test_a_training_run_on_a_fleet_logs_it_in_each_step_row_and_the_doctor_names_the_lost_server(tmp_path, capsys):
    from asyncrl.cli import main
    from asyncrl.jsonl import read_jsonl
    from asyncrl.report import load_run
    from asyncrl.report.doctor import findings

    fleet = ThreadFleet(_policy("models/addition-tiny"), 2)
    try:
        STOPPED_AFTER_STEP_1.append(fleet)
        urls = fleet.fleet.urls
        code = main(["train", "examples/addition/async.yaml", f"output_dir={tmp_path}", "total_steps=4",
                     "eval_every=0", "engine=remote", f"remote.urls=[{','.join(urls)}]", "remote.health_interval_s=0.2",
                     "hooks.on_step_end=test_remote_engine:stop_the_first_server_after_step_1"])
    finally:
        STOPPED_AFTER_STEP_1.clear()
        fleet.close()
    assert code == 0
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    first, last = rows[0], rows[-1]
    assert (first["remote/servers_up"], first["remote/servers_lost_total"]) == (2, 0)
    assert (last["remote/servers_up"], last["remote/servers_lost_total"]) == (1, 1)
    assert last["remote/lost_servers"] == urls[0]
    assert last["remote/reissued_tokens_total"] >= 0 and last["remote/reissued_requests_total"] >= 0
    assert all(r["remote/weight_load_s"] > 0 for r in rows)  # every step of this run syncs
    found = {f.name: f for f in findings(load_run(tmp_path))}["engine servers lost"]
    assert found.status == "WARN" and found.step in (2, 3, 4) and urls[0] in found.evidence, found
    assert f"engine server {urls[0]} lost" in capsys.readouterr().err


def test_a_served_engine_scores_tokens_for_a_distillation_teacher():
    """``prompt_logprobs`` (vLLM's) on serve-engine: the teacher's client reads back the model's own
    log-softmax of each token after the first, for several sequences in one call."""
    from asyncrl.frozen.client import FrozenModel

    model = make_model()
    sequences = [PROMPTS[0] + [3, 4, 5], PROMPTS[1] + [7]]

    async def main():
        async with Fleet(model) as fleet:
            teacher = FrozenModel("teacher", fleet.urls[0])
            try:
                return await teacher.token_logprobs(sequences)
            finally:
                await teacher.close()

    got = asyncio.run(main())
    for ids, lps in zip(sequences, got):
        with torch.no_grad():
            want = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        want = want.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert lps == pytest.approx(want.tolist(), abs=1e-5)
