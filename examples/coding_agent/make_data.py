"""Writes the coding agent's tasks and its supervised warm-up traces, deterministic by seed.

    python examples/coding_agent/make_data.py [--out-dir DIR] [--seed 0] [--traces 160] ...

- ``train.jsonl`` / ``heldout.jsonl``: tasks for asyncrl's JSONL loader: ``{"id", "prompt",
  "function", "solution", "tests"}``, the prompt a request such as "Write a Python function
  `add_7(x)` that returns x plus 7.", ``tests`` a program of asserts that imports the
  function from ``solution`` (what :func:`asyncrl.tools.sandbox.passes_tests` runs). The
  held-out tasks ask for functions of families no training task or trace asks for (``min``
  of a list, ``x % k``, …), so the held-out score is of functions never seen.
- ``sft.jsonl``: chat-format conversations ``{"messages": [...], "tools": [...]}`` of the
  agent in ``agent.py`` (its system prompt, its ``run_python`` tool, assistant
  ``tool_calls``, ``tool`` outputs), for ``asyncrl sft``. The agent speaks the Responses
  API; the gateway turns its requests into this same chat form before rendering, so the
  traces train the text the gateway parses.

The traces are noisy on purpose, each one of:

- ``clean``: the function written straight away;
- ``tested``: a ``run_python`` call printing the function on an example, its output, then the function;
- ``wrong``: the function written with a slip (another constant, another operation), so it fails its tests.

The noise shares are the flags' (``--tested --wrong``); each trace draws its kind.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def _sibling(name: str):
    """This example's own ``name.py``, by path: another example's ``agent`` module may be loaded
    already under the plain name (the calculator's, in one test process), and must not be used."""
    import importlib.util

    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"coding_agent_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_agent = _sibling("agent")
SYSTEM, TOOLS = _agent.SYSTEM, _agent.TOOLS  # the agent's own prompt and tools

KINDS = ("clean", "tested", "wrong")
REQUESTS = ("Write a Python function `{sig}` that {does}.", "Define `{sig}` in Python: it {does}.")


@dataclass(frozen=True)
class Family:
    """A kind of one-line function; ``k`` (where the family has one) is its constant."""

    name: str  # may hold {k}
    arg: str
    does: str  # what it returns, in words, may hold {k}
    body: str  # the expression returned, may hold {k}
    inputs: Callable[[random.Random], object]
    wrong: str  # a plausible slip: the body of a function that fails the tests
    has_k: bool = False

    def fill(self, text: str, k: int | None) -> str:
        return text.format(k=k) if self.has_k else text


def _int(r: random.Random) -> int:
    return r.randint(-20, 50)


def _ints(r: random.Random) -> list[int]:
    return [r.randint(-9, 30) for _ in range(r.randint(2, 5))]


def _word(r: random.Random) -> str:
    return "".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(3, 7)))


TRAIN_FAMILIES = (
    Family("add_{k}", "x", "returns x plus {k}", "x + {k}", _int, "x - {k}", has_k=True),
    Family("times_{k}", "x", "returns x times {k}", "x * {k}", _int, "x + {k}", has_k=True),
    Family("minus_{k}", "x", "returns x minus {k}", "x - {k}", _int, "{k} - x", has_k=True),
    Family("double", "x", "returns twice x", "2 * x", _int, "x * x"),
    Family("square", "x", "returns x squared", "x * x", _int, "2 * x"),
    Family("reverse", "s", "returns the string s reversed", "s[::-1]", _word, "s"),
    Family("largest", "xs", "returns the largest number in the list xs", "max(xs)", _ints, "min(xs)"),
    Family("first", "xs", "returns the first item of the list xs", "xs[0]", _ints, "xs[-1]"),
    Family("count", "xs", "returns the number of items in the list xs", "len(xs)", _ints, "sum(xs)"),
    Family("is_even", "x", "returns True when x is even, else False", "x % 2 == 0", _int, "x % 2 == 1"),
    Family("shout", "s", "returns the string s in upper case", "s.upper()", _word, "s.lower()"),
)
HELDOUT_FAMILIES = (
    Family("mod_{k}", "x", "returns the remainder of x divided by {k}", "x % {k}", _int, "x // {k}", has_k=True),
    Family("above_{k}", "x", "returns True when x is greater than {k}, else False", "x > {k}", _int, "x < {k}",
           has_k=True),
    Family("smallest", "xs", "returns the smallest number in the list xs", "min(xs)", _ints, "max(xs)"),
    Family("total", "xs", "returns the sum of the numbers in the list xs", "sum(xs)", _ints, "len(xs)"),
    Family("last", "xs", "returns the last item of the list xs", "xs[-1]", _ints, "xs[0]"),
    Family("negate", "x", "returns minus x", "-x", _int, "x"),
    Family("cube", "x", "returns x cubed", "x * x * x", _int, "3 * x"),
    Family("whisper", "s", "returns the string s in lower case", "s.lower()", lambda r: _word(r).upper(), "s.upper()"),
)
K_RANGE = range(2, 40)  # a family with a constant gives one task per k
NUM_TESTS = 4


def solution(family: Family, k: int | None, body: str | None = None) -> str:
    """The function's source, one line of body."""
    return f"def {family.fill(family.name, k)}({family.arg}):\n    return {family.fill(body or family.body, k)}\n"


def _value(source: str, name: str, argument: object) -> object:
    """What our own reference function (never model-written code) returns for ``argument``."""
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 (the generator's own one-liners)
    return namespace[name](argument)


def task(family: Family, k: int | None, r: random.Random, task_id: str) -> dict:
    """One task: the request, the reference solution, and its tests (distinct inputs, values by the reference)."""
    name, source = family.fill(family.name, k), solution(family, k)
    wrong_source = solution(family, k, family.wrong)
    inputs: list = []
    while len(inputs) < NUM_TESTS or all(_value(wrong_source, name, a) == _value(source, name, a) for a in inputs):
        argument = family.inputs(r)
        if argument not in inputs:  # the slip must fail somewhere, so a wrong trace scores 0
            inputs.append(argument)
    tests = f"from solution import {name}\n" + "".join(
        f"assert {name}({a!r}) == {_value(source, name, a)!r}\n" for a in inputs)
    request = r.choice(REQUESTS).format(sig=f"{name}({family.arg})", does=family.fill(family.does, k))
    return {"id": task_id, "prompt": request, "function": name, "solution": source, "tests": tests}


def make_tasks(families: tuple[Family, ...], r: random.Random, prefix: str) -> list[dict]:
    """Every function of ``families`` once (one per k for a family with a constant), shuffled."""
    specs = [(f, k) for f in families for k in (K_RANGE if f.has_k else [None])]
    r.shuffle(specs)
    return [task(f, k, r, f"{prefix}-{i:04d}") for i, (f, k) in enumerate(specs)]


def trace(task: dict, family: Family, k: int | None, kind: str, r: random.Random) -> dict:
    """One conversation of ``kind`` for ``task``, in the agent's own words."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    answer = solution(family, k, family.wrong) if kind == "wrong" else task["solution"]
    if kind == "tested":
        argument = family.inputs(r)
        program = f"{answer}print({task['function']}({argument!r}))\n"
        output = str(_value(answer, task["function"], argument))
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_0", "type": "function",
                "function": {"name": "run_python", "arguments": json.dumps({"code": program})}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": output},
        ]
    messages.append({"role": "assistant", "content": answer.rstrip("\n")})
    return {"messages": messages, "tools": TOOLS}


def make_all(seed: int, num_traces: int, shares: dict[str, float]) -> tuple[list[dict], list[dict], list[dict]]:
    """(train tasks, held-out tasks, traces). Separate streams per split, each seeded from
    ``seed`` and its name. The traces ask for training families only (new inputs and wording)."""
    if min(shares.values()) < 0 or sum(shares.values()) > 1:
        raise ValueError(f"noise shares must be >= 0 and sum to at most 1, got {shares}")
    heldout = make_tasks(HELDOUT_FAMILIES, random.Random(f"{seed}-heldout"), "heldout")
    train = make_tasks(TRAIN_FAMILIES, random.Random(f"{seed}-train"), "train")
    r = random.Random(f"{seed}-sft")
    weights = [1 - sum(shares.values()), shares["tested"], shares["wrong"]]
    traces = []
    for i in range(num_traces):
        family = r.choice(TRAIN_FAMILIES)
        k = r.choice(K_RANGE) if family.has_k else None
        traces.append(trace(task(family, k, r, f"sft-{i:04d}"), family, k, r.choices(KINDS, weights)[0], r))
    return train, heldout, traces


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traces", type=int, default=160, help="warm-up conversations")
    parser.add_argument("--tested", type=float, default=0.3, help="share of traces that run the code first")
    parser.add_argument("--wrong", type=float, default=0.2, help="share of traces whose function is wrong")
    args = parser.parse_args(argv)
    train, heldout, traces = make_all(args.seed, args.traces, {"tested": args.tested, "wrong": args.wrong})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "heldout.jsonl", heldout)
    write_jsonl(args.out_dir / "sft.jsonl", traces)
    print(f"wrote {args.out_dir}: {len(train)} train tasks, {len(heldout)} held out, {len(traces)} traces")


if __name__ == "__main__":
    main()
