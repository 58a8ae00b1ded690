"""The teacher of on-policy distillation: a frozen model by URL that scores the tokens the
student sampled. Its logprobs are fetched per group as soon as the group is scored — on the
rollout side, while other groups generate and the learner trains — in one batched call, under
the client's bound and deadline; a teacher that does not answer fails the group, naming it.

Tokenizers must match: the teacher scores the student's token ids, which mean nothing to a
model with another vocabulary. :func:`check_tokenizer` asks the teacher to tokenize probe
texts (vLLM's ``/tokenize``, which ``asyncrl serve-engine`` also answers) before any work and
refuses, naming both models and the first probe they split differently.
"""

from __future__ import annotations

from typing import Any

from asyncrl.frozen.client import FrozenModel, FrozenModelError
from asyncrl.types import Trajectory

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
