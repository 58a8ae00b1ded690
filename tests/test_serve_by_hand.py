"""The documented way to try an agent by hand: ``asyncrl serve examples/calculator_agent/eval.yaml``
(SmolLM2-135M-Instruct, a 2,048-token context) carries a whole tool round trip from the
official OpenAI SDK — the tools offered, an assistant message with a call, the tool's
result, and the model's next reply — and its banner says how tool calls are read.

The Countdown policy that the docs served before holds 128 tokens: the tools' schema alone
overflowed it ("the prompt has 162 tokens; the model's context holds 128").

The call in the history is written by the client, as an agent framework replaying a
conversation sends it: the base model does not call the tool by itself (its tool-call rate
on the calculator tasks is 0.0, docs/agents.md); after ``asyncrl sft`` it does, which the
calculator example measures. Skipped when SmolLM2 cannot be had (tests/real_model.py).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from real_model import smollm2_dir  # noqa: F401 (a fixture)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("calculator_agent", ROOT / "examples/calculator_agent/agent.py")
agent = importlib.util.module_from_spec(_spec)  # the example's own tool and schema
_spec.loader.exec_module(agent)


def start_serve(model_dir: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """``asyncrl serve`` on a free port; returns the process, its URL and its banner lines."""
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve", "examples/calculator_agent/eval.yaml",
                             f"model.path={model_dir}", "gateway.port=0"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    banner: list[str] = []
    deadline = time.monotonic() + 600  # loading a 135M model on a loaded 2-core machine
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"asyncrl serve exited with {proc.wait()} before listening:\n" + "".join(banner))
        banner.append(line)
        found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
        if found:
            for _ in range(2):  # the notes that follow the address: the template and the tool-call format
                banner.append(proc.stderr.readline())
            return proc, found.group(1), banner
    raise AssertionError("asyncrl serve printed no address within 600 s:\n" + "".join(banner))


def test_the_documented_serve_carries_a_tool_round_trip_from_the_official_sdk(smollm2_dir):  # noqa: F811
    proc, url, banner = start_serve(smollm2_dir)
    try:
        assert any(line.strip().startswith("tool calls: hermes") for line in banner), banner
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=600)
        question = "What is 347 * 89 - 1206?"
        messages: list[dict] = [{"role": "user", "content": question}]
        first = client.chat.completions.create(model="smollm2", messages=messages, tools=agent.TOOLS,
                                               temperature=0, max_tokens=16)
        assert first.choices[0].message.role == "assistant"
        assert first.usage.prompt_tokens > 128  # the tools' schema alone: more than Countdown's context

        arguments = json.dumps({"expression": "347 * 89 - 1206"})
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "calculate", "arguments": arguments}}]})
        result = agent.run_tool("calculate", arguments)
        assert result == "29677"  # the example's calculator, not the model, does the arithmetic
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": result})
        second = client.chat.completions.create(model="smollm2", messages=messages, tools=agent.TOOLS,
                                                temperature=0, max_tokens=16)
        reply = second.choices[0]
        assert reply.finish_reason in ("stop", "length")
        assert reply.message.content, reply  # a reply, not an error: the round trip fit the context
        # The call and its result were rendered into the prompt: it grew by at least their text.
        assert second.usage.prompt_tokens > first.usage.prompt_tokens + 15
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()
