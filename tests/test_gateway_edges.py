"""The gateway's edges, found by sending it malformed requests: aiohttp's own refusals
(404, 405, 413) in OpenAI's error shape, tools without a named function, the body limit
(decided before the body is read, and while it is read), the API key, and the refusal
to listen beyond loopback without one. Each test starts its gateway on a free port and
stops it, also when it fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from openai import AsyncOpenAI, AuthenticationError

from asyncrl.cli import main as cli_main
from asyncrl.rollout.client import LLMClient, stop_token_ids
from asyncrl.config import ConfigError, GatewayConfig, load_config
from asyncrl.engine import TorchEngine
from asyncrl.rollout.gateway import Gateway, get_format
from asyncrl.rollout.gateway.access import check_exposure, is_loopback
from asyncrl.types import SamplingParams

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "1 2 -> 3"}]}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


class UntouchedTokenizer:
    """Stands in for the tokenizer where a request must be refused before any tokenizing:
    it records every use (and fails it)."""

    def __init__(self) -> None:
        self.used: list[str] = []

    def __getattr__(self, name: str):
        self.used.append(name)
        raise AssertionError(f"the tokenizer was used: {name}")


@contextlib.asynccontextmanager
async def serving(tokenizer, settings: GatewayConfig | None = None, model=None):
    """A gateway on a free loopback port; with ``model``, plain ``/v1`` requests are served."""
    engine = None if model is None else TorchEngine(model, max_batch_size=4)
    sampling = SamplingParams(max_tokens=4, stop_token_ids=stop_token_ids(tokenizer)) if model is not None else None
    gateway = Gateway(tokenizer, get_format("hermes"), model_name="tiny", engine=engine, sampling=sampling,
                      settings=settings)
    try:
        await gateway.start()
        async with aiohttp.ClientSession() as http:
            yield gateway, engine, http
    finally:
        await gateway.stop()
        if engine is not None:
            await engine.shutdown()


def assert_openai_error(status: int, body: dict, expected: int, fragment: str) -> None:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert fragment in body["error"]["message"], body


def test_aiohttps_own_refusals_come_back_in_openai_shape():
    cases = [("GET", "/v1/nope", 404, "no route GET /v1/nope; served: GET /health"),
             ("POST", "/", 404, "POST /v1/chat/completions"),
             ("GET", "/v1/chat/completions", 405, "GET /v1/chat/completions is not allowed; use POST"),
             ("POST", "/health", 405, "use GET"),
             ("DELETE", "/sessions/abc/v1/models", 405, "use GET")]

    async def main():
        results = []
        async with serving(UntouchedTokenizer()) as (gateway, _, http):
            for method, path, status, fragment in cases:
                async with http.request(method, gateway.base_url + path) as r:
                    assert r.content_type == "application/json"
                    results.append((r.status, await r.json(), status, fragment))
            async with http.get(gateway.base_url + "/health") as r:  # and the server goes on
                assert r.status == 200
        return results

    for result in asyncio.run(main()):
        assert_openai_error(*result)


@pytest.mark.parametrize("tools, param", [
    ([TOOL, {"type": "function"}], "tools[1].function"),
    ([{"type": "function", "function": "add"}], "tools[0].function"),
    ([TOOL, TOOL, {"type": "function", "function": {"description": "no name"}}], "tools[2].function.name"),
    ([{"type": "function", "function": {"name": 7}}], "tools[0].function.name"),
])
def test_a_tool_without_a_named_function_is_refused_naming_its_index(tools, param):
    async def main():
        async with serving(UntouchedTokenizer()) as (gateway, _, http):
            async with http.post(gateway.base_url + "/v1/chat/completions", json={**CHAT, "tools": tools}) as r:
                return r.status, await r.json()

    status, body = asyncio.run(main())
    assert_openai_error(status, body, 400, param + ":")
    assert body["error"]["param"] == param


def test_a_body_over_the_limit_is_refused_fast_and_never_tokenized():
    huge = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 10_000_000}]}).encode()
    tokenizer = UntouchedTokenizer()

    async def chunked():  # no Content-Length: only reading can find out
        for i in range(0, len(huge), 2**16):
            yield huge[i:i + 2**16]

    async def main():
        results = []
        async with serving(tokenizer) as (gateway, _, http):
            for path in ("/v1/chat/completions", "/sessions/nope/v1/chat/completions"):
                start = time.perf_counter()
                async with http.post(gateway.base_url + path, data=huge) as r:
                    results.append((r.status, await r.json(), time.perf_counter() - start, "10000"))
            start = time.perf_counter()
            async with http.post(gateway.base_url + "/v1/chat/completions", data=chunked()) as r:
                results.append((r.status, await r.json(), time.perf_counter() - start, "over the gateway's limit"))
            async with http.post(gateway.base_url + "/v1/chat/completions", data=b"{") as r:  # the server goes on
                assert r.status == 400
        return results

    for status, body, seconds, fragment in asyncio.run(main()):
        assert_openai_error(status, body, 413, fragment)
        assert "gateway.max_body_bytes" in body["error"]["message"] and seconds < 5
    assert tokenizer.used == []


def test_a_smaller_limit_from_the_config_applies_to_declared_and_chunked_bodies():
    settings = load_config(None, ["gateway.max_body_bytes=1000"]).gateway
    body = json.dumps({**CHAT, "padding": "x" * 2000}).encode()

    async def chunked():
        yield body

    async def main():
        statuses = []
        async with serving(UntouchedTokenizer(), settings) as (gateway, _, http):
            for data in (body, chunked()):
                async with http.post(gateway.base_url + "/v1/completions", data=data) as r:
                    statuses.append((r.status, (await r.json())["error"]["message"]))
        return statuses

    assert [(s, "limit of 1000 bytes" in m) for s, m in asyncio.run(main())] == [(413, True), (413, True)]


def test_the_api_key_guards_every_route_but_health_and_sessions(tiny_policy):
    model, tokenizer = tiny_policy
    settings = GatewayConfig(api_key="s3cret")

    async def main():
        seen = []
        async with serving(tokenizer, settings, model) as (gateway, engine, http):
            url = gateway.base_url
            for headers, fragment in (({}, "no API key"), ({"Authorization": "Bearer wrong"}, "wrong API key"),
                                      ({"Authorization": "Basic s3cret"}, "no API key"),
                                      ({"Authorization": "Bearer s3cret!"}, "wrong API key")):
                for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/nope")):
                    async with http.request(method, url + path, json=CHAT, headers=headers) as r:
                        assert r.headers["WWW-Authenticate"] == "Bearer"
                        seen.append((r.status, await r.json(), 401, fragment))
            async with http.get(url + "/health") as r:
                assert r.status == 200
            try:  # the SDK sends its key as a bearer token
                await AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
            except AuthenticationError as exc:
                seen.append((exc.status_code, exc.body and {"error": exc.body}, 401, "wrong API key"))
            reply = await AsyncOpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0
                                      ).chat.completions.create(**CHAT, max_tokens=4)
            llm = LLMClient(engine, tokenizer, SamplingParams(max_tokens=4))
            async with gateway.session(llm) as session_url:  # a session URL is its own credential
                recorded = await AsyncOpenAI(base_url=session_url, api_key="not-needed", max_retries=0
                                             ).chat.completions.create(**CHAT)
            async with http.post(url + "/sessions/0123/v1/chat/completions", json=CHAT) as r:
                seen.append((r.status, await r.json(), 404, "no session '0123'"))  # a guess finds nothing
        return seen, reply, recorded, llm

    seen, reply, recorded, llm = asyncio.run(main())
    for result in seen:
        assert_openai_error(*result)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert len(llm.trajectories) == 1 and llm.trajectories[0].response_ids
    assert recorded.usage.completion_tokens == len(llm.trajectories[0].response_ids)


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("", False), ("10.1.2.3", False), ("gpu-box.lan", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_a_gateway_beyond_loopback_needs_a_key_or_an_explicit_opt_out():
    async def start(settings):
        gateway = Gateway(UntouchedTokenizer(), get_format("hermes"), model_name="tiny", settings=settings)
        try:
            await gateway.start("0.0.0.0", 0)
        finally:
            await gateway.stop()

    with pytest.raises(ConfigError, match="gateway.host='0.0.0.0'.*gateway.api_key") as refused:
        asyncio.run(start(GatewayConfig()))
    assert "gateway.allow_unauthenticated" in str(refused.value)
    check_exposure("0.0.0.0", GatewayConfig(api_key="k"))  # what would bind, allowed, without binding here
    check_exposure("0.0.0.0", GatewayConfig(allow_unauthenticated=True))


@pytest.mark.parametrize("overrides, fragment", [
    (["gateway.host=0.0.0.0"], "gateway.api_key is not set"),
    (["gateway.max_body_bytes=0"], "gateway.max_body_bytes"),
    (["gateway.api_key=''"], "gateway.api_key"),
])
def test_asyncrl_serve_refuses_before_loading_the_model(overrides, fragment, capsys, monkeypatch):
    def preflight(*_):
        raise AssertionError("the model was loaded: the refusal came too late (or not at all)")

    monkeypatch.setattr("asyncrl.orchestrator.serve.preflight", preflight)
    start = time.perf_counter()
    assert cli_main(["serve", "examples/countdown/eval.yaml", *overrides]) == 2
    assert fragment in capsys.readouterr().err and time.perf_counter() - start < 5
