"""``asyncrl sft``: cold-start supervised fine-tuning on a user's own conversations, so a
model writes the tool-call format before RL starts (docs/agents.md, "Before RL").

``config.py`` (the command's keys), ``data.py`` (JSONL conversations, checked line by
line), ``render.py`` (a conversation as ids and a loss mask, rendered as the gateway
renders it), ``batches.py`` (step order, micro-batches, the summed loss) and
``trainer.py`` (the loop: held-out loss, checkpoints, a stop that saves).
"""
