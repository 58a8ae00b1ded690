"""One large request must not stall the gateway. A real ``asyncrl serve`` process (its body
limit raised so that a 10 MB prompt is read) is sent what used to stall or crash it: a
10 MB prompt (tokenized on the event loop for 12 s while ``/health`` waited), 200,000
messages, a 100 MB body, JSON nested past the parser, a stream client that hangs up.
In-process, a gateway whose engine claims a large context shows that a prompt past the
characters bound is tokenized off the loop. Every server listens on a free port and is
stopped, also when a test fails: the process (seconds to load) by the module's fixture,
the in-process gateways by their test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from transformers import AutoTokenizer

from asyncrl.rollout.client import stop_token_ids
from asyncrl.config import GatewayConfig
from asyncrl.engine import PromptTooLongError
from asyncrl.rollout.gateway import Gateway, get_format
from asyncrl.rollout.gateway.prompt_size import refuse_unfit, text_chars
from asyncrl.json_api import Refused
from asyncrl.types import Completion, SamplingParams

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models/countdown-tiny"  # context 128 tokens; its longest token, <|endoftext|>, is 13 characters
TEN_MB = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 10_000_000}]}).encode()


class Served:
    """``asyncrl serve`` in a process of its own; its stderr is collected line by line: the
    start banner (the address line and its indented notes) in ``banner``, every line after
    it in ``lines``, so a test that counts lines sees only what came after the banner —
    however late the reader thread gets to the notes."""

    def __init__(self, *overrides: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "serve", "examples/countdown/eval.yaml", "gateway.port=0",
             *overrides], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.banner: list[str] = []
        self.lines: list[str] = []
        self._url: list[str] = []
        self._listening = threading.Event()
        self._healthy = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        in_banner = False
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            if m := re.search(r" at (http://\S+)/v1 ", line):
                self._url.append(m.group(1))
                in_banner = True
            elif in_banner and not line.startswith("  "):  # a note is indented; the banner ends before this
                in_banner = False
            (self.banner if in_banner else self.lines).append(line)
            if self._url:
                self._listening.set()
        self._listening.set()

    def url(self, timeout_s: float = 120) -> str:
        """The server's address, once it answers ``/health``: printing the address is not
        being ready, so the fixture returns on an answer."""
        self._listening.wait(timeout_s)
        assert self._url, "asyncrl serve did not start:\n" + "\n".join(self.lines[-20:])
        deadline = time.monotonic() + timeout_s
        while not self._healthy:
            try:
                with urllib.request.urlopen(self._url[0] + "/health", timeout=10):
                    self._healthy = True  # an error status raises: only an answer of 2xx gets here
            except OSError as exc:
                assert self.proc.poll() is None and time.monotonic() < deadline, \
                    f"asyncrl serve never answered /health ({exc}):\n" + "\n".join(self.lines[-20:])
                time.sleep(0.1)
        return self._url[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def served():
    server = Served("gateway.max_body_bytes=33554432")  # 32 MiB: the 10 MB prompt is read, not refused by size
    try:
        server.url()
        yield server
    finally:
        server.stop()


async def during(url: str, request) -> tuple[int, dict, float, list[float]]:
    """Send ``request`` (a coroutine answering (status, body)) while a thread of its own
    polls ``/health`` — its own, so that its clock runs while the server's loop is stuck
    even when the server shares this process: the status and body, seconds to the answer,
    each poll's latency."""
    latencies: list[float] = []
    failed: list[Exception] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(url + "/health", timeout=60) as r:
                    r.read()
            except OSError as exc:  # refused, reset, an HTTP error: reported below, on the test's thread
                failed.append(exc)
                return
            latencies.append(time.perf_counter() - t)
            time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    start = time.perf_counter()
    try:
        status, body = await request
    finally:
        stop.set()
        await asyncio.to_thread(poller.join)  # the loop must go on serving the last poll
    assert not failed and latencies, failed
    return status, body, time.perf_counter() - start, latencies


async def post(http: aiohttp.ClientSession, url: str, data) -> tuple[int, dict]:
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


def assert_openai_error(status: int, body: dict, expected: int, *fragments: str) -> None:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == expected, body
    for fragment in fragments:
        assert fragment in body["error"]["message"], body


@pytest.mark.slow
def test_health_answers_within_100_ms_while_a_10_mb_prompt_is_refused(served):
    url = served.url()

    async def attempt():
        async with aiohttp.ClientSession() as http:
            return await during(url, post(http, url + "/v1/chat/completions", TEN_MB))

    for _ in range(3):  # a busy machine may hold one poll up; a stalled loop holds every one for seconds
        status, body, seconds, latencies = asyncio.run(attempt())
        if max(latencies) < 0.1:
            break
    assert max(latencies) < 0.1, f"/health took up to {max(latencies):.3f} s ({len(latencies)} polls)"
    assert seconds < 2
    assert_openai_error(status, body, 400, "10000000 characters", "context of 128 tokens", "769231 tokens")
    assert body["error"]["param"] == "messages"


def test_200000_messages_are_refused_by_their_count(served):
    url = served.url()
    many = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 200_000}).encode()

    async def main():
        async with aiohttp.ClientSession() as http:
            return await during(url, post(http, url + "/v1/chat/completions", many))

    status, body, seconds, latencies = asyncio.run(main())
    assert seconds < 2 and max(latencies) < 1, (seconds, max(latencies))  # before: 5-8 s, /health as long
    assert_openai_error(status, body, 400, "200000 messages", "context of 128 tokens")


def test_what_used_to_be_a_500_is_a_4xx_in_openai_shape(served):
    url = served.url()
    deep_tools = ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
                  '{"name": "f", "parameters": ' + '{"a": ' * 800 + "1" + "}" * 800 + "}}]}").encode()  # parses
    deep_arguments = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 1500}}]},
        {"role": "user", "content": "1 2 -> 3"}]
    cases = [
        ("POST", "/v1/chat/completions", b"{" + b" " * 100_000_000 + b"}", 413, "limit of 33554432 bytes"),
        ("POST", "/v1/chat/completions", b"[" * 100_000, 400, "nests too deeply"),
        ("POST", "/v1/completions", b'{"prompt": "a", "seed": ' + b"1" * 5000 + b"}", 400, "not JSON"),
        ("POST", "/v1/chat/completions", b'{"model": "\xff"}', 400, "not JSON: 'utf-8' codec"),
        ("POST", "/v1/chat/completions", deep_tools, 400, "nests too deeply"),
        ("POST", "/v1/chat/completions", json.dumps({"messages": deep_arguments}).encode(), 400, "context holds 128"),
        ("GET", "/v1/nope", None, 404, "no route GET /v1/nope"),
        ("GET", "/v1/chat/completions", None, 405, "use POST"),
        ("PUT", "/health", None, 405, "use GET"),
    ]

    async def main():
        results = []
        async with aiohttp.ClientSession() as http:
            for method, path, data, *expected in cases:
                async with http.request(method, url + path, data=data) as r:
                    assert r.content_type == "application/json", path
                    results.append((r.status, await r.json(), *expected))
        return results

    for result in asyncio.run(main()):
        assert_openai_error(*result)
    assert not any("Traceback" in line for line in served.lines), "\n".join(served.lines)


def test_a_stream_client_that_hangs_up_is_one_log_line(served):
    url = served.url()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"stream": True, "max_tokens": 100, "messages": [{"role": "user", "content": "1 2 -> 3"}]})
    before = len(served.lines)

    async def hang_up():
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        await writer.drain()
        writer.transport.abort()

    asyncio.run(hang_up())
    deadline = time.monotonic() + 30
    while not any("disconnected" in line for line in served.lines[before:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    new = served.lines[before:]
    said = [line for line in new if "disconnected" in line]
    assert len(said) == 1 and said[0].startswith(
        "gateway: POST /v1/chat/completions: the client disconnected before its reply was sent"), new
    assert not any("Traceback" in line or line.startswith("  ") for line in new), "\n".join(new)


# -- in-process: the tokenizing path --------------------------------------------


class LongContext:
    """An engine that claims a context of ``max_positions`` tokens and refuses past it as
    the real one does; it answers anything shorter with end-of-turn at once."""
    max_context = property(lambda self: self.max_positions)  # the engine contract's name for it

    def __init__(self, max_positions: int, eos: int) -> None:
        self.max_positions, self.eos, self.version = max_positions, eos, 0

    async def generate(self, prompt_ids, sampling):
        if len(prompt_ids) >= self.max_positions:
            raise PromptTooLongError(len(prompt_ids), self.max_positions)
        return Completion([self.eos], [0.0], [0], "stop")


class Spied:
    """The real tokenizer, with every tokenizing call named in ``used``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.used = tokenizer, []

    def __getattr__(self, name):
        if name in ("encode", "apply_chat_template", "__call__"):
            self.used.append(name)
        return getattr(self.tokenizer, name)


@contextlib.asynccontextmanager
async def serving(tokenizer, context: int):
    engine = LongContext(context, tokenizer.eos_token_id)
    gateway = Gateway(tokenizer, get_format("hermes"), model_name="tiny", engine=engine,
                      sampling=SamplingParams(max_tokens=4, stop_token_ids=stop_token_ids(tokenizer)),
                      settings=GatewayConfig(max_body_bytes=2**25))
    try:
        await gateway.start()
        async with aiohttp.ClientSession() as http:
            yield gateway.base_url, http
    finally:
        await gateway.stop()


def test_a_large_prompt_is_tokenized_off_the_loop():
    """500,000 characters may make fewer than 200,000 tokens as far as the characters
    bound knows (13 a token): they are tokenized on the gateway's threads, and /health is
    answered meanwhile. Before, the loop tokenized them (0.8 s per request here)."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    chat = json.dumps({"messages": [{"role": "user", "content": "7" * 500_000}]}).encode()
    text = json.dumps({"prompt": "7" * 500_000}).encode()

    async def attempt():
        async with serving(tokenizer, 200_000) as (url, http):
            return [await during(url, post(http, url + path, data))
                    for path, data in (("/v1/chat/completions", chat), ("/v1/completions", text))]

    for _ in range(3):
        results = asyncio.run(attempt())
        if all(max(latencies) < 0.1 for *_, latencies in results):
            break
    for (status, body, _, latencies), param in zip(results, ("messages", "prompt")):
        assert max(latencies) < 0.1, f"/health took up to {max(latencies):.3f} s ({len(latencies)} polls)"
        assert_openai_error(status, body, 400, "context holds 200000")
        assert body["error"]["param"] == param


def test_what_certainly_cannot_fit_is_refused_before_any_tokenizing():
    tokenizer = Spied(AutoTokenizer.from_pretrained(MODEL))
    call = {"role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "1" * 2000}}]}
    parts = {"role": "user", "content": [{"type": "text", "text": "1" * 1700}, {"type": "image_url", "image_url": {}}]}
    bodies = [({"messages": [{"role": "user", "content": "x" * 10_000_000}]}, "10000000 characters"),
              ({"messages": [{"role": "user", "content": ""}] * 128}, "128 messages"),
              ({"messages": [call]}, "2001 characters"),
              ({"messages": [parts]}, "1700 characters")]

    async def main():
        results = []
        async with serving(tokenizer, 128) as (url, http):
            for body, fragment in bodies:
                results.append((*await post(http, url + "/v1/chat/completions", json.dumps(body)), 400, fragment))
            async with http.post(url + "/v1/completions", json={"prompt": "y" * 1652}) as r:  # 13 x 127 + 1
                results.append((r.status, await r.json(), 400, "1652 characters"))
            assert tokenizer.used == []
            async with http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                                 ) as r:  # what may fit is tokenized, and served
                assert r.status == 200, await r.text()
        return results

    for result in asyncio.run(main()):
        assert_openai_error(*result, "context of 128 tokens")
    assert tokenizer.used


@pytest.mark.parametrize("messages, chars", [
    ([{"role": "user", "content": "abc"}, {"role": "tool", "content": "de"}], 5),
    ([{"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": 7}, "x", {"text": "y"}]}],
     3),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": "{}"}},
                                                            {"function": "add"}, 3]}], 5),
    ([7, None, {"content": 7}], 0),
    ("not a list", 0),
])
def test_text_chars_counts_only_text_where_text_belongs(messages, chars):
    assert text_chars(messages) == chars


def test_the_bounds_refuse_at_the_context_and_not_before():
    refuse_unfit({"messages": [{"role": "user", "content": "a" * 1270}]}, "messages", 128, 10)  # 127 tokens or more
    refuse_unfit({"messages": [{"role": "user"}] * 127}, "messages", 128, 10)
    refuse_unfit({"prompt": "a" * 1270, "messages": [{}] * 500}, "prompt", 128, 10)  # a completion's messages: extra
    for data, param in (({"messages": [{"role": "user", "content": "a" * 1271}]}, "messages"),
                        ({"messages": [{"role": "user"}] * 128}, "messages"), ({"prompt": "a" * 1271}, "prompt")):
        with pytest.raises(Refused) as refused:
            refuse_unfit(data, param, 128, 10)
        assert refused.value.status == 400 and refused.value.param == param


if __name__ == "__main__":  # docs/agents.md's figures: python tests/test_gateway_stall.py [runs]
    import statistics

    served = Served("gateway.max_body_bytes=33554432")  # above 10 MB, so the prompt reaches the size check
    try:
        base = served.url()

        async def once() -> tuple[int, float, list[float]]:
            async with aiohttp.ClientSession() as http:
                status, _, seconds, health = await during(base, post(http, base + "/v1/chat/completions", TEN_MB))
                return status, seconds, health

        every = []
        for run in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
            status, seconds, health = asyncio.run(once())
            every += health
            print(f"run {run}: {status} after {seconds:.2f} s; /health n={len(health)} "
                  f"median {statistics.median(health) * 1e3:.1f} ms, max {max(health) * 1e3:.1f} ms")
        print(f"all runs: /health median {statistics.median(every) * 1e3:.1f} ms, max {max(every) * 1e3:.1f} ms")
    finally:
        served.stop()
