"""The teacher of on-policy distillation: a frozen model by URL that scores the tokens the
student sampled. Its logprobs are fetched per group as soon as the group is scored — on the
rollout side, while other groups generate and the learner trains — in one batched call, under
the client's bound and deadline; a teacher that does not answer fails the group, naming it.

Tokenizers must match: the teacher scores the student's token ids, which mean nothing to a
model with another vocabulary. :func:`check_tokenizer` asks the teacher to tokenize probe
texts (vLLM's ``/tokenize``, which ``asyncrl serve-engine`` also answers) before any work and
refuses, naming both models and the first probe they split differently.

Its logprobs must be those of its own sampling: distillation reads the teacher through its
scoring route (``prompt_logprobs``), so a server whose scores are not the distribution it
samples from (a sampler that applies a generation config's penalties, scores placed one
position off, another model behind the route) teaches something else than the teacher, in
silence. :func:`check_logprobs` samples a few short completions from the teacher with their
logprobs and scores the same tokens through the scoring route; the largest per-token gap is
the run's ``teacher/logprob_check_max_abs_diff``, which ``asyncrl doctor`` holds against
``teacher.check_tolerance``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.frozen.client import FrozenModel, FrozenModelError
from asyncrl.types import Trajectory
from asyncrl.weight_sync.delivery import PROBE_MAX_PROMPT, PROBE_TEXTS

PROBES = ("The quick brown fox jumps over 13 lazy dogs.", "def f(x):\n    return x**2  # ∑ é 😀",
          "<|im_start|>user\n2+3=<|im_end|>")


class TokenizerMismatch(ValueError):
    """The teacher's tokenizer is not the student's."""


async def check_tokenizer(teacher: FrozenModel, tokenizer: Any, student: str) -> None:
    """Refuse a teacher whose token ids differ from ``tokenizer``'s on the probes."""
    for text in PROBES:
        ours = tokenizer.encode(text, add_special_tokens=False)
        reply = await teacher.post_root("/tokenize", {"model": await teacher.served_model(), "prompt": text,
                                                       "add_special_tokens": False})
        theirs = reply.get("tokens")
        if theirs != ours:
            raise TokenizerMismatch(
                f"the teacher {teacher.model!r} at {teacher.url} tokenizes {text!r} as {str(theirs)[:80]}, the "
                f"student {student} as {str(ours)[:80]}: distillation scores the student's token ids, so both "
                "must share one tokenizer (pick a teacher of the student's family)")


async def score_group(teacher: FrozenModel, trajectories: list[Trajectory]) -> None:
    """Fill each trajectory's ``teacher_logprobs``: the teacher's logprob of every response token
    given everything before it, in one batched call for the group."""
    sequences = [t.prompt_ids + t.response_ids for t in trajectories]
    scored = await teacher.token_logprobs(sequences)
    for trajectory, logprobs in zip(trajectories, scored, strict=True):
        start = len(trajectory.prompt_ids) - 1  # logprobs[i] is of token i + 1 of the sequence
        response = logprobs[start:]
        if len(response) != len(trajectory.response_ids):
            raise FrozenModelError(f"{teacher}: {len(response)} logprobs for {len(trajectory.response_ids)} "
                                   "response tokens")
        trajectory.teacher_logprobs = response


CHECK_TOKENS = 8
"""Tokens the teacher samples per probe prompt for :func:`check_logprobs`."""
TOKEN_PREFIX = "token_id:"
"""vLLM's spelling of a sampled token under ``return_tokens_as_token_ids``."""


@dataclass(frozen=True)
class LogprobCheck:
    """The teacher's sampled logprobs against its scores of the same tokens: the largest
    |Δ| over ``tokens`` tokens, at token ``position`` of the completion of probe ``probe``."""

    max_abs_diff: float
    tokens: int
    probe: int
    position: int

    def row(self) -> dict[str, float | int]:
        """The keys a step row carries (``asyncrl doctor`` reads them)."""
        return {"teacher/logprob_check_max_abs_diff": self.max_abs_diff, "teacher/logprob_check_tokens": self.tokens}


def probe_prompts(tokenizer: Any) -> list[list[int]]:
    """The weight-delivery probe's prompts in the student's (= the teacher's) token ids."""
    prompts = [tokenizer.encode(text, add_special_tokens=False)[:PROBE_MAX_PROMPT] for text in PROBE_TEXTS]
    return [p for p in prompts if p]


async def sample_with_logprobs(teacher: FrozenModel, prompt: list[int], seed: int) -> tuple[list[int], list[float]]:
    """``CHECK_TOKENS`` tokens the teacher samples after ``prompt`` at temperature 1 with its own
    sampling settings otherwise, and the logprob it reports for each (vLLM's ``logprobs=0``
    with ``return_tokens_as_token_ids``; ``asyncrl serve-engine`` answers the same)."""
    body = {"model": await teacher.served_model(), "prompt": prompt, "max_tokens": CHECK_TOKENS,
            "temperature": 1.0, "logprobs": 0, "return_tokens_as_token_ids": True, "seed": seed}
    reply = await teacher.post("/completions", body)
    try:
        logprobs = reply["choices"][0]["logprobs"]
        tokens = [int(str(t).removeprefix(TOKEN_PREFIX)) for t in logprobs["tokens"]]
        values = [float(v) for v in logprobs["token_logprobs"]]
    except (KeyError, IndexError, TypeError, ValueError):
        raise FrozenModelError(f"{teacher}: /v1/completions with logprobs=0 and return_tokens_as_token_ids answered "
                               f"without its sampled tokens' logprobs: {str(reply)[:300]}") from None
    if len(tokens) != len(values) or not tokens:
        raise FrozenModelError(f"{teacher}: /v1/completions sampled {len(tokens)} tokens with {len(values)} logprobs")
    return tokens, values


async def check_logprobs(teacher: FrozenModel, prompts: list[list[int]]) -> LogprobCheck:
    """Sample a completion of each prompt from the teacher, score prompt + completion through
    its scoring route (:meth:`FrozenModel.token_logprobs`, what distillation asks) and compare
    per token. Both routes run the teacher's weights in its dtype on its server; they differ
    in how the forward pass is batched (decoding one token at a time with a KV cache against
    one pass over the whole sequence), hence only in float summation order."""
    sampled = [await sample_with_logprobs(teacher, prompt, seed) for seed, prompt in enumerate(prompts)]
    scored = await teacher.token_logprobs([prompt + tokens for prompt, (tokens, _) in zip(prompts, sampled)])
    worst = LogprobCheck(0.0, 0, 0, 0)
    tokens = 0
    for probe, ((completion, reported), scores) in enumerate(zip(sampled, scored, strict=True)):
        for position, (a, b) in enumerate(zip(reported, scores[-len(completion):], strict=True)):
            gap = abs(a - b)
            if gap > worst.max_abs_diff or gap != gap:  # NaN is the worst there is
                worst = LogprobCheck(gap, 0, probe, position)
        tokens += len(completion)
    return LogprobCheck(worst.max_abs_diff, tokens, worst.probe, worst.position)
