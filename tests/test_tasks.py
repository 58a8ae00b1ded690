"""Tests for the built-in tasks, the JSONL loader and the task/reward registry."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest

from asyncrl.tasks import (
    Task,
    TaskDataError,
    arithmetic_reward,
    countdown_reward,
    default_reward_fn,
    generate_arithmetic,
    generate_countdown,
    is_validation_prompt,
    load_jsonl_tasks,
    load_tasks,
    resolve_reward_fn,
)
from asyncrl.tasks.countdown import FORMAT_REWARD, solve_countdown


def cd(numbers: list[int], target: int) -> Task:
    return Task(id="t", prompt=f"{' '.join(map(str, numbers))} -> {target}",
                data={"numbers": numbers, "target": target})


def reachable_values(nums: tuple[int, ...], ops: str = "+-*/") -> set[Fraction]:
    """Every value of every expression using each number once, any order/bracketing."""
    out: set[Fraction] = set()

    def rec(seq: tuple[Fraction, ...]) -> set[Fraction]:
        if len(seq) == 1:
            return {seq[0]}
        vals: set[Fraction] = set()
        for k in range(1, len(seq)):
            for a in rec(seq[:k]):
                for b in rec(seq[k:]):
                    vals |= {{"+": a + b, "-": a - b, "*": a * b}[op] for op in ops if op != "/"}
                    if "/" in ops and b != 0:
                        vals.add(a / b)
        return vals

    for perm in itertools.permutations(Fraction(n) for n in nums):
        out |= rec(perm)
    return out


# ---- countdown reward -------------------------------------------------------------

T22 = cd([3, 5, 7], 22)


@pytest.mark.parametrize("response", ["3*5+7", "7+3*5", "(3*5)+7", "  3 * 5 + 7 \n", "7+(5*3)"])
def test_countdown_correct(response):
    assert countdown_reward(T22, response) == 1.0


def test_countdown_parentheses_and_division():
    assert countdown_reward(cd([3, 5, 7], 6), "(7-5)*3") == 1.0
    assert countdown_reward(cd([3, 5, 7], 6), "7-5*3") == FORMAT_REWARD  # value -8
    assert countdown_reward(cd([2, 4, 6], 5), "(4+6)/2") == 1.0
    # exact rational arithmetic: 7/2*2 is exactly 7, not a float approximation
    assert countdown_reward(cd([7, 2, 2], 7), "7/2*2") == 1.0
    assert countdown_reward(cd([7, 2, 3], 3), "7/2+3") == FORMAT_REWARD  # 6.5 != 3


@pytest.mark.parametrize("response", [
    "3*5+7+3",    # reuses a number
    "3*5+5+2",    # reuses a number and uses one not given
    "3*5",        # omits 7
    "3*5+8-1",    # numbers not given
    "15+7",       # right value, wrong numbers
    "22",
])
def test_countdown_wrong_numbers_get_format_reward(response):
    assert countdown_reward(T22, response) == FORMAT_REWARD


def test_countdown_wrong_value_gets_format_reward():
    assert countdown_reward(T22, "3+5+7") == FORMAT_REWARD
    assert countdown_reward(T22, "3*(5+7)") == FORMAT_REWARD


def test_countdown_division_by_zero_is_not_correct():
    task = cd([3, 3, 5], 5)
    assert countdown_reward(task, "5+3/(3-3)") == FORMAT_REWARD
    assert countdown_reward(cd([0, 4, 4], 0), "4/0*4") != 1.0


@pytest.mark.parametrize("response", [
    "hello", "", "   ", "3*", "((3+5", "3+5)*7", "__import__('os')", "3**5+7",
    "3//5+7", "--3*5+7", "-3+5*7", "+3*5+7", "3.0*5+7", "3*5+7 x", "0x3*5+7",
    "1_5+7", "3*5;7", "3 5 7", "abs(3)*5+7", "(3*5)+7\n(3*5)+7",
    "(" * 150 + "3" + ")" * 150,  # too long
])
def test_countdown_garbage_is_zero(response):
    assert countdown_reward(T22, response) == 0.0


def test_countdown_long_input_rejected_even_if_correct():
    padded = "(" * 99 + "3*5+7" + ")" * 99
    assert len(padded) > 200
    assert countdown_reward(T22, padded) == 0.0
    assert countdown_reward(T22, "(" * 50 + "3*5+7" + ")" * 50) == 1.0


# ---- countdown generator ----------------------------------------------------------

def test_countdown_generator_is_deterministic():
    a = generate_countdown(50, seed=7)
    assert a == generate_countdown(50, seed=7)
    assert [t.prompt for t in a] != [t.prompt for t in generate_countdown(50, seed=8)]
    assert a[:10] == generate_countdown(10, seed=7)  # prefix-stable
    assert [t.id for t in a[:3]] == ["countdown-7-0", "countdown-7-1", "countdown-7-2"]
    assert len({t.id for t in a}) == 50


def test_countdown_prompt_format_and_targets():
    for t in generate_countdown(200, seed=1):
        nums, target = t.data["numbers"], t.data["target"]
        assert set(t.data) == {"numbers", "target"}
        assert len(nums) == 3 and all(type(n) is int and 1 <= n <= 9 for n in nums)
        assert type(target) is int and target >= 0
        assert t.prompt == f"{' '.join(map(str, nums))} -> {target}"


@pytest.mark.parametrize("kwargs", [{}, {"ops": "+-*/"}, {"num_numbers": 4, "low": 1, "high": 6},
                                    {"num_numbers": 2, "ops": "-"}])
def test_every_generated_countdown_task_is_solvable(kwargs):
    ops = kwargs.get("ops", "+-*")
    for t in generate_countdown(60, seed=3, **kwargs):
        assert Fraction(t.data["target"]) in reachable_values(tuple(t.data["numbers"]), ops), t


def test_countdown_generator_rejects_bad_args():
    with pytest.raises(ValueError):
        generate_countdown(3, seed=0, ops="+^")
    with pytest.raises(ValueError):
        generate_countdown(3, seed=0, low=5, high=1)
    with pytest.raises(ValueError):
        generate_countdown(3, seed=0, low=0, high=0, ops="/")  # no valid target exists


# ---- countdown solver -------------------------------------------------------------

@pytest.mark.parametrize("num_tasks, kwargs", [(600, {}), (600, {"ops": "+-*/"}), (100, {"num_numbers": 4, "high": 6}),
                                               (600, {"num_numbers": 2, "ops": "-"}), (600, {"low": 0, "high": 3})])
def test_solve_countdown_reaches_the_target(num_tasks, kwargs):
    for t in generate_countdown(num_tasks, seed=11, **kwargs):
        assert countdown_reward(t, solve_countdown(t)) == 1.0, t.prompt


def test_solve_countdown_prefers_simple_canonical_form():
    assert solve_countdown(cd([2, 3, 4], 9)) == "2+3+4"  # prompt order, left to right, no parentheses
    assert solve_countdown(cd([2, 3, 4], 20)) == "(2+3)*4"  # parentheses only where precedence needs them
    assert solve_countdown(cd([4, 3, 2], 20)) == "4*(3+2)"  # fewest parentheses first, then prompt order
    assert solve_countdown(cd([7, 2, 3], 2)) == "7-2-3"  # left-heavy: no 7-(2+3)


def test_solve_countdown_divides_only_when_needed():
    assert solve_countdown(cd([6, 3, 2], 9)) == "6*2-3"  # 6/2*3 also works, but needs "/"
    assert solve_countdown(cd([8, 4, 2], 4)) == "8/4+2"  # no +-* tree over 8 4 2 makes 4
    assert solve_countdown(cd([8, 4, 2], 4), ops="+-*/") == "8/4+2"


def test_solve_countdown_unsolvable_raises_and_recorded_expression_wins():
    with pytest.raises(ValueError, match="no solution"):
        solve_countdown(cd([1, 1, 1], 100))
    t = Task(id="t", prompt="1 2 -> 3", data={"numbers": [1, 2], "target": 3, "expression": "2+1"})
    assert solve_countdown(t) == "2+1"


# ---- arithmetic -------------------------------------------------------------------

def test_arithmetic_task_and_reward():
    tasks = generate_arithmetic(30, seed=0)
    assert tasks == generate_arithmetic(30, seed=0)
    for t in tasks:
        a, b = (int(x) for x in t.prompt.rstrip("=").split("+"))
        assert t.data == {"answer": a + b} and 0 <= a <= 9 and 0 <= b <= 9
    task = Task(id="a", prompt="3+4=", data={"answer": 7})
    assert arithmetic_reward(task, "7") == 1.0
    assert arithmetic_reward(task, " 7\n") == 1.0
    for bad in ["8", "", "seven", "7.0", "3+4", "7 7", "\uff17", "+-7"]:
        assert arithmetic_reward(task, bad) == 0.0


# ---- jsonl ------------------------------------------------------------------------

def write(tmp_path, lines, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_jsonl_loads_tasks(tmp_path):
    p = write(tmp_path, ['{"prompt": "a", "answer": 1}', "", '{"id": 9, "prompt": "b", "x": [1]}',
                         '{"id": "k", "prompt": "c\u2028d"}'])
    tasks = load_jsonl_tasks(p)
    assert tasks[0] == Task(id="data-1", prompt="a", data={"answer": 1})
    assert tasks[1] == Task(id="9", prompt="b", data={"x": [1]})
    assert tasks[2].prompt == "c\u2028d" and tasks[2].data == {}


@pytest.mark.parametrize("bad_line, fragment", [
    ('{"prompt": "a"', "invalid JSON"),
    ('[1, 2]', "JSON object"),
    ('{"question": "a"}', "prompt"),
    ('{"prompt": 5}', "string"),
    ('{"prompt": ""}', "empty"),
    ('{"prompt": "b", "id": "x"}', "duplicate id"),
    ('{"prompt": "b", "id": [1]}', "id"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, fragment):
    p = write(tmp_path, ['{"prompt": "ok", "id": "x"}', "", bad_line])
    with pytest.raises(TaskDataError) as info:
        load_jsonl_tasks(p)
    msg = str(info.value)
    assert str(p) in msg and "line 3" in msg and fragment in msg
    assert isinstance(info.value, ValueError)


def test_jsonl_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TaskDataError, match="nope.jsonl"):
        load_jsonl_tasks(missing)


def test_load_tasks_jsonl_splits(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": f"p{i}"}) for i in range(10)])
    splits = load_tasks("jsonl", path=str(p), seed=0, num_train=0, num_validation=3)
    assert [t.prompt for t in splits.train] == [f"p{i}" for i in range(7)]
    assert [t.prompt for t in splits.validation] == ["p7", "p8", "p9"]
    capped = load_tasks("jsonl", path=p, seed=0, num_train=2, num_validation=3)
    assert [t.prompt for t in capped.train] == ["p0", "p1"]
    v = write(tmp_path, ['{"prompt": "v"}'], name="val.jsonl")
    own = load_tasks("jsonl", path=p, validation_path=v, seed=0, num_train=0, num_validation=3)
    assert len(own.train) == 10 and [t.prompt for t in own.validation] == ["v"]
    with pytest.raises(TaskDataError):
        load_tasks("jsonl", path=p, seed=0, num_train=0, num_validation=10)
    with pytest.raises(ValueError, match="path"):
        load_tasks("jsonl", seed=0, num_train=1, num_validation=1)


# ---- registry ---------------------------------------------------------------------

@pytest.mark.parametrize("name, num_validation", [("countdown", 20), ("arithmetic", 8)])
def test_generated_splits_are_disjoint_and_deterministic(name, num_validation):
    splits = load_tasks(name, seed=5, num_train=60, num_validation=num_validation)
    assert len(splits.train) == 60 and len(splits.validation) == num_validation
    train_prompts = {t.prompt for t in splits.train}
    val_prompts = [t.prompt for t in splits.validation]
    assert not train_prompts & set(val_prompts)
    assert len(set(val_prompts)) == len(val_prompts)
    assert not {t.id for t in splits.train} & {t.id for t in splits.validation}
    assert splits == load_tasks(name, seed=5, num_train=60, num_validation=num_validation)
    # train is the seeded stream minus the validation-only eighth of the prompt space
    stream = (generate_countdown if name == "countdown" else generate_arithmetic)(600, 5)
    assert splits.train == [t for t in stream if not is_validation_prompt(t.prompt)][:60]
    assert all(is_validation_prompt(p) for p in val_prompts)


def test_load_tasks_errors():
    with pytest.raises(ValueError, match="countdown.*arithmetic.*jsonl"):
        load_tasks("sudoku", seed=0, num_train=1, num_validation=1)
    with pytest.raises(ValueError, match="too small"):  # 100 a+b prompts, about 1/8 for validation
        load_tasks("arithmetic", seed=0, num_train=20, num_validation=50)
    with pytest.raises(ValueError, match="options"):
        load_tasks("countdown", seed=0, num_train=1, num_validation=1, options={"nums": 4})
    four = load_tasks("countdown", seed=0, num_train=3, num_validation=1, options={"num_numbers": 4})
    assert all(len(t.data["numbers"]) == 4 for t in four.train)


def test_reward_fn_resolution():
    assert resolve_reward_fn("asyncrl.tasks.countdown:countdown_reward") is countdown_reward
    assert resolve_reward_fn("asyncrl.tasks.arithmetic:arithmetic_reward") is arithmetic_reward
    assert resolve_reward_fn("asyncrl.tasks:default_reward_fn") is default_reward_fn
    assert default_reward_fn("countdown") is countdown_reward
    assert default_reward_fn("arithmetic") is arithmetic_reward
    with pytest.raises(ValueError, match="reward"):
        default_reward_fn("jsonl")
    for bad in ["no_colon", ":fn", "mod:", "asyncrl.tasks.nope:fn",
                "asyncrl.tasks.countdown:missing", "asyncrl.tasks.countdown:FORMAT_REWARD",
                "asyncrl.tasks.countdown:a:b"]:
        with pytest.raises(ValueError) as info:
            resolve_reward_fn(bad)
        assert repr(bad) in str(info.value)


def test_longtail_task_lengths_and_reward():
    from asyncrl.tasks.longtail import iter_longtail, longtail_reward

    stream = iter_longtail(0)
    tasks = [next(stream) for _ in range(2000)]
    lengths = sorted(t.data["length"] for t in tasks)
    median = lengths[len(lengths) // 2]
    assert lengths[-1] >= 6 * median  # a tail many times longer than the median
    assert all(t.data["max_tokens"] == t.data["length"] for t in tasks)
    task = Task(id="x", prompt="4 digits 1", data={"length": 4, "max_tokens": 4})
    assert longtail_reward(task, "12a4") == 0.75  # 3 of the 4 asked-for chars are digits
    assert longtail_reward(task, "1234567") == 1.0  # beyond the length does not count
    assert longtail_reward(task, "") == 0.0
