"""asyncrl/tools/mcp_tools.py: an agent's tools from MCP servers (stdio and streamable HTTP, several
at once), listed as OpenAI tools and called by the model's tool calls; a server that raises, hangs
or dies fails the episode naming itself, and never hangs it. Then the search agent's MCP variant
(examples/search_agent/agent_mcp.py) trains through the gateway with its tool from an MCP server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from asyncrl.tools.mcp_tools import MCPServerSpec, MCPToolError, MCPTools

REPO = Path(__file__).resolve().parents[1]
SERVER = str(REPO / "tests/mcp_test_server.py")


def stdio(name: str) -> dict:
    return {"name": name, "command": [sys.executable, SERVER, name]}


def call(name: str, **arguments) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


@pytest.fixture
def http_server():
    """A streamable-HTTP server on a free port, stopped by the test whatever happens."""
    process = subprocess.Popen([sys.executable, SERVER, "web", "--http"], stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://"), f"the server printed {url!r} (exit {process.poll()})"
        yield {"name": "web", "url": url}
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_server_is_a_command_or_a_url_and_says_so():
    with pytest.raises(ValueError, match="exactly one of command"):
        MCPServerSpec(name="x")
    with pytest.raises(ValueError, match="exactly one of command"):
        MCPServerSpec.from_dict({"name": "x", "command": ["a"], "url": "http://h/mcp"})
    with pytest.raises(ValueError, match="letters, digits"):
        MCPServerSpec(name="a b", url="http://h/mcp")
    with pytest.raises(ValueError, match="non-empty list"):
        MCPServerSpec(name="x", command="python server.py")
    with pytest.raises(ValueError, match="unknown keys"):
        MCPServerSpec.from_dict({"name": "x", "url": "http://h/mcp", "headers": {}})
    with pytest.raises(ValueError, match="distinct names"):
        MCPTools([stdio("a"), stdio("a")])


@pytest.mark.slow
def test_two_servers_at_once_list_their_tools_and_answer_calls(http_server):
    async def go():
        async with MCPTools([stdio("local"), http_server], timeout_s=20) as tools:
            names = [t["function"]["name"] for t in tools.openai_tools]
            # every tool is offered by both servers: each copy is prefixed by its server
            assert names == [f"{s}__{t}" for s in ("local", "web") for t in ("echo", "add", "boom", "hang", "die")]
            echo = tools.openai_tools[0]["function"]
            assert echo["description"] == "Echo the text back, prefixed by the server's name (local)."
            assert echo["parameters"]["properties"]["text"]["type"] == "string"
            assert echo["parameters"]["required"] == ["text"]
            assert await tools.call(call("local__echo", text="hi")) == "local: hi"
            assert await tools.call(call("web__echo", text="hi")) == "web: hi"
            assert await tools.call(call("web__add", a=2, b=40)) == "42"
            # what the model got wrong is a tool message, not a failure
            assert (await tools.call(call("echo", text="hi"))).startswith("unknown tool: echo")
            bad = {"function": {"name": "local__add", "arguments": "[1, 2]"}}
            assert "must be a JSON object" in await tools.call(bad)

    asyncio.run(go())


@pytest.mark.slow
def test_one_server_keeps_its_tool_names_and_an_sdk_tool_call_works():
    from openai.types.chat import ChatCompletionMessageToolCall

    async def go():
        async with MCPTools([stdio("only")], timeout_s=20) as tools:
            assert [t["function"]["name"] for t in tools.openai_tools] == ["echo", "add", "boom", "hang", "die"]
            sdk_call = ChatCompletionMessageToolCall.model_validate(call("add", a=1, b=2))
            assert await tools.call(sdk_call) == "3"

    asyncio.run(go())


class ScriptedModel:
    """An ``AsyncOpenAI`` stand-in whose replies are ``replies`` in turn; records what it was sent."""

    def __init__(self, *replies: dict) -> None:
        from openai.types.chat import ChatCompletionMessage

        self.replies = [ChatCompletionMessage.model_validate({"role": "assistant", **r}) for r in replies]
        self.sent: list[dict] = []
        self.chat = self.completions = self

    async def create(self, **request):
        from types import SimpleNamespace

        self.sent.append(request)
        return SimpleNamespace(choices=[SimpleNamespace(message=self.replies[len(self.sent) - 1])])


def test_the_agent_loop_of_the_tool_box_contract_runs_over_mcp_tools():
    """MCPTools is a ToolBox (asyncrl/tools/toolbox.py): the loop the verifiers agent runs over a
    taskset's tools offers the MCP servers' tools and answers the model's calls through them."""
    from asyncrl.rollout.workflows.verifiers_agent import converse
    from asyncrl.tools.toolbox import ToolBox

    model = ScriptedModel({"content": None, "tool_calls": [call("add", a=1, b=2)]}, {"content": "3"})

    async def go():
        async with MCPTools([stdio("only")], timeout_s=20) as tools:
            assert isinstance(tools, ToolBox)
            return await converse(model, [{"role": "user", "content": "1+2?"}], tools, max_turns=4)

    conversation = asyncio.run(go())
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant"]
    assert conversation[2] == {"role": "tool", "tool_call_id": "c1", "content": "3"}
    assert conversation[-1]["content"] == "3" and len(model.sent) == 2
    assert [t["function"]["name"] for t in model.sent[0]["tools"]] == ["echo", "add", "boom", "hang", "die"]


async def _fails(tool: str, **options) -> tuple[MCPToolError, float]:
    started = time.monotonic()
    with pytest.raises(MCPToolError) as caught:
        async with MCPTools([stdio("flaky")], **options) as tools:
            await tools.call(call(tool))
    return caught.value, time.monotonic() - started


@pytest.mark.slow
def test_a_tool_that_raises_fails_the_episode_naming_server_and_tool():
    error, _ = asyncio.run(_fails("boom", timeout_s=20))
    assert (error.server, error.tool) == ("flaky", "boom")
    assert "MCP server 'flaky', tool 'boom': the tool reported an error" in str(error)
    assert "boom went the tool" in str(error)

    async def as_message():
        async with MCPTools([stdio("flaky")], timeout_s=20, tool_errors="message") as tools:
            return await tools.call(call("boom"))

    assert "boom went the tool" in asyncio.run(as_message())


@pytest.mark.slow
def test_a_hung_tool_times_out_naming_the_server_and_the_server_is_still_stopped():
    error, took = asyncio.run(_fails("hang", timeout_s=5))
    assert (error.server, error.tool) == ("flaky", "hang")
    assert "no answer within 5 s (timeout_s)" in str(error)
    assert took < 20  # 5 s of timeout, the server's start, and its bounded stop


@pytest.mark.slow
def test_a_server_that_dies_mid_call_fails_the_episode_naming_it():
    error, took = asyncio.run(_fails("die", timeout_s=20))
    assert str(error) == "MCP server 'flaky', tool 'die': the call failed: MCPError: Connection closed"
    assert took < 15  # the closed pipe is noticed, not waited out


@pytest.mark.slow
def test_a_server_that_never_starts_or_is_not_there_is_named():
    async def connect(server):
        async with MCPTools([server], timeout_s=5):
            pass

    with pytest.raises(MCPToolError, match=r"MCP server 'ghost': connecting \(/nonexistent/mcp-server\) failed"):
        asyncio.run(connect({"name": "ghost", "command": ["/nonexistent/mcp-server"]}))
    with pytest.raises(MCPToolError, match=r"MCP server 'mute': connecting .* no answer within 2 s"):
        asyncio.run(MCPTools([{"name": "mute", "command": [sys.executable, "-c", "import time; time.sleep(60)"]}],
                             timeout_s=2).__aenter__())
    with pytest.raises(MCPToolError, match=r"MCP server 'gone': connecting \(http://127.0.0.1:9/mcp\) failed"):
        asyncio.run(connect({"name": "gone", "url": "http://127.0.0.1:9/mcp"}))


SMALL = ["total_steps=2", "batch_size=2", "group_size=4", "eval.num_tasks=2", "eval.samples_per_task=1",
         "task.num_validation=4", "algorithm.filter_zero_variance=false", "eval_every=0"]


@pytest.mark.slow
def test_the_mcp_search_agent_trains_with_its_tool_from_an_mcp_server(tmp_path, monkeypatch):
    """The shipped search policy, its search tool served by ``asyncrl.tools.retrieval.mcp_server``
    (started by the agent over streamable HTTP), two steps through the gateway."""
    pytest.importorskip("bm25s")
    from asyncrl.cli import main

    monkeypatch.delenv("ASYNCRL_MCP_SERVERS", raising=False)
    out = tmp_path / "mcp"
    assert main(["train", "examples/search_agent/mcp.yaml", f"output_dir={out}", *SMALL]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if m["step"] > 0]
    assert len(trained) == 2 and all(m["agent/tool_calls_mean"] > 0 for m in trained), trained
    assert all(m.get("agent/tool_errors_total", 0) == 0 for m in trained)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    results = [m["content"] for s in samples for m in s["conversation"] if m["role"] == "tool"]
    assert results and any(" is in " in r for r in results)  # the corpus' facts came back from the server
    assert not (out / "errors.jsonl").exists() or not (out / "errors.jsonl").read_text().strip()


@pytest.mark.slow
def test_an_episode_cancelled_mid_call_stops_its_servers_without_hanging():
    """What asyncrl does to an episode past ``workflow.timeout_s``: cancel it. The hung call is
    abandoned and the stdio server stopped within the SDK's bounded shutdown."""
    async def episode():
        async with MCPTools([stdio("slow")], timeout_s=60) as tools:
            await tools.call(call("hang"))

    async def go():
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(episode(), timeout=4)
        return time.monotonic() - started

    assert asyncio.run(go()) < 15


@pytest.mark.slow
def test_a_dying_server_fails_its_episode_and_the_run_goes_on(tmp_path, policy_dir):
    """``tests/agent_mcp_flaky.py``: the server dies under each task's first episode. Those
    episodes are written to errors.jsonl naming the server and tool and retried; training finishes."""
    from asyncrl.cli import main

    out = tmp_path / "flaky"
    assert main(["train", "examples/openai_agent/train.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "workflow.agent=tests/agent_mcp_flaky.py:run", "total_steps=2", "batch_size=2", "group_size=2",
                 "eval.num_tasks=2", "eval.samples_per_task=1", "task.num_train=16", "task.num_validation=4",
                 "algorithm.filter_zero_variance=false", "watchdog.max_error_rate=1"]) == 0
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert errors and all("MCP server 'flaky', tool 'die': the call failed" in e["exception"] for e in errors)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    # every episode trained is a retry or a later one
    assert len(samples) == 2 * 2 * 2 and all(s["reward"] == 1.0 for s in samples)
