"""Supervised warm-up that turns a random tiny Qwen2 into an unsure search agent.

RL of the search agent (``examples/search_agent``) needs a policy that can already do the
task but is unsure of it, so a reward is seen often and RL has something to sharpen: the
recipe of the addition policy (``addition_sft``), applied to an agent. The shipped
``models/search-tiny`` is made here from synthetic traces of the ``multihop`` task:

- **in other worlds only** (``corpus_seed`` 1..``worlds``; the example asks about world
  0): the policy learns to search and read, never the example's facts, so without the tool
  it can only guess (the held-out score with every search finding nothing is ≈ 0);
- **deliberately noisy**: each trace follows the ideal path (search the subject, read its
  one fact, search that, ... answer) but with probability ``skip`` answers a made-up
  identifier without searching, at each intermediate hop with probability ``early``
  answers the identifier it has just read (stopping a hop short), and with probability
  ``wrong`` answers another identifier it has seen. The policy learns the right action
  as the single most likely one and samples it about a third of the time: learnable.

A trace is the conversation the real agent holds, rendered as the gateway records it: the
assistant's call is the text the policy samples, ``<tool_call>{"name": "search",
"arguments": {"query": "P3K"}}</tool_call>``, kept as the turn's ``content`` as
``Response.message`` records a sampled reply; the tool result is the agent's own
``format_result`` of the index's top ``SEARCH_K`` hits (an in-process ``BM25Index`` of the
same corpus stands in for the agent's HTTP service; tests check the two agree). The loss
covers the assistant turns only (content and the end-of-turn token the policy samples).

The log's ``eval`` column is ``turn_probe``: on noise-free traces of world 0's held-out
questions, how often the greedy model writes each search call and the answer exactly.

    python -m asyncrl.tiny.search_sft --out models/search-tiny
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from asyncrl.plugins import load_named
from asyncrl.tasks import Task, load_tasks
from asyncrl.tasks.multihop import ID_CHARS, KINDS, iter_multihop, multihop_corpus
from asyncrl.tiny.model import build_tiny_model, save_tiny_policy
from asyncrl.tiny.sft import IGNORE_INDEX, NUM_THREADS, add_model_flags, collate, train_examples
from asyncrl.tiny.tokenizer import build_char_tokenizer
from asyncrl.tools.retrieval import BM25Index, Document

Example = tuple[list[int], list[int]]  # (input_ids, labels), labels IGNORE_INDEX off the assistant turns

DEFAULT_AGENT = "examples/search_agent/agent.py"
DEFAULT_EVAL_CONFIG = "examples/search_agent/sync.yaml"
DEFAULT_MODEL: dict[str, int] = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                                 "intermediate_size": 384, "max_position_embeddings": 512}
DEFAULT_STEPS = 800
DEFAULT_MINUTES = 30.0
DEFAULT_NUM_TRAIN = 20_000
DEFAULT_WORLDS = 50
DEFAULT_BATCH_SIZE = 16
DEFAULT_COPY_DRILLS = 20_000
DEFAULT_DRILL_STEPS = 500
DRILL_BATCH_SIZE, DRILL_LR = 32, 1e-3  # copying forms within DEFAULT_DRILL_STEPS of drills alone (docs/design.md)
_CONFIG_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads"}  # build_tiny_model's keyword -> Qwen2Config's name
EVAL_MAX_TOKENS = 80  # a search call is ~65 characters


@dataclass(frozen=True)
class Noise:
    """Per-trace error rates of the warm-up's teacher (see the module docstring)."""

    skip: float = 0.1
    early: float = 0.25
    wrong: float = 0.5

    def __post_init__(self) -> None:
        for name in ("skip", "early", "wrong"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"noise.{name} must be in [0, 1), got {getattr(self, name)}")


# ----------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class SearchTool:
    """The agent's tool as its model sees it: the ``tools`` list and how a result reads."""

    tools: list[dict[str, Any]]
    k: int
    format_result: Callable[[list[str]], str]

    @classmethod
    def from_agent(cls, path: str = DEFAULT_AGENT) -> SearchTool:
        """Read ``TOOLS``, ``SEARCH_K`` and ``format_result`` from the agent file."""
        agent = inspect.getmodule(load_named(f"{path}:run", key="--agent"))
        return cls(agent.TOOLS, agent.SEARCH_K, agent.format_result)

    def result(self, index: BM25Index, query: str) -> str:
        """What the agent's ``search`` returns for ``query``."""
        return self.format_result([hit["text"] for hit in index.search(query, self.k)])


def corpus_index(options: dict[str, Any] | None = None) -> BM25Index:
    """BM25 over ``multihop_corpus(**options)``, the corpus the agent's own service indexes."""
    return BM25Index(Document(d["id"], d["text"], d["title"]) for d in multihop_corpus(**(options or {})))


def tool_call_text(query: str) -> str:
    """A search call as the policy writes it (and as the chat template renders one)."""
    return "<tool_call>" + json.dumps({"name": "search", "arguments": {"query": query}}) + "</tool_call>"


_PREFIXES = {prefix for prefix, _, _ in KINDS}


def _answer(entity: str) -> dict[str, str]:
    return {"role": "assistant", "content": f"Answer: {entity}"}


def noisy_trace(task: Task, index: BM25Index, tool: SearchTool, noise: Noise, rng: random.Random,
                ) -> list[dict[str, str]]:
    """One conversation for ``task`` as a noisy teacher holds it (``Noise`` says how it errs).
    With ``Noise(0, 0, 0)`` it is the ideal one: per hop, search the entity the hop starts
    from and read its fact; then ``Answer: <answer>``."""
    entities = task.data["entities"]  # subject, intermediates..., answer
    messages = [{"role": "user", "content": task.prompt}]
    if rng.random() < noise.skip:
        prefix = entities[-1][0]
        made_up = prefix + "".join(rng.choice(ID_CHARS) for _ in range(2))
        return messages + [_answer(made_up)]
    seen: list[str] = []
    for hop in range(task.data["hops"]):
        if hop and rng.random() < noise.early:
            return messages + [_answer(entities[hop])]
        result = tool.result(index, entities[hop])
        seen += [word for word in result.replace(".", " ").split() if word[:1] in _PREFIXES and len(word) == 3]
        messages += [{"role": "assistant", "content": tool_call_text(entities[hop])},
                     {"role": "tool", "content": result}]
    others = sorted(set(seen) - {entities[-1]})
    if others and rng.random() < noise.wrong:
        return messages + [_answer(rng.choice(others))]
    return messages + [_answer(entities[-1])]


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


def copy_examples(tokenizer: Any, n: int, rng: random.Random) -> list[Example]:
    """``n`` drills in copying identifiers: the user lists one to six made-up ones, the
    assistant repeats them. Cheap (~40 tokens) and dense in the one skill the traces
    teach slowly — every reply is an induction (find the letter just written, copy what
    follows) — so it forms the copying circuit the searches and answers need."""
    eos, prefixes = tokenizer.eos_token_id, [prefix for prefix, _, _ in KINDS]
    examples = []
    for _ in range(n):
        ids = " ".join(rng.choice(prefixes) + rng.choice(ID_CHARS) + rng.choice(ID_CHARS)
                       for _ in range(rng.randint(1, 6)))
        text = tokenizer.apply_chat_template([{"role": "user", "content": ids}], add_generation_prompt=True,
                                             tokenize=False)
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
        reply = list(tokenizer.encode(ids, add_special_tokens=False)) + [eos]
        examples.append((prompt + reply, [IGNORE_INDEX] * len(prompt) + reply))
    return examples


def world_examples(tokenizer: Any, tool: SearchTool, noise: Noise, *, worlds: int, num_train: int, seed: int,
                   max_len: int) -> tuple[list[Example], dict[str, int]]:
    """Noisy traces of ``num_train`` questions spread over worlds ``1..worlds`` (never world
    0, the example's), with counts of what the teacher did."""
    if worlds < 1:
        raise ValueError(f"need worlds >= 1, got {worlds}")
    rng = random.Random(f"asyncrl-search-sft-{seed}")
    examples: list[Example] = []
    counts = {"worlds": worlds, "traces": 0, "skipped_search": 0, "stopped_early": 0, "wrong_answer": 0,
              "right_answer": 0, "cut_to_context": 0, "max_len": 0}
    for world in range(1, worlds + 1):
        share = num_train // worlds + (world <= num_train % worlds)
        index = corpus_index({"corpus_seed": world})
        for task in islice(iter_multihop(seed * 1000 + world, corpus_seed=world), share):
            messages = noisy_trace(task, index, tool, noise, rng)
            searches = sum(m["role"] == "tool" for m in messages)
            right = messages[-1]["content"] == f"Answer: {task.data['answer']}"
            counts["traces"] += 1
            counts["skipped_search"] += searches == 0
            counts["stopped_early"] += 0 < searches < task.data["hops"]
            counts["right_answer"] += right
            counts["wrong_answer"] += searches == task.data["hops"] and not right
            ids, labels = trace_example(tokenizer, messages, tool.tools, max_len + 1)
            counts["cut_to_context"] += len(ids) > max_len
            counts["max_len"] = max(counts["max_len"], min(len(ids), max_len))
            examples.append((ids[:max_len], labels[:max_len]))
    return examples, counts


def turn_probe(tokenizer: Any, tool: SearchTool, *, num_tasks: int = 64, seed: int = 0,
               max_len: int) -> Callable[[Any], dict[str, float]]:
    """A cheap held-out gauge for the training log: on noise-free traces of world 0's
    *validation* questions, the fraction of search calls and of answers the greedy model
    would write exactly (argmax equals the label at every position of the turn, given the
    ideal turns before it)."""
    tasks = load_tasks("multihop", seed=seed, num_train=0, num_validation=num_tasks).validation
    index, ideal, rng = corpus_index(), Noise(0, 0, 0), random.Random(0)
    examples = [trace_example(tokenizer, noisy_trace(t, index, tool, ideal, rng), tool.tools, max_len) for t in tasks]
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


# ----------------------------------------------------------------------------- held-out score


def agent_eval(model_path: str, *, config: str, num_tasks: int, samples_per_task: int, temperature: float,
               output_dir: str) -> dict[str, Any]:
    """Held-out score through the real agent, as ``asyncrl eval <config> model.path=...`` runs it."""
    from asyncrl.config import load_config
    from asyncrl.orchestrator.eval_command import run_eval

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
    p.add_argument("--threads", type=int, default=NUM_THREADS,
                   help="torch threads (1 on a machine shared with other jobs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None,
                   help="continue from this policy (a directory an earlier run saved) instead of a fresh model")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps (the stopping rule)")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="wall-clock cap on training")
    p.add_argument("--num-train", type=int, default=DEFAULT_NUM_TRAIN, help="questions to trace")
    p.add_argument("--worlds", type=int, default=DEFAULT_WORLDS, help="other worlds (corpus_seed 1..N) to trace in")
    p.add_argument("--copy-drills", type=int, default=DEFAULT_COPY_DRILLS,
                   help="identifier-copying drills mixed into the traces (copy_examples)")
    p.add_argument("--drill-steps", type=int, default=DEFAULT_DRILL_STEPS,
                   help="steps of copying drills alone before the traces")
    p.add_argument("--skip", type=float, default=Noise.skip, help="P(answer without searching)")
    p.add_argument("--early", type=float, default=Noise.early, help="P(answer an intermediate hop's id), per hop")
    p.add_argument("--wrong", type=float, default=Noise.wrong, help="P(answer another id seen)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--lr", type=float, default=1e-3)
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
    init_record = None
    if args.init:  # a second stage: its record keeps the first stage's
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.init), AutoTokenizer.from_pretrained(args.init)
        model_kwargs = {key: getattr(model.config, _CONFIG_NAMES.get(key, key)) for key in DEFAULT_MODEL}
        record_path = Path(args.init) / "base_policy.json"
        init_record = json.loads(record_path.read_text()) if record_path.exists() else None
    else:
        model, tokenizer = build_tiny_model(build_char_tokenizer(), args.seed, **model_kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    tool = SearchTool.from_agent(args.agent)
    noise = Noise(skip=args.skip, early=args.early, wrong=args.wrong)
    examples, counts = world_examples(tokenizer, tool, noise, worlds=args.worlds, num_train=args.num_train,
                                      seed=args.seed, max_len=args.max_position_embeddings)
    drills = copy_examples(tokenizer, args.copy_drills, random.Random(f"asyncrl-search-sft-copy-{args.seed}"))
    examples += drills[: args.copy_drills // 4]  # a few, to keep the skill while the traces train
    counts["copy_drills"] = args.copy_drills
    print(f"model: {n_params:,} params {model_kwargs}; traces {counts}")

    drill_history = None
    if args.drill_steps:  # the copying circuit first: mixed into the traces it had not formed in 1,200 steps
        drill_history = train_examples(model, drills, tokenizer.pad_token_id, steps=args.drill_steps,
                                       time_budget_s=None, batch_size=DRILL_BATCH_SIZE, lr=DRILL_LR,
                                       warmup_steps=args.warmup_steps,
                                       seed=args.seed, log_every=args.log_every, desc="copy-drills")
    history = train_examples(model, examples, tokenizer.pad_token_id, steps=args.steps,
                             time_budget_s=args.minutes * 60 if args.minutes else None, batch_size=args.batch_size,
                             lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed, log_every=args.log_every,
                             eval_fn=turn_probe(tokenizer, tool, max_len=args.max_position_embeddings),
                             desc="search-sft", length_buckets=True)
    out = save_tiny_policy(model, tokenizer, args.out)
    record: dict[str, Any] = {
        "command": command, "seed": args.seed, "task": "multihop", "agent": args.agent,
        "init": None if not args.init else {"path": args.init, "record": init_record},
        "noise": {"skip": noise.skip, "early": noise.early, "wrong": noise.wrong}, "traces": counts,
        "params": n_params, "model": model_kwargs, "batch_size": args.batch_size,
        "lr": args.lr, "warmup_steps": args.warmup_steps, "steps_requested": args.steps,
        "time_cap_s": args.minutes * 60 if args.minutes else None, "steps": history["steps"],
        "stopped_by": history["stopped_by"], "wall_time_s": round(history["wall_time_s"], 1),
        "final_loss": round(history["final_loss"], 4), "final_loss_ema": round(history["final_loss_ema"], 4),
        "loss_log": history["log"],
        "drills": None if drill_history is None else {
            "steps": drill_history["steps"], "batch_size": DRILL_BATCH_SIZE, "lr": DRILL_LR,
            "wall_time_s": round(drill_history["wall_time_s"], 1), "loss_log": drill_history["log"]},
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
