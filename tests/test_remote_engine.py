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
from asyncrl.runtime.learner_worker import LearnerWorker
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
                     weights: dict[str, torch.Tensor] | AdapterUpdate | None = None) -> list:
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
    """Requests in flight at the pause come back aborted with the old weights' tokens only.
    The pause waits for one request's first token, not all eight: under load a request the
    server had not yet started is held over the update and then sampled wholly by the new
    weights — one version either way, never a mix (the full suite beside a training run
    showed such a request, all its versions 1)."""
    done, model, new, requests = _pause_round("abort")
    aborted = [c for c in done if c.finish_reason == "abort"]
    assert aborted, [c.finish_reason for c in done]
    old = asyncio.run(in_process(model, requests))
    for c, o, request in zip(done, old, requests):
        if c.finish_reason == "abort" or 1 not in c.versions:  # sampled before the update
            assert c.versions == [0] * len(c.token_ids)
            assert c.token_ids == o.token_ids[:len(c.token_ids)]  # the old weights' own tokens
        else:  # started after the resume
            assert c.versions == [1] * len(c.token_ids)
            assert c.token_ids == asyncio.run(in_process(model, [request], new))[0].token_ids


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
           "(remote.control_timeout_s); then GET /health refused (404)" in err  # its health check failed too


def test_a_server_that_refuses_a_weight_load_or_an_adapter_load_is_named():
    async def main():
        async with Fleet(make_model()) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))
            try:
                with pytest.raises(ControlError, match=re.escape(fleet.urls[0]) + ".*collective_rpc.*not_a_weight"):
                    await remote.update_weights({"not_a_weight": torch.zeros(2)}, 1)
                adapters = AdapterUpdate({"model.layers.9.mlp.up_proj.weight": LayerAdapter(  # a layer it lacks
                    torch.zeros(2, 64), torch.zeros(128, 2), 1.0)}, rank=2, alpha=2.0)
                with pytest.raises(ControlError, match=re.escape(fleet.urls[0]) + r": POST /v1/load_lora_adapter "
                                   r"refused \(400\): .*model\.layers\.9\.mlp\.up_proj\.weight"):
                    await remote.update_weights(adapters, 1)
                assert remote.version == 0 and fleet.servers[0].merged is None
            finally:
                await remote.shutdown()

    asyncio.run(main())


# ------------------------------------------------------------------- LoRA adapters alone
def lora_pair(seed: int = 0):
    """A base and a peft model on it whose adapters are nonzero (B starts at 0 in peft)."""
    from asyncrl.config import LoraConfig
    from asyncrl.learner.lora import add_adapters

    base = make_model()
    peft_model = add_adapters(make_model(), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "up_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return base, peft_model


def test_adapters_reach_every_server_as_a_peft_directory_and_sample_as_the_in_process_engine(tmp_path):
    """With an ``AdapterUpdate`` the client writes a PEFT adapter directory (only adapter
    tensors, under peft's own names), each server loads it by ``/v1/load_lora_adapter`` and
    unloads the previous one, and requests name it: the samples and logprobs are the
    in-process engine's with the same adapters, at each version. A trainer that connects
    later finds the base again (it unloads the adapters a previous one left)."""
    from asyncrl.learner.lora import adapter_update

    base, peft_model = lora_pair()
    first = adapter_update(peft_model)
    second = adapter_update(lora_pair(seed=1)[1])
    requests = [(p, seeded(10, seed=i)) for i, p in enumerate(PROMPTS)]

    async def main():
        async with Fleet(base, n=2) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls, weights_dir=str(tmp_path)))
            try:
                plain = [await remote.generate(p, s) for p, s in requests]
                await remote.update_weights(first, 1)
                assert [s.merged[0] for s in fleet.servers] == ["lora-v1", "lora-v1"]
                written = sorted(f.name for f in (tmp_path / "lora-v1").iterdir())
                tensor_bytes = (tmp_path / "lora-v1" / "adapter_model.safetensors").stat().st_size
                after_first = [await remote.generate(p, s) for p, s in requests]
                await remote.update_weights(second, 2)
                assert [sorted(s.adapters) for s in fleet.servers] == [["lora-v2"], ["lora-v2"]]  # v1 unloaded
                assert not (tmp_path / "lora-v1").exists()
                after_second = [await remote.generate(p, s) for p, s in requests]
            finally:
                await remote.shutdown()
            again = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))  # a new trainer: the adapters left go
            try:
                assert [(s.merged, s.adapters) for s in fleet.servers] == [(None, {}), (None, {})]
                assert [await again.generate(p, s) for p, s in requests] == plain
            finally:
                await again.shutdown()
        return plain, written, tensor_bytes, after_first, after_second

    plain, written, tensor_bytes, after_first, after_second = asyncio.run(main())
    assert written == ["adapter_config.json", "adapter_model.safetensors"]
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert tensor_bytes < first.nbytes + 4096 and first.nbytes < full_bytes / 10
    assert [c.token_ids for c in plain] != [c.token_ids for c in after_first]
    for got, want, version in ((after_first, asyncio.run(in_process(base, requests, first)), 1),
                               (after_second, asyncio.run(in_process(base, requests, second)), 2)):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for g, w in zip(got, want):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
            assert g.versions == [version] * len(g.token_ids)


def test_the_adapter_directory_is_what_peft_saves_and_reads_back_as_the_same_update(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.engine.remote_wire import read_peft_adapter, write_peft_adapter
    from asyncrl.learner.lora import adapter_update

    _, peft_model = lora_pair()
    update = adapter_update(peft_model)
    write_peft_adapter(update, tmp_path / "ours")
    peft_model.save_pretrained(tmp_path / "peft")
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ours", "peft"))
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key])
    import json
    ours_cfg, peft_cfg = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft"))
    for field in ("r", "lora_alpha", "fan_in_fan_out", "peft_type", "bias", "use_rslora"):
        assert ours_cfg[field] == peft_cfg[field], field
    assert sorted(ours_cfg["target_modules"]) == sorted(peft_cfg["target_modules"])
    back = read_peft_adapter(tmp_path / "peft")  # peft's own directory, as a server reads it
    assert sorted(back.layers) == sorted(update.layers) and (back.rank, back.alpha) == (update.rank, update.alpha)
    for name, layer in update.layers.items():
        assert torch.equal(back.layers[name].a, layer.a) and torch.equal(back.layers[name].b, layer.b)
        assert back.layers[name].scale == layer.scale
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        read_peft_adapter(tmp_path)


def test_a_restarted_server_gets_the_current_adapter_again(capsys):
    """A server that restarts between two requests answers the adapter's name with 404: it
    is counted lost (never served the base instead), revived with the adapter, used again."""
    from asyncrl.learner.lora import adapter_update

    base, peft_model = lora_pair()
    update = adapter_update(peft_model)
    probe = [[5, 6, 7], [9, 3]]

    async def main():
        async with Fleet(base, n=2) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls, health_interval_s=0.05))
            try:
                await remote.update_weights(update, 1)
                old = fleet.servers[0]
                port = int(old.base_url.rsplit(":", 1)[1])
                await old.stop()  # the server restarts at once: a fresh engine on the base, no adapter
                await old.engine.shutdown()
                fresh = EngineServer(TorchEngine(copy.deepcopy(base), seed=0), model_name="tiny",
                                     settings=EngineServerConfig(port=port))
                await fresh.start()
                fleet.servers[0] = fresh
                done = await asyncio.gather(*[remote.generate([20 + i, 1], seeded(4, seed=i)) for i in range(6)])
                assert remote.stats.servers_lost == 1 and all(c.versions == [1] * 4 for c in done)  # 404: lost
                await until(lambda: remote.servers[0].usable, "the restarted server to be used again")
                assert fresh.merged is not None and fresh.merged[0] == "lora-v1" and fresh.engine.version == 1
                return await remote.probe_each(probe, seeded(6, seed=0, temperature=0.0))
            finally:
                await remote.shutdown()

    per_server = asyncio.run(main())
    assert "does not know adapter lora-v1" in capsys.readouterr().err
    want = asyncio.run(in_process(base, [(p, seeded(6, seed=0, temperature=0.0)) for p in probe], update))
    assert len(per_server) == 2
    for _, done in per_server:
        assert [c.token_ids for c in done] == [c.token_ids for c in want]
        assert all(c.versions == [1] * len(c.token_ids) for c in done)


def test_lora_sync_auto_sends_adapters_to_remote_servers_and_merged_still_works():
    from asyncrl.config import LoraConfig
    from asyncrl.learner.export import update_kind

    assert update_kind(LoraConfig(), engine="remote") == "adapters"
    assert update_kind(LoraConfig(), engine="remote", same_dtype=False) == "adapters"  # the servers' own dtype
    assert update_kind(LoraConfig(sync="merged"), engine="remote") == "merged_every_weight"
    assert update_kind(LoraConfig(), engine="vllm") == "merged_every_weight"
    remote = ["engine=remote", "remote.urls=[http://h:1]", "model.lora.rank=4"]
    load_config(ROOT / "examples/addition/async.yaml", [*remote, "model.lora.sync=adapters"])
    with pytest.raises(ConfigError, match="engine=vllm loads whole weights"):
        load_config(ROOT / "examples/addition/async.yaml", ["engine=vllm", "model.lora.rank=4",
                                                              "model.lora.sync=adapters"])


# --------------------------------------------------------------- the delivery check, per server
class _Handle:
    """A runtime handle's ``apply`` over one worker (what the delivery check calls)."""

    def __init__(self, worker, rollout: bool) -> None:
        self.worker, self.rollout = worker, rollout

    async def apply(self, fn, *args):
        return [await fn(self.worker, 0, *args)] if self.rollout else [fn(self.worker, *args)]


class _Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False):
        return type("Encoded", (), {"input_ids": [1 + ord(c) % 90 for c in text]})()


def test_the_delivery_check_probes_each_server_and_names_the_one_that_loaded_a_wrong_file(tmp_path):
    from safetensors.torch import save_file

    from asyncrl.weight_sync.delivery import FLOAT32_TOLERANCE, DeliveryCheck, WeightsNotDelivered

    model = make_model()
    new = perturbed(model)
    learner = copy.deepcopy(model)
    learner.load_state_dict(new, strict=False)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file({k: v.contiguous() for k, v in perturbed(model, seed=2).items()}, str(wrong / "model.safetensors"))

    async def main():
        async with Fleet(model, n=2) as fleet:
            remote = await RemoteEngine.connect(RemoteConfig(urls=fleet.urls))

            async def ready_engine():
                return remote

            rollout = type("Worker", (), {"ready_engine": staticmethod(ready_engine)})()
            learner_worker = LearnerWorker.__new__(LearnerWorker)  # a rank around the learner's model
            learner_worker.learner = type("L", (), {"model": learner, "device": "cpu"})()
            check = DeliveryCheck(_Handle(learner_worker, False), _Handle(rollout, True), _Tokenizer(), every=1,
                                  tolerance=FLOAT32_TOLERANCE)
            try:
                await remote.update_weights(new, 1)
                delivered = await check.check(1)
                await remote._call(remote.servers[1], "POST", "/collective_rpc",  # a wrong file on one server
                                   {"method": "reload_weights", "kwargs": {"weights_path": str(wrong)}})
                with pytest.raises(WeightsNotDelivered) as failed:
                    await check.check(1)
                return delivered, str(failed.value), fleet.urls
            finally:
                await remote.shutdown()

    delivered, message, urls = asyncio.run(main())
    assert delivered <= FLOAT32_TOLERANCE
    assert f"after the weight sync of version 1, rollout worker 0's engine server {urls[1]}'s logprobs" in message
    assert urls[0] not in message


# ----------------------------------------------- vLLM's NCCL weight transfer: the HTTP protocol
class _FakeBroadcast:
    """Stands in for NCCL: records the trainer's side and meets the servers' receive
    (``send`` returns once every server's ``/update_weights`` arrived, which in turn wait
    for it), so the test sees the two run at once."""

    def __init__(self, servers: int) -> None:
        self.joined: list[tuple[str, int, int]] = []
        self.sent: list[list[tuple[str, tuple[int, ...]]]] = []
        self.receiving = threading.Semaphore(0)
        self.done = threading.Event()
        self.servers, self.closed = servers, False

    def wire(self):
        return {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 2}

    def join(self, address, port, world_size):
        self.joined.append((address, port, world_size))

    def send(self, tensors):
        for _ in range(self.servers):
            assert self.receiving.acquire(timeout=30), "a server's /update_weights never came"
        self.sent.append([(name, tuple(t.shape)) for name, t in tensors])
        self.done.set()

    def close(self):
        self.closed = True


class _FakeVLLM:
    """The routes of ``vllm serve`` the NCCL path uses, recording (verb path, body)."""

    def __init__(self, world_size: int, broadcast: _FakeBroadcast, fail: str | None = None,
                 hang: str | None = None) -> None:
        self.world_size, self.broadcast, self.fail, self.hang = world_size, broadcast, fail, hang
        self.calls: list[tuple[str, object]] = []
        self.runner = self.url = None

    async def start(self):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner, self.url = await listen(app, "127.0.0.1", 0)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        path = request.path_qs
        if path != "/health":
            self.calls.append((f"{request.method} {path}", body))
        if request.path == self.fail:
            return web.json_response({"error": "CUDA error: an illegal memory access"}, status=500)
        if request.path == self.hang:
            await asyncio.sleep(3600)
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})
        if request.path == "/get_world_size":
            return web.json_response({"world_size": self.world_size})
        if request.path == "/update_weights":
            self.broadcast.receiving.release()
            assert await asyncio.to_thread(self.broadcast.done.wait, 30), "the broadcast never came"
        return web.json_response({"message": "ok"})


async def _nccl_client(servers: list[_FakeVLLM], broadcast: _FakeBroadcast, **settings) -> RemoteEngine:
    for server in servers:
        await server.start()
    return await RemoteEngine.connect(RemoteConfig(urls=[s.url for s in servers], weight_transfer="nccl", **settings),
                                      broadcast=broadcast)


def test_nccl_weight_transfer_speaks_vllms_protocol_to_every_server():
    """Checks the HTTP choreography of ``remote.weight_transfer=nccl`` against fake vLLM
    servers, with the broadcast stubbed (``broadcast=``): the order of the verbs, their
    bodies, the fan-out to every server, errors named. It does not check NCCL itself (no
    GPU here): that runs only against real vLLM servers on GPUs."""
    weights = {"model.embed_tokens.weight": torch.zeros(4, 3), "lm_head.weight": torch.ones(4, 3, dtype=torch.bfloat16)}

    async def main():
        broadcast = _FakeBroadcast(servers=2)
        servers = [_FakeVLLM(1, broadcast), _FakeVLLM(2, broadcast)]
        remote = await _nccl_client(servers, broadcast, nccl_address="10.0.0.7", nccl_port=29555)
        try:
            for server in servers:
                server.calls.clear()
            await remote.update_weights(weights, 1)
            broadcast.done.clear()
            await remote.update_weights(weights, 2)
            return broadcast, [s.calls for s in servers]
        finally:
            await remote.shutdown()
            for server in servers:
                await server.runner.cleanup()

    broadcast, calls = asyncio.run(main())
    assert broadcast.joined == [("10.0.0.7", 29555, 4)]  # 1 trainer + 1 + 2 workers
    assert broadcast.sent == [[("model.embed_tokens.weight", (4, 3)), ("lm_head.weight", (4, 3))]] * 2
    assert broadcast.closed
    info = {"names": ["model.embed_tokens.weight", "lm_head.weight"], "dtype_names": ["float32", "bfloat16"],
            "shapes": [[4, 3], [4, 3]]}
    one_sync = lambda v: [("POST /pause?mode=abort", None), ("POST /start_weight_update", None),  # noqa: E731
                          ("POST /update_weights", {"update_info": info}),
                          ("POST /finish_weight_update", {"weight_version": str(v)}),
                          ("POST /reset_prefix_cache", None), ("POST /resume", None)]
    for offset, server_calls in zip((1, 2), calls):
        init = {"init_info": {"master_address": "10.0.0.7", "master_port": 29555, "rank_offset": offset,
                              "world_size": 4, "packed": True, "packed_buffer_size_bytes": 1024,
                              "packed_num_buffers": 2}}
        first = one_sync(1)
        assert server_calls == [first[0], ("GET /get_world_size", None), ("POST /init_weight_transfer_engine", init),
                                *first[1:], *one_sync(2), ("POST /shutdown_weight_transfer_engine", None)]


@pytest.mark.parametrize("failure", ["fail", pytest.param("hang", marks=pytest.mark.slow)])
def test_an_nccl_update_that_a_server_fails_or_never_answers_names_the_server_and_the_call(failure):
    async def main():
        broadcast = _FakeBroadcast(servers=2)
        route = "/update_weights" if failure == "fail" else "/start_weight_update"
        servers = [_FakeVLLM(1, broadcast), _FakeVLLM(1, broadcast, **{failure: route})]
        remote = await _nccl_client(servers, broadcast, nccl_address="127.0.0.1", weight_load_timeout_s=1.0)
        try:
            with pytest.raises(ControlError) as failed:
                await remote.update_weights({"w": torch.zeros(2)}, 1)
            return str(failed.value), servers[1].url, remote.version
        finally:
            broadcast.done.set()  # the stub's waits end
            await remote.shutdown()
            for server in servers:
                await server.runner.cleanup()

    message, url, version = asyncio.run(main())
    assert version == 0
    if failure == "fail":
        assert message.startswith(f"engine server {url}: POST /update_weights refused (500): CUDA error")
    else:
        assert message.startswith(f"engine server {url}: POST /start_weight_update did not answer within 1 s "
                                  "(remote.weight_load_timeout_s), during NCCL weight transfer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nccl_weight_transfer_is_refused_without_cuda():
    with pytest.raises(ConfigError, match=r"remote.weight_transfer=nccl .*CUDA is not available.*vLLM"):
        load_config(ROOT / "examples/addition/async.yaml", ["engine=remote", "remote.urls=[http://h:1]",
                                                              "remote.weight_transfer=nccl"])


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
    assert f"engine server {url} lost (POST /v1/completions: the stream ended without a finish reason; then " \
        "GET /health answered 503: down)" in capsys.readouterr().err  # lost: its health check failed too


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


@pytest.mark.slow
def test_a_resumed_run_sends_its_checkpoints_weights_to_the_servers_before_any_sample(tmp_path):
    """The servers hold ``model.path``; a run resumed from step 2 must load step 2's weights on
    them before sampling, or the tokens labelled version 2 come from the base. The learner's
    recomputed logprobs of the first resumed step's lag-0 tokens tell: within float noise of
    the servers' only when the servers hold the checkpoint."""
    from asyncrl.cli import main
    from asyncrl.jsonl import read_jsonl

    common = ["examples/addition/async.yaml", f"output_dir={tmp_path}", "eval_every=0", "engine=remote",
              "mode=sync", "partial_rollout=off", "save_every=2",
              "optim.lr=0.01"]  # a large step: the base and step 2 differ clearly
    fleet = ThreadFleet(_policy("models/addition-tiny"), 1)
    try:
        assert main(["train", *common, "total_steps=2", f"remote.urls=[{fleet.fleet.urls[0]}]"]) == 0
    finally:
        fleet.close()
    fleet = ThreadFleet(_policy("models/addition-tiny"), 1)  # a fresh server: the base weights again
    try:
        assert main(["train", *common, "total_steps=3", "resume=true", f"remote.urls=[{fleet.fleet.urls[0]}]"]) == 0
    finally:
        fleet.close()
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("step", 0) >= 1}
    assert rows[3]["mismatch/tokens_lag0"] > 0
    assert rows[3]["mismatch/max_abs_lag0"] < 1e-3, rows[3]
