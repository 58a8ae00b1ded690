"""``python -m asyncrl.learner.lora_merge CHECKPOINT OUT [BASE]``: a LoRA run's checkpoint
as a plain Hugging Face model directory (:func:`asyncrl.learner.lora.save_merged`), for
``asyncrl eval``, vLLM or sharing. A module of its own so that ``-m`` runs it without
``asyncrl.learner`` having imported it first."""

from __future__ import annotations

import sys

from asyncrl.learner.lora import save_merged

if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m asyncrl.learner.lora_merge CHECKPOINT_DIR OUT_DIR [BASE_MODEL]")
    print(save_merged(*sys.argv[1:]))
