"""The format-only SFT data for the multi-turn recipes (README.md here, "Multi-turn RL").

    python make_multiturn_sft.py [OUT]      # default: multiturn_sft.jsonl here; run with the cookbook's venv

SmolLM2-135M-Instruct, given guess-the-number's or twenty-questions' system prompt, answers
with free text (0 of 160 turns of guess-the-number parsed as "Guess: N" before the SFT), so the
recipes' RL would see only the format penalty. One short supervised pass through the same
server (``sl_basic`` on this file) teaches the two formats and nothing of the games:

- **guess-the-number**: the env's own system prompt and history (the player's turns as role
  ``player``, the env's feedback as ``user``, exactly as ``GuessNumberEnv`` builds them), then
  an ``assistant`` turn ``Guess: N`` with N drawn uniformly from 0..1023, **ignoring** the
  feedback: the strategy (bisection) is left to the RL;
- **twenty-questions** (the player): the env's system prompt, a few questions from a fixed list
  of generic ones answered ``yes``/``no`` at random, then either one more question or a
  ``Guess: <noun>`` with a noun drawn from the recipe's own word list, **not** the secret: the
  game's logic is again left to the RL.

The prompts are imported from the recipes (not copied), so the data follow the cookbook
version installed. Seeded: the same file every time.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tinker_cookbook.recipes.multiplayer_rl.guess_number import env as guess
from tinker_cookbook.recipes.multiplayer_rl.twenty_questions import env as twenty

QUESTIONS = ["Is it alive?", "Is it an animal?", "Is it a plant?", "Is it bigger than a person?",
             "Can you hold it in your hand?", "Is it made of metal?", "Is it used indoors?",
             "Is it something you eat?", "Is it a tool?", "Is it found in nature?", "Does it have wheels?",
             "Is it a piece of furniture?", "Is it worn on the body?", "Is it electronic?",
             "Is it soft?", "Is it used for work?", "Is it found in a kitchen?", "Can it move by itself?",
             "Is it made of wood?", "Is it a place?"]
PER_GAME = 96


def guess_number(rng: random.Random) -> list[dict[str, str]]:
    """The env's conversation after 0..9 turns, then the format's answer."""
    gold, turns = rng.randrange(1024), []
    for _ in range(rng.randrange(10)):
        n = rng.randrange(1024)
        feedback = "Correct" if n == gold else "Too low" if n < gold else "Too high"
        if n == gold:
            break
        turns += [{"role": "player", "content": f"Guess: {n}"}, {"role": "user", "content": feedback}]
    return [{"role": "system", "content": guess.SYSTEM_PROMPT}, *turns,
            {"role": "assistant", "content": f"Guess: {rng.randrange(1024)}"}]


def twenty_questions(rng: random.Random, words: list[str]) -> list[dict[str, str]]:
    """The player's conversation: questions answered at random, then a question or a guess."""
    convo = [{"role": "system", "content": twenty.PLAYER_SYSTEM_PROMPT}]
    for question in rng.sample(QUESTIONS, rng.randrange(6)):
        convo += [{"role": "assistant", "content": question}, {"role": "user", "content": rng.choice(["yes", "no"])}]
    last = f"Guess: {rng.choice(words)}" if rng.random() < 0.3 else rng.choice(QUESTIONS)
    return [*convo, {"role": "assistant", "content": last}]


def main(out: Path) -> None:
    rng = random.Random(0)
    words = twenty._load_words_from_file()
    rows = [guess_number(rng) for _ in range(PER_GAME)] + [twenty_questions(rng, words) for _ in range(PER_GAME)]
    rng.shuffle(rows)
    out.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    print(f"{out}: {len(rows)} conversations")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("multiturn_sft.jsonl"))
