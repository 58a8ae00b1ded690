"""The learner's forward pass with each distinct prompt run once.

GRPO samples ``group_size`` responses per task, and every one of them repeats the task's
prompt: on Countdown (a 30-token prompt, ~8-token answers, 8 samples) a padded batch is
three quarters prompt. A response's logprobs depend on its prompt only through the
prompt's keys and values, so the prompts can be prefilled once, their cache rows copied
to every response that shares them (an ``index_select``: its backward adds the rows'
gradients back up), and the responses run on top. Same logprobs and gradients up to
float rounding, as the engine's group prefill is for sampling.

Layout: the padded batch is right-padded on the target axis (``asyncrl/learner/batch.py``);
here prompts are left-padded (so that their last position, which predicts a response's
first token, is one column for all) and responses right-padded, and the result is put
back on the target axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.engine.hf_cache import filled_layers, forward_with_cache
from asyncrl.learner.batch import TrainBatch


@dataclass
class ResponseLogits:
    logits: torch.Tensor  # (B, R, V): the logits that predict response token j of each row, at j
    targets: torch.Tensor  # (B, R): the response tokens (0 past a row's end)
    columns: torch.Tensor  # (B, L-1): the response index j of each target-axis column, clamped
    on_response: torch.Tensor  # (B, L-1) bool: the column is one of the row's response tokens

    def to_target_axis(self, per_token: torch.Tensor) -> torch.Tensor:
        """A (B, R) per-response-token tensor laid out on the batch's (B, L-1) target axis
        (prompt and padding columns 0, as the learner's masks expect)."""
        return per_token.gather(1, self.columns) * self.on_response


WORTH = 0.7
"""Share prompts only where the two passes cover at most this fraction of the whole rows'
padded positions: a second pass costs its own per-layer overhead, and where responses are
long and prompts short (the long-tail benchmark: 15-token prompts, responses up to 160)
sharing saved little and made the learner's steps slower (docs/design.md has the figure)."""


def prompt_index(batch: TrainBatch) -> tuple[list[list[int]], torch.Tensor] | None:
    """The distinct prompts of ``batch`` and each row's index into them; ``None`` when
    sharing them would not pay (:data:`WORTH`) or a row has no response."""
    lengths = batch.attention_mask.sum(-1).tolist()
    starts = batch.prompt_lengths.tolist()
    if any(length <= start for length, start in zip(lengths, starts)):
        return None
    ids = batch.input_ids.tolist()
    keys = [tuple(row[:start]) for row, start in zip(ids, starts)]
    distinct = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    whole = len(keys) * max(lengths)
    shared = (len(distinct) * max(starts) + len(keys) * max(length - start for length, start in zip(lengths, starts)))
    if shared > WORTH * whole:
        return None
    return [list(key) for key in distinct], torch.tensor([distinct[key] for key in keys], device=batch.input_ids.device)


def response_logits(model: PreTrainedModel, batch: TrainBatch, prompts: list[list[int]],
                    index: torch.Tensor) -> ResponseLogits:
    """Two forward passes: the distinct ``prompts`` (left-padded), then every row's response
    on a copy of its prompt's cache rows (``index``: row → prompt)."""
    device = batch.input_ids.device
    width = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    prompt_cache = DynamicCache(config=model.config)
    prefill = forward_with_cache(model, prompt_cache, input_ids=prompt_ids, attention_mask=prompt_mask,
                                 position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0), logits_to_keep=1)
    cache = DynamicCache([(layer.keys.index_select(0, index), layer.values.index_select(0, index))
                          for layer in filled_layers(prompt_cache)], config=model.config)

    starts = batch.prompt_lengths.to(device)
    response_lengths = batch.attention_mask.sum(-1) - starts
    steps = torch.arange(int(response_lengths.max()), device=device)[None]
    inside = steps < response_lengths[:, None]
    seq_len = batch.input_ids.shape[1]
    targets = batch.input_ids.gather(1, (starts[:, None] + steps).clamp(max=seq_len - 1)) * inside
    out = forward_with_cache(model, cache, input_ids=targets,
                             attention_mask=torch.cat([prompt_mask.index_select(0, index), inside.long()], 1),
                             position_ids=starts[:, None] + steps)
    # response token 0 is predicted by the prompt's last position, token j by response position j - 1
    logits = torch.cat([prefill.logits[:, -1:].index_select(0, index), out.logits[:, :-1]], 1)

    j = torch.arange(seq_len - 1, device=device)[None] - (starts[:, None] - 1)  # target column → response index
    return ResponseLogits(logits, targets, j.clamp(0, steps.shape[1] - 1),
                          (j >= 0) & (j < response_lengths[:, None]))
