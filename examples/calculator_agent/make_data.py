"""Writes the calculator agent's tasks and its supervised warm-up traces, deterministic by seed.

    python examples/calculator_agent/make_data.py [--out-dir DIR] [--seed 0] [--traces 160] ...

- ``train.jsonl`` / ``heldout.jsonl``: tasks for asyncrl's JSONL loader (``task.path`` /
  ``task.validation_path``): ``{"id", "prompt", "expression", "answer"}``, the prompt a
  question such as "What is 347 * 89 - 1206?". No held-out expression appears in the
  training tasks or in the traces.
- ``sft.jsonl``: OpenAI-format conversations ``{"messages": [...], "tools": [...]}`` of the
  agent in ``agent.py`` (its system prompt, its tool list, assistant ``tool_calls``,
  ``tool`` results from its own calculator), for ``asyncrl sft``.

The traces are noisy on purpose, so that the warm-up imitates an agent that usually, not
always, gets it right, and RL has something to fix. Each trace is one of:

- ``clean``: the call with the question's expression, then the result copied;
- ``skip``: no tool call, a guess (the answer with a digit or two wrong);
- ``slip``: the call with one operand's digit mistyped, then that wrong result copied;
- ``miscopy``: the right call, then its result copied with a digit changed, dropped or two swapped.

The noise shares are the flags' (``--skip --slip --miscopy``); each trace draws its kind.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import SYSTEM, TOOLS, calculate  # noqa: E402 (the agent's own prompt, tools and calculator)

QUESTIONS = ("What is {}?", "Compute {}.", "Calculate {}.")
KINDS = ("clean", "skip", "slip", "miscopy")


def _mul(r: random.Random) -> str:
    return f"{r.randint(100, 999)} * {r.randint(12, 99)}"


def _mul_add(r: random.Random) -> str:
    return f"{r.randint(100, 999)} * {r.randint(12, 99)} + {r.randint(100, 9999)}"


def _mul_sub(r: random.Random) -> str:
    a, b = r.randint(100, 999), r.randint(12, 99)
    return f"{a} * {b} - {r.randint(100, min(9999, a * b - 1))}"


def _sum_mul(r: random.Random) -> str:
    return f"({r.randint(10, 999)} + {r.randint(10, 999)}) * {r.randint(12, 99)}"


def _two_products(r: random.Random) -> str:
    return f"{r.randint(12, 99)} * {r.randint(12, 99)} + {r.randint(12, 99)} * {r.randint(12, 99)}"


FAMILIES: tuple[Callable[[random.Random], str], ...] = (_mul, _mul_add, _mul_sub, _sum_mul, _two_products)


def value(expression: str) -> int:
    """The expression's value by the agent's own calculator (every family is integer-valued)."""
    return int(calculate(expression))


def make_tasks(r: random.Random, n: int, prefix: str, exclude: set[str]) -> list[dict]:
    """``n`` tasks with expressions not in ``exclude`` (which gains them)."""
    tasks = []
    while len(tasks) < n:
        expression = r.choice(FAMILIES)(r)
        if expression in exclude:
            continue
        exclude.add(expression)
        tasks.append({"id": f"{prefix}-{len(tasks):04d}", "prompt": r.choice(QUESTIONS).format(expression),
                      "expression": expression, "answer": value(expression)})
    return tasks


def perturb(digits: str, r: random.Random) -> str:
    """``digits`` with one digit changed, one dropped, or two adjacent different ones swapped;
    never the same string, never a leading zero."""
    while True:
        kind, i = r.choice(("change", "drop", "swap")), r.randrange(len(digits))
        if kind == "change":
            out = digits[:i] + r.choice([d for d in "0123456789" if d != digits[i]]) + digits[i + 1:]
        elif kind == "drop" and len(digits) > 2:
            out = digits[:i] + digits[i + 1:]
        elif kind == "swap" and i + 1 < len(digits) and digits[i] != digits[i + 1]:
            out = digits[:i] + digits[i + 1] + digits[i] + digits[i + 2:]
        else:
            continue
        if out != digits and not out.startswith("0"):
            return out


def slip(expression: str, r: random.Random) -> str:
    """``expression`` with one digit of one operand mistyped, so that its value changes."""
    operands = list(re.finditer(r"\d+", expression))
    while True:
        m = r.choice(operands)
        i = r.randrange(len(m.group()))
        digit = r.choice([d for d in "0123456789" if d != m.group()[i] and not (i == 0 and d == "0")])
        typed = expression[:m.start() + i] + digit + expression[m.start() + i + 1:]
        if value(typed) != value(expression) and value(typed) > 0:
            return typed


def trace(task: dict, kind: str, r: random.Random) -> dict:
    """One conversation of ``kind`` for ``task``, in the agent's own words."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    answer = str(task["answer"])
    if kind == "skip":
        guess = perturb(perturb(answer, r), r) if r.random() < 0.5 else perturb(answer, r)
        messages.append({"role": "assistant", "content": guess if guess != answer else perturb(answer, r)})
        return {"messages": messages, "tools": TOOLS}
    expression = slip(task["expression"], r) if kind == "slip" else task["expression"]
    result = calculate(expression)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"expression": expression})}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": perturb(result, r) if kind == "miscopy" else result},
    ]
    return {"messages": messages, "tools": TOOLS}


def kind_of(example: dict, task: dict) -> str:
    """Which kind a trace is, read from its messages alone (the tests check the shares with it)."""
    messages = example["messages"]
    if len(messages) == 3:
        return "skip"
    called = json.loads(messages[2]["tool_calls"][0]["function"]["arguments"])["expression"]
    if called != task["expression"]:
        return "slip"
    return "clean" if messages[-1]["content"] == str(task["answer"]) else "miscopy"


def make_all(seed: int, num_train: int, num_heldout: int, num_traces: int,
             shares: dict[str, float]) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """(train tasks, held-out tasks, trace tasks, traces). Separate streams per split, each
    seeded from ``seed`` and its name, so growing one split leaves the others as they were."""
    if min(shares.values()) < 0 or sum(shares.values()) > 1:
        raise ValueError(f"noise shares must be >= 0 and sum to at most 1, got {shares}")
    seen: set[str] = set()
    heldout = make_tasks(random.Random(f"{seed}-heldout"), num_heldout, "heldout", seen)
    train = make_tasks(random.Random(f"{seed}-train"), num_train, "train", seen)
    r = random.Random(f"{seed}-sft")
    trace_tasks = make_tasks(r, num_traces, "sft", seen)
    weights = [1 - sum(shares.values()), shares["skip"], shares["slip"], shares["miscopy"]]
    traces = [trace(task, r.choices(KINDS, weights)[0], r) for task in trace_tasks]
    return train, heldout, trace_tasks, traces


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=2000, help="training tasks for RL")
    parser.add_argument("--heldout", type=int, default=128, help="held-out tasks (evaluation)")
    parser.add_argument("--traces", type=int, default=160, help="warm-up conversations")
    parser.add_argument("--skip", type=float, default=0.15, help="share of traces that answer without the tool")
    parser.add_argument("--slip", type=float, default=0.15, help="share that mistype a digit in the call")
    parser.add_argument("--miscopy", type=float, default=0.2, help="share that copy the result wrong")
    args = parser.parse_args(argv)
    shares = {"skip": args.skip, "slip": args.slip, "miscopy": args.miscopy}
    train, heldout, trace_tasks, traces = make_all(args.seed, args.train, args.heldout, args.traces, shares)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "heldout.jsonl", heldout)
    write_jsonl(args.out_dir / "sft.jsonl", traces)
    counts = {k: sum(kind_of(t, task) == k for t, task in zip(traces, trace_tasks)) for k in KINDS}
    print(f"wrote {args.out_dir}: {len(train)} train tasks, {len(heldout)} held out, {len(traces)} traces "
          f"({', '.join(f'{k} {v}' for k, v in counts.items())})")


if __name__ == "__main__":
    main()
