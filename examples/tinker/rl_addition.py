"""Tinker's RL loop, written against Tinker's own SDK, on ``asyncrl serve-tinker``.

    asyncrl serve-tinker examples/tinker/serve.yaml          # prints its URL
    python examples/tinker/rl_addition.py URL [steps [learning_rate]]

The loop is the shape of the cookbook's RL recipes: a sampler of the current weights draws a
group of answers per prompt (``num_samples``), each answer is scored, the advantages are the
rewards minus the group's mean, and ``forward_backward(..., "importance_sampling")`` then
``optim_step`` train the LoRA adapters; every step saves the weights for the next sampler.
Nothing here is asyncrl's: only the URL points at it. The task is asyncrl's two-operand
addition (``a+b=``, the shipped tiny policy), so the held-out score compares with
``asyncrl train examples/addition/sync.yaml``.
"""

from __future__ import annotations

import random
import sys

import tinker
from tinker import types

BASE = "addition-tiny"
GROUP, BATCH = 8, 8


def problems(seed: int, n: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(f"{a}+{b}=", a + b) for a, b in ((rng.randint(0, 19), rng.randint(0, 19)) for _ in range(n))]


def reward(tokenizer, tokens: list[int], answer: int) -> float:
    text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return float(text == str(answer))


def score(sampler, tokenizer, held_out: list[tuple[str, int]]) -> float:
    """Mean reward of GROUP samples a held-out prompt."""
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    futures = [(sampler.sample(types.ModelInput.from_ints(tokenizer.encode(p)), GROUP, params), a)
               for p, a in held_out]
    rewards = [reward(tokenizer, s.tokens, a) for f, a in futures for s in f.result().sequences]
    return sum(rewards) / len(rewards)


def main(url: str, steps: int, lr: float) -> None:
    service = tinker.ServiceClient(base_url=url, api_key="tml-local")
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    held_out = problems(seed=1, n=48)
    held = {p for p, _ in held_out}  # never trained on
    sampler = training.save_weights_and_get_sampling_client().result()
    print(f"step 0: held-out reward {score(sampler, tokenizer, held_out):.3f}", flush=True)
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    for step in range(1, steps + 1):
        batch = [x for x in problems(seed=100 + step, n=4 * BATCH) if x[0] not in held][:BATCH]
        prompts = [tokenizer.encode(p) for p, _ in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(ids), GROUP, params) for ids in prompts]
        data, rewards = [], []
        for ids, (_, answer), future in zip(prompts, batch, futures):
            sequences = future.result().sequences
            group = [reward(tokenizer, s.tokens, answer) for s in sequences]
            mean = sum(group) / len(group)
            rewards += group
            for seq, r in zip(sequences, group):
                if r == mean:
                    continue  # no advantage: nothing to learn from this answer
                tokens = ids + seq.tokens
                pad = [0.0] * (len(ids) - 1)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": pad + list(seq.logprobs),
                                    "advantages": pad + [r - mean] * len(seq.tokens)}))
        if data:
            training.forward_backward(data, "importance_sampling")
            training.optim_step(types.AdamParams(learning_rate=lr)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        line = f"step {step}: train reward {sum(rewards) / len(rewards):.3f}"
        if step % 10 == 0 or step == steps:
            line += f", held-out reward {score(sampler, tokenizer, held_out):.3f}"
        print(line, flush=True)
    service.close("success").result()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 100, float(sys.argv[3]) if len(sys.argv) > 3 else 1e-3)
