"""Noisy SFT traces for the DeepResearch agent: ``asyncrl sft examples/deepresearch/sft.yaml``
reads them before RL.

    python examples/deepresearch/make_traces.py [--data DIR] [--out runs/deepresearch-traces] [--seed 0]

One conversation per train query (``data/train.jsonl``), as the agent holds it: the question
with the agent's instruction, then one ``search`` per hop for the entity just read — its name,
as the query — with the top ``SEARCH_K`` hits as the tool's result, then ``Answer: <name>``.
Noise, so that RL has something left to learn (drawn per trace, seeded): with ``--early``
(0.15) the trace answers the entity it has just read, one hop short; with ``--wrong`` (0.1)
it answers another name from its results; with ``--repeat`` (0.1) it repeats a search once
and reads the duplicate guard's note. As in the agent, a trace that has searched
``MAX_TURNS - 1`` times is then told ``LAST_CALL`` ("no searches left") and answers (a
repeat on a three-hop chain thus answers one hop early). The last ``--num-eval`` (50) traces go to
``OUT/sft_eval.jsonl``, the rest to ``OUT/sft_train.jsonl``; the held-out queries (``heldout.jsonl``) are
never used.

The tool results are BM25's (``asyncrl.tools.retrieval.BM25Index``: cheap and needs no
encoder); the agent searches the hybrid index, whose top hits for a name query are the same
page in the cases checked, but the traces do not promise it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from asyncrl.plugins import load_named
from asyncrl.tasks.research import load_research
from asyncrl.tools.retrieval import BM25Index, load_documents
from asyncrl.tools.retrieval.duplicates import DuplicateGuard

agent = sys.modules[load_named(f"{Path(__file__).with_name('agent.py')}:run", key="make_traces").__module__]


def trace(task, index: BM25Index, rng: random.Random, *, early: float, wrong: float, repeat: float) -> dict:
    chain = [*task.data["gold_doc_ids"], task.data["answer"]]
    messages = [{"role": "user", "content": f"{task.prompt}\n{agent.INSTRUCTION}"}]
    guard = DuplicateGuard()
    stop = len(chain) - 1
    if stop > 1 and rng.random() < early:
        stop -= 1  # answers the entity read one hop early
    seen: list[str] = []
    queries = list(chain[:stop])
    if rng.random() < repeat:
        at = rng.randrange(len(queries))
        queries.insert(at + 1, queries[at])
    last = agent.plain.MAX_TURNS - 1  # searches before the agent's last model call
    if len(queries) > last:  # a repeat on a three-hop chain: the agent would be told to answer after `last`
        queries = queries[:last]
        stop = chain.index(queries[-1]) + 1  # the entity just read, one hop early
    for n, query in enumerate(queries, 1):
        call_id = f"call_{n}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"query": query})}}]})
        result = guard.check(query) or "\n".join(h["text"] for h in index.search(query, agent.SEARCH_K))
        seen += [d.id for d in index.documents if d.text in result]
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    answer = chain[stop]
    others = [s for s in seen if s != answer]
    if others and rng.random() < wrong:
        answer = rng.choice(others)
    if len(queries) == last:  # the agent asks for the answer before its last call (agent.LAST_CALL)
        messages.append({"role": "user", "content": agent.LAST_CALL})
    messages.append({"role": "assistant", "content": f"Answer: {answer}"})
    return {"messages": messages, "tools": agent.TOOLS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(Path(__file__).with_name("data")))
    parser.add_argument("--out", default="runs/deepresearch-traces")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--early", type=float, default=0.15)
    parser.add_argument("--wrong", type=float, default=0.1)
    parser.add_argument("--repeat", type=float, default=0.1)
    parser.add_argument("--num-eval", type=int, default=50)
    args = parser.parse_args()
    data = Path(args.data)
    index = BM25Index(load_documents(data / "corpus.jsonl"))
    rng = random.Random(args.seed)
    rows = [trace(t, index, rng, early=args.early, wrong=args.wrong, repeat=args.repeat)
            for t in load_research(data / "train.jsonl")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("sft_train.jsonl", rows[:-args.num_eval]), ("sft_eval.jsonl", rows[-args.num_eval:])):
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
        print(f"{out / name}: {len(part)} conversations")


if __name__ == "__main__":
    main()
