"""A calculator agent written against the official OpenAI SDK, as you would write your own.

It asks the model an arithmetic question it cannot answer in its head ("What is
347 * 89 - 1206?"), runs the ``calculate`` tool the model calls, sends the result back,
and stops at the first reply without a tool call (the final answer) or after
``MAX_TURNS`` model calls. The reward is :func:`score` of that final answer: 1 when its
last number is the right one, else 0. asyncrl trains it unchanged
(``workflow.agent: examples/calculator_agent/agent.py:run``).

``run_without_tool`` asks the same question with no tool offered: what the policy scores
in its head (``workflow.agent: examples/calculator_agent/agent.py:run_without_tool``).

The calculator never runs ``eval``: :func:`evaluate` walks the expression's ``ast`` and
allows numbers, ``+ - * /``, unary signs and parentheses, nothing else.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import re
import weakref
from fractions import Fraction

from openai import AsyncOpenAI

SYSTEM = "For arithmetic, call the calculate tool. Then reply with just the number."
SYSTEM_WITHOUT_TOOL = "Reply with just the number."
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
MAX_TURNS = 3  # the call, the answer, and one more call after a failed one
MAX_EXPRESSION_CHARS = 200  # no '**', so 200 characters bound the result's size too

_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
              ast.Div: Fraction.__truediv__}
_NUMBER = re.compile(r"-?\d[\d,]*")
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> AsyncOpenAI


class CalculatorError(ValueError):
    """The expression is not one the calculator accepts, or has no value (division by zero)."""


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``. Raises :class:`CalculatorError` naming what is
    not allowed: anything but numbers, ``+ - * /``, unary ``+ -`` and parentheses."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from exc
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # not bool, complex or str
        return Fraction(node.value)
    if isinstance(node, ast.Constant) and type(node.value) is float:
        if not math.isfinite(node.value):
            raise CalculatorError(f"number out of range: {ast.unparse(node)}")
        return Fraction(repr(node.value))  # the decimal written, 0.1 as 1/10 (Fraction(0.1) is the binary float)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    raise CalculatorError(f"only numbers and + - * / ( ) are allowed, not {type(node).__name__}: "
                          f"{ast.unparse(node)!r}")


def format_number(value: Fraction) -> str:
    """An integer as its digits; anything else as a decimal of at most 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def calculate(expression: str) -> str:
    """The tool as the model reads it: the value, or a line starting ``error:`` (which the
    gateway counts as a tool error). Never raises on what the model wrote."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"


def run_tool(name: str, arguments: str) -> str:
    """One tool call's result; ``arguments`` is the JSON string the SDK hands over."""
    if name != "calculate":
        return f"unknown tool: {name}"
    try:
        expression = json.loads(arguments).get("expression")
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        expression = None
    if not isinstance(expression, str):
        return 'error: calculate needs {"expression": "<arithmetic>"}'
    return calculate(expression)


def score(task, answer: str) -> float:
    """1.0 when the last number in ``answer`` (commas allowed) is the task's answer, else 0.0.
    The last one, so a reply cannot collect credit by listing candidates."""
    numbers = _NUMBER.findall(answer)
    if not numbers:
        return 0.0
    return 1.0 if int(numbers[-1].replace(",", "")) == int(task.data["answer"]) else 0.0


def sdk_client(base_url: str) -> AsyncOpenAI:
    """Making an SDK client costs ~20 ms; keep one per event loop, point a copy at each session.

    No request timeout: the SDK's default (600 s) cut replies that waited behind an
    evaluation on a loaded CPU, and the run's ``workflow.timeout_s`` bounds the episode anyway."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=None)
    return _clients[loop].with_options(base_url=base_url)


async def converse(client: AsyncOpenAI, question: str, tools: list[dict] | None) -> tuple[str, list[dict]]:
    """The conversation: the final answer's text ("" when the turns ran out on a tool call)
    and the messages sent, for whoever wants to read them."""
    system = SYSTEM if tools else SYSTEM_WITHOUT_TOOL
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        kwargs = {"tools": tools} if tools else {}
        reply = await client.chat.completions.create(model="policy", messages=messages, **kwargs)
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or "", messages
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return "", messages


async def run(task, base_url: str) -> float:
    answer, _ = await converse(sdk_client(base_url), task.prompt, TOOLS)
    return score(task, answer)


async def run_without_tool(task, base_url: str) -> float:
    """The same question with no tool offered: the policy's arithmetic in its head."""
    answer, _ = await converse(sdk_client(base_url), task.prompt, None)
    return score(task, answer)


def main(argv: list[str] | None = None) -> None:
    """Ask one question of a served model by hand and print the conversation:
    ``asyncrl serve examples/calculator_agent/eval.yaml model.path=runs/calculator-sft gateway.port=8000``
    then ``python examples/calculator_agent/agent.py "What is 347 * 89 - 1206?"``."""
    import argparse

    parser = argparse.ArgumentParser(description="ask the calculator agent one question")
    parser.add_argument("question")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--no-tool", action="store_true", help="offer no tool")
    args = parser.parse_args(argv)

    async def ask() -> tuple[str, list[dict]]:
        return await converse(sdk_client(args.base_url), args.question, None if args.no_tool else TOOLS)

    answer, messages = asyncio.run(ask())
    for message in messages[1:]:
        print(json.dumps(message))
    print(json.dumps({"final answer": answer}))


if __name__ == "__main__":
    main()
