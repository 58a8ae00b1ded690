"""The format-only SFT data for ``rl_numerics_check``, the tool-use recipe (README.md here).

    cd CORPUS_DIR && python make_counting_sft.py MODEL_DIR OUT.jsonl [TASK.FIELD=VALUE ...]

Run with the cookbook's venv, in the directory ``make_counting_corpus.py`` wrote (the env's
pages come from there), with the same ``task.*`` settings the RL run gets (page length, page
counts, words), so the SFT's documents are cut as the RL's are.

SmolLM2-135M-Instruct does not write Qwen's ``<tool_call>`` format unprompted, so before the
RL one short supervised pass through the same server (``sl_basic`` on this file) teaches the
format and nothing of the task:

- the env's own system turn (its system prompt and the ``read_page`` tool's schema, written
  by the renderer's ``create_conversation_prefix_with_tools``) and its own user prompt
  (``build_prompt``), for problems drawn by the env's own ``sample_problem`` from seeds the RL
  run never draws (``sft-<i>``; the RL draws ``<seed>-<batch>``);
- one ``read_page`` call a turn for pages 1..N in order, each answered by the tool itself (the
  env's ``PageReader``), the call written as the renderer writes a tool call;
- a last turn ``Answer: K`` with K drawn uniformly from 0..9, **not** the true count: the
  counting is left to the RL.

Every message is role + string content (the tool call written out in the assistant's text,
token for token what the renderer makes of a ``tool_calls`` field with no text), so the
cookbook's ``FromConversationFileBuilder`` reads the file as it is. Seeded: the same file
every time for the same corpus and settings.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

import chz
from tinker_cookbook.recipes.rl_numerics_check import env as counting
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.tokenizer_utils import get_tokenizer
from tinker_cookbook.tool_use.types import ToolInput

CONVERSATIONS = 64
RENDERER = "qwen3_instruct"


def tool_call_text(page: int) -> str:
    """One ``read_page`` call as the Qwen renderers write it (``<tool_call>`` + JSON)."""
    return f"<tool_call>\n{json.dumps({'name': 'read_page', 'arguments': {'page': page}})}\n</tool_call>"


async def conversation(problem: counting.CountingProblem, system: str, rng: random.Random) -> list[dict[str, str]]:
    """The env's opening, pages 1..N read in order through the env's own tool, a random answer."""
    reader = counting.PageReader(problem.pages, counting.EpisodeState())
    convo = [{"role": "system", "content": system}, {"role": "user", "content": problem.prompt}]
    for page in range(1, problem.num_pages + 1):
        result = await reader.read_page.run(ToolInput(arguments={"page": page}))
        convo.append({"role": "assistant", "content": tool_call_text(page)})
        convo += [{"role": m["role"], "content": m["content"]} for m in result.messages]
    convo.append({"role": "assistant", "content": f"Answer: {rng.randrange(10)}"})
    return convo


async def main(model_dir: str, out: str, task_args: list[str]) -> None:
    bad = [a for a in task_args if not a.startswith("task.")]
    if bad:
        sys.exit(f"make_counting_sft.py: {bad[0]!r}: only task.FIELD=VALUE settings go here (the RL run's)")
    task = chz.entrypoint(counting.CountingTaskConfig, argv=[a.removeprefix("task.") for a in task_args])
    renderer = get_renderer(RENDERER, get_tokenizer(model_dir))
    spec = counting.PageReader([], counting.EpisodeState()).read_page.to_spec()
    prefix = renderer.create_conversation_prefix_with_tools(tools=[spec], system_prompt=counting.SYSTEM_PROMPT)
    system = prefix[0]["content"]
    corpus = counting.load_wikitext_corpus()
    rng = random.Random(0)
    with open(out, "w", encoding="utf-8") as f:
        for i in range(CONVERSATIONS):
            problem = counting.sample_problem(random.Random(f"sft-{i}"), corpus, task)
            f.write(json.dumps({"messages": await conversation(problem, system, rng)}) + "\n")
    print(f"{CONVERSATIONS} conversations -> {out}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python make_counting_sft.py MODEL_DIR OUT.jsonl [task.FIELD=VALUE ...]")
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
