"""Countdown: combine the given numbers with + - * / to hit the target.

Tasks are generated locally from a seed, so runs are reproducible offline. Each target
comes from an expression built over the numbers, so every task is solvable, and
``solve_countdown`` recovers one solution in a canonical form (the supervised warm-up's
targets).

Grammar accepted by the reward: non-negative integer literals, binary ``+ - * /``,
parentheses and spaces. Unary plus/minus is rejected (scores 0.0): the numbers are
non-negative, and allowing ``-`` as a prefix would let ``--3`` or ``-(a-b)`` sneak in
extra operations that the task does not offer.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from fractions import Fraction
from itertools import islice, permutations

from asyncrl.tasks.base import Task

FORMAT_REWARD = 0.1
MAX_RESPONSE_CHARS = 200
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/() ]+")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_MAX_RESAMPLES = 10_000
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3  # precedence of a literal: never needs parentheses


def apply_op(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b  # raises ZeroDivisionError, which callers treat as "no value"


def _random_value(nums: list[int], ops: str, rng: random.Random) -> Fraction:
    """Value of a random binary expression tree whose leaves are ``nums`` in order."""
    if len(nums) == 1:
        return Fraction(nums[0])
    k = rng.randint(1, len(nums) - 1)
    left = _random_value(nums[:k], ops, rng)
    right = _random_value(nums[k:], ops, rng)
    return apply_op(rng.choice(ops), left, right)


def iter_countdown(
    seed: int, *, num_numbers: int = 3, low: int = 1, high: int = 9, ops: str = "+-*"
) -> Iterator[Task]:
    """Endless deterministic stream; ``generate_countdown`` takes a prefix, so callers
    that must skip duplicates can keep drawing from the same seed."""
    if num_numbers < 1:
        raise ValueError(f"countdown: num_numbers must be >= 1, got {num_numbers}")
    if not 0 <= low <= high:
        raise ValueError(f"countdown: need 0 <= low <= high, got low={low}, high={high}")
    if not ops or set(ops) - set("+-*/"):
        raise ValueError(f"countdown: ops must be a non-empty subset of '+-*/', got {ops!r}")
    rng = random.Random(seed)
    i = 0
    while True:
        for _ in range(_MAX_RESAMPLES):
            numbers = [rng.randint(low, high) for _ in range(num_numbers)]
            order = numbers[:]
            rng.shuffle(order)  # so the prompt order does not reveal the expression
            try:
                value = _random_value(order, ops, rng)
            except ZeroDivisionError:
                continue
            if value >= 0 and value.denominator == 1:
                break
        else:
            raise ValueError(
                f"countdown: no non-negative integer target found after {_MAX_RESAMPLES} "
                f"tries (num_numbers={num_numbers}, low={low}, high={high}, ops={ops!r})"
            )
        target = int(value)
        yield Task(
            id=f"countdown-{seed}-{i}",
            prompt=f"{' '.join(map(str, numbers))} -> {target}",
            data={"numbers": numbers, "target": target},
        )
        i += 1


def generate_countdown(
    num_tasks: int,
    seed: int,
    *,
    num_numbers: int = 3,
    low: int = 1,
    high: int = 9,
    ops: str = "+-*",
) -> list[Task]:
    """``num_tasks`` solvable Countdown problems, identical for identical arguments."""
    if num_tasks < 0:
        raise ValueError(f"num_tasks must be >= 0, got {num_tasks}")
    stream = iter_countdown(seed, num_numbers=num_numbers, low=low, high=high, ops=ops)
    return list(islice(stream, num_tasks))


def _evaluate(node: ast.AST, leaves: list[int]) -> Fraction | None:
    """Exact value of an allowed AST (None on division by zero); appends literals to
    ``leaves``. Raises ValueError on any node outside the grammar."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        leaves.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _evaluate(node.left, leaves)
        right = _evaluate(node.right, leaves)
        if left is None or right is None:
            return None
        try:
            return apply_op(_OPS[type(node.op)], left, right)
        except ZeroDivisionError:
            return None
    raise ValueError(f"disallowed syntax: {type(node).__name__}")


def parse_expression(text: str) -> tuple[Fraction | None, list[int]] | None:
    """``(value, literals)`` for a well-formed expression, None for anything else.

    A character whitelist runs before ``ast.parse`` so names, attributes, calls,
    underscores and hex literals never reach the parser; ``eval`` is never used.
    """
    text = text.strip()
    if not text or len(text) > MAX_RESPONSE_CHARS or not _ALLOWED_CHARS.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval")
        leaves: list[int] = []
        value = _evaluate(tree.body, leaves)
    except (SyntaxError, ValueError, RecursionError):
        return None
    return value, leaves


def countdown_reward(task: Task, response: str) -> float:
    """1.0 for a correct solution, ``FORMAT_REWARD`` for a well-formed but wrong one
    (wrong numbers, wrong value, or division by zero), 0.0 for anything else. The
    small format bonus gives a tiny model a gradient toward emitting expressions."""
    parsed = parse_expression(response)
    if parsed is None:
        return 0.0
    value, leaves = parsed
    uses_numbers = Counter(leaves) == Counter(int(n) for n in task.data["numbers"])
    if uses_numbers and value is not None and value == int(task.data["target"]):
        return 1.0
    return FORMAT_REWARD


# ----------------------------------------------------------------------------- solver


def _expressions(nums: Sequence[int], ops: str) -> Iterator[tuple[str, int, Fraction | None, int]]:
    """Every ``(text, precedence, value, num_parens)`` tree over ``nums`` in this order.

    Left-heavy splits come first, so "a+b+c" is produced as ((a+b)+c); the text carries
    only the parentheses precedence requires, which keeps answers short. ``value`` is
    None where a division by zero occurs anywhere in the tree.
    """
    if len(nums) == 1:
        yield str(nums[0]), _ATOM, Fraction(nums[0]), 0
        return
    for k in range(len(nums) - 1, 0, -1):  # k = size of the left subtree, biggest first
        for lt, lp, lv, lc in _expressions(nums[:k], ops):
            for rt, rp, rv, rc in _expressions(nums[k:], ops):
                for op in ops:
                    prec = _PRECEDENCE[op]
                    value = None
                    if lv is not None and rv is not None:
                        try:
                            value = apply_op(op, lv, rv)
                        except ZeroDivisionError:  # the tree divides by zero: its value stays None
                            pass
                    left_paren = lp < prec
                    # a-(b+c), a-(b-c), a/(b*c) change meaning without parentheses.
                    right_paren = rp < prec or (rp == prec and op in "-/")
                    text = (f"({lt})" if left_paren else lt) + op + (f"({rt})" if right_paren else rt)
                    yield text, prec, value, lc + rc + left_paren + right_paren


def solve_countdown(task: Task, ops: str = "+-*") -> str:
    """A correct expression for a Countdown ``task``, in one canonical simple form.

    The generator does not keep the expression behind a target, and one consistent answer
    style is far easier for a tiny model to learn than whichever random tree made it, so
    this brute-forces (3 numbers: 6 orders x 2 shapes x 9 op pairs) and keeps the first by:
    fewest parentheses, then the prompt's own number order, then left-heavy shape, then
    ``ops`` order. Division is tried only when ``ops`` alone cannot reach the target.
    A task whose data records an ``expression`` is answered with it.
    """
    if "expression" in task.data:
        return str(task.data["expression"])
    numbers = [int(n) for n in task.data["numbers"]]
    target = Fraction(int(task.data["target"]))
    for op_set in (ops, "+-*/"):
        best: tuple[int, str] | None = None
        for order in dict.fromkeys(permutations(numbers)):  # repeated numbers repeat orders
            for text, _, value, parens in _expressions(order, op_set):
                if value == target and (best is None or parens < best[0]):
                    best = (parens, text)
        if best is not None:
            return best[1]
    raise ValueError(f"countdown task {task.id!r} ({task.prompt}) has no solution")
