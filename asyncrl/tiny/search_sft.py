"""Supervised warm-up that turns a random tiny Qwen2 into an imperfect search agent.

RL of the search agent (``examples/search_agent``) needs a policy that already calls the
``search`` tool and answers ``Answer: <name>`` often enough to see a reward. So the
shipped ``models/search-tiny`` is made here, from synthetic ideal traces of ``multihop``
train-split questions, stopped early by steps so held-out exact match leaves room to learn.

A trace is the conversation the real agent would hold, rendered as the gateway records it:

- the assistant's call is the text the policy samples, ``<tool_call>{"name": "search",
  "arguments": {"query": "<subject>"}}</tool_call>`` (``json.dumps`` spacing, which the
  ``hermes`` parser reads and the chat template writes), kept as the turn's ``content``
  exactly as ``Response.message`` records a sampled reply;
- the tool result is what the agent's ``search`` returns: ``format_hits`` of the index's
  top ``SEARCH_K`` hits, each cut at ``MAX_HIT_CHARS``, the whole cut at ``MAX_RESULT_CHARS``.
  The agent's ``search`` is async over an HTTP client, so it is replicated here over an
  in-process ``BM25Index`` of the same corpus, with the constants and ``TOOLS`` read from the
  agent file itself (tests check the two agree through a real service);
- the loss covers the assistant turns only (their content and the end-of-turn token the
  policy samples), as ``sft.py`` masks the prompt.

Only *answerable* traces are kept: the fact each hop needs must be visible in the cut tool
result (training on the rest would teach guessing); with titles indexed, a name's own page
ranks first and nearly all are. A two-hop trace (~500–660 characters) fits 768 positions.

What it traces (``world_examples``): a quarter of the questions in the example's own
knowledge base, the rest in counterfactual variants of it (the same names, every fact
redrawn), so the policy knows the names but can only answer by reading the result. The
log's ``eval`` column is ``turn_probe``: on held-out questions, how often the model would
write the search call and the answer exactly, a cheap gauge of the two skills.

    python -m asyncrl.tiny.search_sft --out models/search-tiny
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.plugins import load_named
from asyncrl.tasks import Task, load_tasks
from asyncrl.tasks.multihop import multihop_corpus
from asyncrl.tiny.model import build_tiny_model, save_tiny_policy
from asyncrl.tiny.sft import IGNORE_INDEX, NUM_THREADS, add_model_flags, collate, train_examples
from asyncrl.tiny.tokenizer import build_char_tokenizer
from asyncrl.tools.retrieval import BM25Index, Document, format_hits

Example = tuple[list[int], list[int]]  # (input_ids, labels), labels IGNORE_INDEX off the assistant turns

DEFAULT_AGENT = "examples/search_agent/agent.py"
DEFAULT_EVAL_CONFIG = "examples/search_agent/sync.yaml"
DEFAULT_MODEL: dict[str, int] = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                                 "intermediate_size": 384, "max_position_embeddings": 768}
DEFAULT_STEPS = 2500
DEFAULT_MINUTES = 40.0
DEFAULT_NUM_TRAIN = 20_000
DEFAULT_WORLDS = 20
DEFAULT_OWN_SHARE = 0.25
DEFAULT_BATCH_SIZE = 8
EVAL_MAX_TOKENS = 96  # a search call of a long name is ~85 characters, over the configs' 48


# ----------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class SearchTool:
    """The agent's tool as its model sees it: the ``tools`` list and how a result is cut."""

    tools: list[dict[str, Any]]
    k: int
    max_hit_chars: int
    max_result_chars: int

    @classmethod
    def from_agent(cls, path: str = DEFAULT_AGENT) -> SearchTool:
        """Read ``TOOLS``, ``SEARCH_K``, ``MAX_HIT_CHARS`` and ``MAX_RESULT_CHARS`` from the agent file."""
        agent = inspect.getmodule(load_named(f"{path}:run", key="--agent"))
        return cls(agent.TOOLS, agent.SEARCH_K, agent.MAX_HIT_CHARS, agent.MAX_RESULT_CHARS)

    def result(self, index: BM25Index, query: str) -> str:
        """What the agent's ``search`` returns for ``query`` (its service's text, cut)."""
        return format_hits(index.search(query, self.k), max_chars=self.max_hit_chars)[: self.max_result_chars]


def corpus_index(options: dict[str, Any] | None = None) -> BM25Index:
    """BM25 over ``multihop_corpus(**options)``, the corpus the agent's own service indexes."""
    return BM25Index(Document(d["id"], d["text"], d["title"]) for d in multihop_corpus(**(options or {})))


def tool_call_text(query: str) -> str:
    """A search call as the policy writes it (and as the chat template renders one)."""
    return "<tool_call>" + json.dumps({"name": "search", "arguments": {"query": query}}) + "</tool_call>"


def ideal_trace(task: Task, index: BM25Index, tool: SearchTool) -> list[dict[str, str]] | None:
    """The ideal conversation for ``task``: per hop, search the entity the hop starts from and
    read its result; then ``Answer: <answer>``. None when a hop's result does not show the
    entity the next step needs (the next query, or the answer)."""
    entities = task.data["entities"]  # subject, (intermediate,) answer
    messages = [{"role": "user", "content": task.prompt}]
    for hop in range(task.data["hops"]):
        result = tool.result(index, entities[hop])
        if entities[hop + 1] not in result:
            return None
        messages += [{"role": "assistant", "content": tool_call_text(entities[hop])},
                     {"role": "tool", "content": result}]
    messages.append({"role": "assistant", "content": f"Answer: {task.data['answer']}"})
    return messages


def trace_example(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]],
                  max_len: int) -> Example:
    """Ids of the rendered conversation; labels on each assistant turn's content and the
    end-of-turn token it samples, as the gateway records them (loss mask 1), nothing else.

    Built turn by turn from the template's text deltas, the way ``LLMClient`` extends a
    conversation, so the concatenation equals the whole rendering; cut at ``max_len``.
    """
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        opened = tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False)
        assert opened.startswith(rendered), "the template rewrote an earlier turn"
        context = list(tokenizer.encode(opened[len(rendered):], add_special_tokens=False))
        reply = list(tokenizer.encode(message["content"], add_special_tokens=False)) + [eos]
        ids += context + reply
        labels += [IGNORE_INDEX] * len(context) + reply
        closed = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        assert closed.startswith(opened + message["content"]), "the template rewrote an earlier turn"
        rendered = opened + message["content"] + tokenizer.eos_token  # the "\n" after it: next context
    return ids[:max_len], labels[:max_len]


def search_examples(tokenizer: Any, tasks: Sequence[Task], index: BM25Index, tool: SearchTool,
                    max_len: int) -> tuple[list[Example], dict[str, int]]:
    """Examples of the answerable tasks, and counts of what was kept, skipped and cut."""
    examples, counts = [], {"tasks": len(tasks), "unanswerable": 0, "cut_to_context": 0}
    for task in tasks:
        messages = ideal_trace(task, index, tool)
        if messages is None:
            counts["unanswerable"] += 1
            continue
        full = tokenizer.apply_chat_template(messages, tools=tool.tools, tokenize=False)
        counts["cut_to_context"] += len(tokenizer.encode(full, add_special_tokens=False)) > max_len
        examples.append(trace_example(tokenizer, messages, tool.tools, max_len))
    counts["examples"] = len(examples)
    return examples, counts


def world_examples(tokenizer: Any, tool: SearchTool, *, worlds: int, own_share: float, num_train: int, seed: int,
                   max_len: int) -> tuple[list[Example], dict[str, int]]:
    """Traces of ``num_train`` train-split questions: ``own_share`` of them in the example's
    knowledge base as it is, the rest spread over ``worlds`` counterfactual variants of it
    (the same names, every fact redrawn: ``facts_seed`` 1..worlds). Validation questions
    are never traced.

    Why variants. Traced in the example's world alone, the policy learnt its names (it
    copied a held-out question's name into the search 78 % of the time) but memorised the
    answers instead of reading them off the result (4.7 % of held-out answers right given
    the right result). Traced in other worlds, with names it had never seen, it had to read
    but did not learn to copy an unseen name letter by letter within 1,266 steps (2 %).
    In a variant the names are familiar and the facts cannot be remembered: reading the
    result is the only way to the answer, as it is for a held-out question.
    """
    if worlds < 0 or not 0 <= own_share <= 1 or (worlds == 0 and own_share < 1):
        raise ValueError(f"need worlds >= 0 and 0 <= own_share <= 1 (1 when worlds is 0), "
                         f"got worlds={worlds}, own_share={own_share}")
    own = round(num_train * own_share)
    shares = {None: own} | {w: (num_train - own) // worlds + (w <= (num_train - own) % worlds)
                            for w in range(1, worlds + 1)}
    examples: list[Example] = []
    counts: dict[str, int] = {}
    for world, share in shares.items():
        options = {} if world is None else {"facts_seed": world}
        tasks = load_tasks("multihop", seed=seed + (world or 0), num_train=share, num_validation=1,
                           options=options).train
        more, world_counts = search_examples(tokenizer, tasks, corpus_index(options), tool, max_len)
        examples += more
        for key, value in world_counts.items():
            counts[key] = counts.get(key, 0) + value
    return examples, {"variants": worlds, "own_world_traces": own, **counts}


def turn_probe(tokenizer: Any, tool: SearchTool, *, num_tasks: int = 64, seed: int = 0,
               max_len: int) -> Callable[[Any], dict[str, float]]:
    """A cheap held-out gauge for the training log: on ideal traces of the example's own
    world-0 *validation* questions, the fraction of search calls and of answers the model
    would write exactly under greedy decoding (argmax equals the label at every position of
    the turn, given the ideal turns before it)."""
    tasks = load_tasks("multihop", seed=seed, num_train=0, num_validation=num_tasks).validation
    examples, _ = search_examples(tokenizer, tasks, corpus_index(), tool, max_len)
    ids, mask, labels = collate(examples, tokenizer.pad_token_id)

    @torch.no_grad()
    def probe(model: Any) -> dict[str, float]:
        predicted = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        hits = {"call": [], "answer": []}
        for row in range(len(examples)):
            turns, turn = [], []
            for position in (target[row] != IGNORE_INDEX).nonzero().flatten().tolist():
                if turn and position != turn[-1] + 1:
                    turns.append(turn)
                    turn = []
                turn.append(position)
            turns += [turn] if turn else []
            for k, turn in enumerate(turns):
                exact = bool((predicted[row, turn] == target[row, turn]).all())
                hits["answer" if k == len(turns) - 1 else "call"].append(exact)
        return {f"{kind}_exact": round(sum(v) / max(1, len(v)), 3) for kind, v in hits.items()}

    return probe


# ----------------------------------------------------------------------------- training


# ----------------------------------------------------------------------------- held-out score


def agent_eval(model_path: str, *, config: str, num_tasks: int, samples_per_task: int, temperature: float,
               output_dir: str) -> dict[str, Any]:
    """Held-out score through the real agent, as ``asyncrl eval <config> model.path=...`` runs it."""
    from asyncrl.config import load_config
    from asyncrl.orchestrator.evaluator import run_eval

    overrides = [f"model.path={model_path}", f"output_dir={output_dir}", f"eval.num_tasks={num_tasks}",
                 f"eval.samples_per_task={samples_per_task}", f"eval.temperature={temperature}",
                 f"sampling.max_tokens={EVAL_MAX_TOKENS}"]
    summary = run_eval(load_config(config, overrides)).summary()
    return {"command": "asyncrl eval " + shlex.join([config, *overrides]), **summary}


# ----------------------------------------------------------------------------- CLI


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m asyncrl.tiny.search_sft",
                                description="Make the tiny search-agent base policy from synthetic traces.")
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=NUM_THREADS, help="torch threads (1 on a machine shared with other jobs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps (the stopping rule)")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="wall-clock cap on training")
    p.add_argument("--num-train", type=int, default=DEFAULT_NUM_TRAIN, help="train-split questions to trace")
    p.add_argument("--worlds", type=int, default=DEFAULT_WORLDS,
                   help="counterfactual variants of the example's knowledge base to trace in")
    p.add_argument("--own-share", type=float, default=DEFAULT_OWN_SHARE,
                   help="share of the traces in the example's own knowledge base (its train questions)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--agent", default=DEFAULT_AGENT, help="agent file whose TOOLS and result cut the traces copy")
    p.add_argument("--eval-config", default=DEFAULT_EVAL_CONFIG, help="'' to skip the held-out eval")
    p.add_argument("--eval-tasks", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--eval-temperature", type=float, default=1.0)
    p.add_argument("--eval-dir", default="/tmp/search-sft-eval")
    add_model_flags(p, DEFAULT_MODEL)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trace, train, save, score through the agent; returns what base_policy.json holds."""
    import transformers

    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m asyncrl.tiny.search_sft " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    model_kwargs = {key: getattr(args, key) for key in DEFAULT_MODEL}
    model, tokenizer = build_tiny_model(build_char_tokenizer(), args.seed, **model_kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    tool = SearchTool.from_agent(args.agent)
    examples, counts = world_examples(tokenizer, tool, worlds=args.worlds, own_share=args.own_share,
                                      num_train=args.num_train, seed=args.seed, max_len=args.max_position_embeddings)
    print(f"model: {n_params:,} params {model_kwargs}; traces {counts}")

    history = train_examples(model, examples, tokenizer.pad_token_id, steps=args.steps,
                             time_budget_s=args.minutes * 60 if args.minutes else None, batch_size=args.batch_size,
                             lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed, log_every=args.log_every,
                             eval_fn=turn_probe(tokenizer, tool, max_len=args.max_position_embeddings),
                             desc="search-sft")
    out = save_tiny_policy(model, tokenizer, args.out)
    record: dict[str, Any] = {
        "command": command, "seed": args.seed, "task": "multihop", "agent": args.agent,
        "traces": counts, "params": n_params, "model": model_kwargs, "batch_size": args.batch_size,
        "lr": args.lr, "warmup_steps": args.warmup_steps, "steps_requested": args.steps,
        "time_cap_s": args.minutes * 60 if args.minutes else None, "steps": history["steps"],
        "stopped_by": history["stopped_by"], "wall_time_s": round(history["wall_time_s"], 1),
        "final_loss": round(history["final_loss"], 4), "final_loss_ema": round(history["final_loss_ema"], 4),
        "loss_log": history["log"],
    }
    if args.eval_config:
        start = time.perf_counter()
        record["held_out"] = agent_eval(str(out), config=args.eval_config, num_tasks=args.eval_tasks,
                                        samples_per_task=args.eval_samples, temperature=args.eval_temperature,
                                        output_dir=args.eval_dir)
        record["held_out"]["wall_time_s"] = round(time.perf_counter() - start, 1)
    record.update(machine=f"{platform.machine()} CPU, {args.threads} threads", torch_version=torch.__version__,
                  transformers_version=transformers.__version__, python_version=platform.python_version(),
                  made_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (out / "base_policy.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record.get(k) for k in ("params", "steps", "wall_time_s", "final_loss", "held_out")}))
    print(f"saved to {out}")
    return record


if __name__ == "__main__":
    main()
