"""``asyncrl sft``: cold-start supervised fine-tuning on a user's own conversations, so a
model writes the tool-call format before RL starts (docs/agents.md, "Before RL").

``config.py`` (the command's keys), ``data.py`` (JSONL conversations, checked line by
line), ``render.py`` (a conversation as ids and a loss mask, rendered as the gateway
renders it), ``batches.py`` (step order, micro-batches, the labels) and ``trainer.py``
(the run: its loss through the training core's one micro-batch loop, held-out loss,
checkpoints, a stop that saves), ``ranks.py`` (``learner.world_size`` > 1: the rank
processes and their driver).
"""
