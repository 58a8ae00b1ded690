"""A Countdown agent written against the official OpenAI SDK, as you would write your own:
it asks the model, runs the tools the model calls, and scores the final answer.

asyncrl trains it unchanged — the only thing that ties it to asyncrl is that it takes
its ``base_url`` as an argument (``workflow.agent: examples/openai_agent/agent.py:run``).
Two tools: ``calculate`` evaluates an arithmetic expression, ``check`` says whether an
expression uses the task's numbers and reaches the target. The reward is its own
(:func:`score`), not the Countdown task's default.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections import Counter

from openai import AsyncOpenAI

from asyncrl.tasks.countdown import FORMAT_REWARD, countdown_reward, parse_expression

TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "check", "description": "Whether an expression uses the given numbers and reaches the target.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
MAX_TURNS = 3
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client_for(base_url: str) -> AsyncOpenAI:
    """Making an SDK client costs ~20 ms here (connection pool, TLS context), more than a
    reply of the tiny model: keep one per event loop and point a cheap copy at each session."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=0)
    return _clients[loop].with_options(base_url=base_url)


def calculate(task, expression: str) -> str:
    parsed = parse_expression(expression)
    return "not an arithmetic expression" if parsed is None or parsed[0] is None else str(parsed[0])


def check(task, expression: str) -> str:
    return "correct" if countdown_reward(task, expression) == 1.0 else "not a solution"


def score(task, answer: str) -> float:
    """1.0 for a solution; else ``FORMAT_REWARD`` times the share of the task's numbers the
    expression uses (multiset overlap over the longer of its and the task's lists), 0.0 for
    no expression.

    The task's default (``countdown_reward``) pays the full bonus for any expression, and
    under the tool prompt, which the shipped policy never saw in its warm-up, almost all it
    finds is that bonus: it collapsed onto answering ``1``, every group scored 0.1 and was
    filtered. Here ``1`` earns nothing unless 1 is one of the numbers, and the credit
    still grows with each number used, so groups keep their spread: before training, 55 %
    of groups are filtered, against 95 % if the bonus required exactly the task's numbers.
    """
    parsed = parse_expression(answer)
    if parsed is None:
        return 0.0
    if countdown_reward(task, answer) == 1.0:
        return 1.0
    numbers, used = Counter(int(n) for n in task.data["numbers"]), Counter(parsed[1])
    return FORMAT_REWARD * (sum((numbers & used).values()) / max(numbers.total(), used.total()))


async def run(task, base_url: str) -> float:
    client = client_for(base_url)
    messages = [{"role": "user", "content": task.prompt}]
    answer = ""
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            answer = message.content or ""
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
                result = {"calculate": calculate, "check": check}[call.function.name](task, str(expression))
            except (KeyError, ValueError, AttributeError):
                result = f"unknown tool or bad arguments: {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return score(task, answer)
