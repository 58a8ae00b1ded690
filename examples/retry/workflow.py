"""A multi-turn workflow to copy: "wrong, try again".

The model answers; the environment checks the answer with the run's reward function
(``task.reward_fn``, or the task's built-in one) and, when it falls short, replies as the
user with feedback, until the model solves the task or has spent ``max_turns`` replies.

Episode reward: the last reply's reward times ``discount ** (turns - 1)``; with a 0/1
reward and the defaults, 1 for a first-turn solve, 0.5 for a solve on the second turn,
0 for none. A solve after feedback still earns credit, a first-turn solve earns more, so
GRPO's group comparison prefers it.

What the client does with it (``asyncrl/rollout/client.py``): the whole conversation is one
trajectory; the model's replies are trained (loss mask 1), the feedback turns and the
template's role markers are environment tokens (mask 0). In ``samples.jsonl`` they are
the ``environment`` parts of ``response_segments``.

Configured by ``examples/retry/train.yaml``; the run builds it as
``RetryWorkflow(ctx, **workflow.options)`` (see ``asyncrl/rollout/workflows/registry.py``).
"""

from __future__ import annotations

from asyncrl.rollout.client import Message, Response
from asyncrl.tasks import Task
from asyncrl.rollout.workflows import MultiTurnWorkflow, WorkflowContext, score


class RetryWorkflow(MultiTurnWorkflow):
    def __init__(self, ctx: WorkflowContext, *, max_turns: int = 2, discount: float = 0.5,
                 solved_at: float = 1.0, feedback: str = "wrong, try again: {prompt}") -> None:
        """``solved_at``: a reply with at least this reward ends the episode. ``feedback``:
        the environment's message after a reply that falls short, a ``str.format``
        template over ``{prompt}``, ``{reward}`` and ``{turn}`` (the reply's number)."""
        super().__init__(max_turns=max_turns)
        if ctx.reward_fn is None:  # a ValueError here exits 2 with this message
            raise ValueError("RetryWorkflow checks each reply with the reward function; set task.reward_fn")
        if not 0 < discount <= 1:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        try:
            feedback.format(prompt="", reward=0.0, turn=1)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"feedback {feedback!r} is not a template over {{prompt}}, {{reward}}, {{turn}}: "
                             f"{exc!r}") from None
        self.reward_fn, self.reward_timeout_s = ctx.reward_fn, ctx.reward_timeout_s
        self.discount, self.solved_at, self.feedback = discount, solved_at, feedback

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.prompt}]

    async def env_step(self, task: Task, messages: list[Message], response: Response) -> tuple[list[Message], bool]:
        turn = _num_replies(messages)
        reward = await score(self.reward_fn, task, response.text, timeout_s=self.reward_timeout_s)
        if reward >= self.solved_at or turn >= self.max_turns:  # no feedback nobody will read
            return [], True
        return [{"role": "user", "content": self.feedback.format(prompt=task.prompt, reward=reward, turn=turn)}], False

    async def reward(self, task: Task, messages: list[Message]) -> float:
        # The last reply is scored again rather than remembered: one workflow object runs
        # many episodes at once, so it keeps no per-episode state. (A reply cut at
        # sampling.max_tokens ends the episode without an env_step; it is scored here too.)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        reward = await score(self.reward_fn, task, replies[-1], timeout_s=self.reward_timeout_s)
        return reward * self.discount ** (len(replies) - 1)


def _num_replies(messages: list[Message]) -> int:
    return sum(m["role"] == "assistant" for m in messages)
