"""A coding agent written against the OpenAI **Responses API**, as you would write your own.

It asks the model for a small Python function ("Write a Python function `add_7(x)` that
returns x plus 7."), offers one function tool, ``run_python`` (the code runs in
asyncrl's sandbox, :mod:`asyncrl.tools.sandbox`), sends each call's output back as a
``function_call_output`` item on ``previous_response_id``, and stops at the first reply
without a call (the answer) or after ``MAX_TURNS`` model calls. The reward is the task's
unit tests run against the answer's code in the sandbox (:func:`score`): 1 when they all
pass, else 0 — a wrong answer, one that raises, loops or reaches for the host scores 0.
asyncrl trains it unchanged (``workflow.agent: examples/coding_agent/agent.py:run``); the
sandbox's seconds of each episode reach the step rows as ``sandbox/seconds_mean``.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import weakref

from openai import AsyncOpenAI

from asyncrl.tools.sandbox import PYTHON_TOOL, passes_tests, python_tool

SYSTEM = ("Write the Python function the user asks for. You may call run_python to test code. "
          "Then reply with the function's code only.")
TOOLS = [PYTHON_TOOL]  # chat-completions shape: what the SFT traces and the gateway's rendering use
RESPONSES_TOOLS = [{"type": "function", **PYTHON_TOOL["function"]}]  # the same tool, as the Responses API spells it
MAX_TURNS = 3  # a test run, the answer, and one more run after a failed one
TOOL_TIMEOUT_S = 5.0  # a tool run or the tests: one-line functions need well under a second
TEST_TIMEOUT_S = 5.0

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> AsyncOpenAI


def extract_code(answer: str) -> str:
    """The code of an answer: the last fenced block where there is one, else its longest run
    of leading lines that parses as Python (a small model often writes the function, then a
    stray fence or prose). Only parsed here, never run: the sandbox runs it."""
    blocks = _FENCE.findall(answer)
    if blocks:
        return blocks[-1].strip() + "\n"
    lines = answer.strip().splitlines()
    for end in range(len(lines), 0, -1):
        code = "\n".join(lines[:end]) + "\n"
        try:
            ast.parse(code)
        except (SyntaxError, ValueError):  # ValueError: a NUL byte
            continue
        return code
    return ""


async def score(task, answer: str) -> float:
    """1.0 when the task's unit tests pass against the answer's code in the sandbox, else 0.0."""
    code = extract_code(answer)
    if not code.strip():
        return 0.0
    return await passes_tests(code, task.data["tests"], timeout_s=TEST_TIMEOUT_S)


async def run_tool(name: str, arguments: str) -> str:
    """One tool call's output as the model reads it; ``arguments`` is the JSON string the SDK hands over."""
    if name != "run_python":
        return f"unknown tool: {name}"
    try:
        code = json.loads(arguments).get("code")
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        code = None
    if not isinstance(code, str):
        return 'error: run_python needs {"code": "<python program>"}'
    return await python_tool(code, timeout_s=TOOL_TIMEOUT_S)


def sdk_client(base_url: str) -> AsyncOpenAI:
    """One SDK client per event loop, a copy pointed at each session (as the calculator's: no
    request timeout, the run's ``workflow.timeout_s`` bounds the episode)."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=None)
    return _clients[loop].with_options(base_url=base_url)


async def converse(client: AsyncOpenAI, request: str, tools: list[dict] | None) -> tuple[str, list[dict]]:
    """The conversation: the answer's text ("" when the turns ran out on a call) and the
    items exchanged, for whoever wants to read them."""
    items: list[dict] = [{"role": "user", "content": request}]
    kwargs: dict = {"tools": tools} if tools else {}
    reply = await client.responses.create(model="policy", instructions=SYSTEM, input=request, **kwargs)
    for turn in range(MAX_TURNS):
        calls = [item for item in reply.output if item.type == "function_call"]
        items += [item.model_dump(exclude_none=True) for item in reply.output]
        if not calls:
            return reply.output_text, items
        if turn == MAX_TURNS - 1:
            break
        outputs = [{"type": "function_call_output", "call_id": call.call_id,
                    "output": await run_tool(call.name, call.arguments)} for call in calls]
        items += outputs
        # instructions are not carried over by previous_response_id (the API's rule): sent again
        reply = await client.responses.create(model="policy", instructions=SYSTEM, input=outputs,
                                              previous_response_id=reply.id, **kwargs)
    return "", items


async def run(task, base_url: str) -> float:
    answer, _ = await converse(sdk_client(base_url), task.prompt, RESPONSES_TOOLS)
    return await score(task, answer)


async def run_without_tool(task, base_url: str) -> float:
    """The same request with no tool offered: the answer written straight away."""
    answer, _ = await converse(sdk_client(base_url), task.prompt, None)
    return await score(task, answer)


def main(argv: list[str] | None = None) -> None:
    """Ask one request of a served model by hand and print the conversation:
    ``asyncrl serve examples/coding_agent/eval.yaml gateway.port=8000`` then
    ``python examples/coding_agent/agent.py "Write a Python function \\`double(x)\\` that returns twice x."``."""
    import argparse

    parser = argparse.ArgumentParser(description="ask the coding agent for one function")
    parser.add_argument("request")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--no-tool", action="store_true", help="offer no tool")
    args = parser.parse_args(argv)

    async def ask() -> tuple[str, list[dict]]:
        return await converse(sdk_client(args.base_url), args.request, None if args.no_tool else RESPONSES_TOOLS)

    answer, items = asyncio.run(ask())
    for item in items:
        print(json.dumps(item))
    print(json.dumps({"answer": answer, "code": extract_code(answer)}))


if __name__ == "__main__":
    main()
