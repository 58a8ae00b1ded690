"""Writes the conversations that teach a small model to be the judge of examples/judge/addition.yaml,
deterministic by seed.

    python examples/judge/make_judge_data.py [key=value ...] [--config addition.yaml] [--out-dir DIR] [--seed 0] ...

SmolLM2-135M-Instruct, asked the rubric untrained, answers with sentences and no ``GRADE:``
(docs/teachers-and-judges.md), so none of its replies is a grade. These conversations are the
judge's calls as its client makes them, each with the grade the task's own checker gives:

- the messages are :func:`asyncrl.frozen.judge.judge_messages` of the config's ``judge.prompt``,
  the task and the response: what ``JudgeReward`` sends for that pair, byte for byte; the
  assistant's reply is ``GRADE: 10`` where ``arithmetic_reward`` passes the response, else
  ``GRADE: 0`` (the rubric's scale);
- the tasks are the config's own train tasks (``asyncrl/tasks``, ``name: arithmetic``, its
  options): the arithmetic generator's prompts, none of them a validation prompt. agreement.py
  grades responses to validation tasks only, so no (prompt, response) pair it grades is in
  these files, whatever the response: its prompt is never here;
- the responses are what the addition policy writes (``use_chat_template: false``,
  ``max_tokens: 4``: a short number string, sometimes more): half the correct sum (bare, or with
  the space or newline the checker strips), half wrong, most of those near misses (off by one,
  digits swapped, a digit dropped or added, the sum with more tokens after it), the rest another
  number, nothing, or junk.

Writes ``judge_sft.jsonl`` (``--train`` conversations) and ``judge_heldout.jsonl`` (``--heldout``)
in ``--out-dir`` (default: this directory): ``{"messages": [...]}`` per line, for ``asyncrl sft``
(``judge_sft.yaml``). The held-out conversations ask about train prompts the SFT file never asks
about, so its held-out loss is on prompts the judge has not seen.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from asyncrl.config import Config, ConfigError, load_config
from asyncrl.frozen.judge import judge_messages
from asyncrl.tasks import is_validation_prompt
from asyncrl.tasks.arithmetic import arithmetic_reward
from asyncrl.tasks.base import Task
from asyncrl.tasks.from_config import build_tasks

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "addition.yaml"
PASS, FAIL = "GRADE: 10", "GRADE: 0"  # the rubric's two grades (judge.scale 10)
JUNK = ("", " ", "+", "=", "+=", "\n", "+1", "a", "?")
WRONG_KINDS = ("off_by_one", "swapped", "dropped", "added", "trailing", "other", "junk")
WRONG_WEIGHTS = (4, 2, 1, 1, 2, 2, 2)  # near misses most: they are what the judge gets wrong


def correct_response(r: random.Random, answer: int) -> str:
    """The sum as the policy writes it: bare mostly, or with what the checker strips."""
    return r.choice(("{}", "{}", "{}", "{}", " {}", "{}\n", "{} ")).format(answer)


def wrong_response(r: random.Random, answer: int, kind: str) -> str:
    """A response of ``kind`` that is not the sum; falls back to another number where the kind
    cannot make a wrong one (0's dropped digit, 11 swapped)."""
    text = str(answer)
    if kind == "off_by_one":
        candidate = str(answer + r.choice((-1, 1)) if answer > 0 else answer + 1)
    elif kind == "swapped":
        candidate = text[::-1] if len(text) == 2 else text
    elif kind == "dropped":
        candidate = text[1:] if r.random() < 0.5 else text[:-1]
    elif kind == "added":
        candidate = text + str(r.randint(0, 9)) if r.random() < 0.5 else str(r.randint(1, 9)) + text
    elif kind == "trailing":  # the sum, then more of the 4 tokens: not exactly the answer
        candidate = text + r.choice(("\n1", "+", "+1", "1+", "=", "\n", " 1"))[: max(1, 4 - len(text))]
        candidate = candidate if candidate.strip() != text else text + "+"
    elif kind == "junk":
        candidate = r.choice(JUNK)
    else:
        candidate = str(r.randint(0, 38))
    if arithmetic_reward(Task(id="-", prompt="", data={"answer": answer}), candidate) == 1.0:
        return str(r.choice([n for n in range(39) if n != answer]))
    return candidate


def conversation(template: str, task: Task, response: str) -> dict:
    """The judge's call for ``response`` to ``task``, answered with the checker's grade."""
    grade = PASS if arithmetic_reward(task, response) == 1.0 else FAIL
    return {"messages": [*judge_messages(template, task, response), {"role": "assistant", "content": grade}]}


def held_apart_tasks(cfg: Config, seed: int, heldout_share: float) -> tuple[list[Task], list[Task]]:
    """The config's train tasks, one per prompt, in two seeded parts that share no prompt (the SFT's
    and its held-out loss's). A validation prompt is never among them: the task loader keeps
    them out of train (``is_validation_prompt``), and they are dropped here again, so an
    override of ``task.num_validation`` or ``eval.num_tasks`` cannot bring one in."""
    splits = build_tasks(cfg)
    validation = {t.prompt for t in splits.validation}
    unique: dict[str, Task] = {}
    for task in splits.train:
        if task.prompt not in validation and not is_validation_prompt(task.prompt):
            unique.setdefault(task.prompt, task)
    tasks = sorted(unique.values(), key=lambda t: t.prompt)
    random.Random(seed).shuffle(tasks)
    cut = max(1, round(len(tasks) * heldout_share))
    return tasks[cut:], tasks[:cut]


def make(cfg: Config, n: int, tasks: list[Task], r: random.Random) -> list[tuple[Task, str, dict]]:
    """``n`` (task, response, conversation) triples over ``tasks``: half correct responses, half wrong."""
    rows = []
    for i in range(n):
        task = r.choice(tasks)
        answer = int(task.data["answer"])
        response = (correct_response(r, answer) if i % 2 == 0
                    else wrong_response(r, answer, r.choices(WRONG_KINDS, WRONG_WEIGHTS)[0]))
        rows.append((task, response, conversation(cfg.judge.prompt, task, response)))
    r.shuffle(rows)
    return rows


def generate(cfg: Config, *, seed: int, train: int, heldout: int,
             heldout_share: float = 0.15) -> tuple[list[tuple[Task, str, dict]], list[tuple[Task, str, dict]]]:
    """The SFT's and the held-out triples, deterministic by ``seed`` and the config."""
    sft_tasks, heldout_tasks = held_apart_tasks(cfg, seed, heldout_share)
    r = random.Random(seed)
    return make(cfg, train, sft_tasks, r), make(cfg, heldout, heldout_tasks, r)


def write(path: Path, rows: list[tuple[Task, str, dict]]) -> None:
    path.write_text("".join(json.dumps(conv, ensure_ascii=False) + "\n" for _, _, conv in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value for the config, as for asyncrl train")
    parser.add_argument("--config", default=str(CONFIG), help="the judged run's config: its task and judge.prompt")
    parser.add_argument("--out-dir", default=str(HERE))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=160, help="conversations for the SFT (default 160)")
    parser.add_argument("--heldout", type=int, default=32, help="conversations for its held-out loss (default 32)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        sft, heldout = generate(cfg, seed=args.seed, train=args.train, heldout=args.heldout)
    except ConfigError as exc:
        print(f"make_judge_data.py: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "judge_sft.jsonl", sft)
    write(out / "judge_heldout.jsonl", heldout)
    passed = sum(conv["messages"][-1]["content"] == PASS for _, _, conv in sft)
    print(f"wrote {out / 'judge_sft.jsonl'} ({len(sft)} conversations, {passed} graded 10) and "
          f"{out / 'judge_heldout.jsonl'} ({len(heldout)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
