"""Held-out figures for the cookbook recipes, with the cookbook's own evaluators, against
any sampler of the server (the base model, or a run's final ``sampler_path``):

    python evaluate.py arithmetic URL MODEL [SAMPLER_PATH]    # math_rl's arithmetic env
    python evaluate.py nll URL MODEL [SAMPLER_PATH]           # sl_basic's held-out conversations
    python evaluate.py counting URL MODEL [SAMPLER_PATH] --max-tokens 40 --task page_chars=1500 ...
                                                              # rl_numerics_check's tool-use env

``arithmetic``: ``RLTestSetEvaluator`` over the recipe's own ``ArithmeticDataset`` (few-shot
prefix, reward 1 for the right sum minus 0.1 without the stop token), on the batch drawn with
seed 1000 — the recipe trains on the batches of seeds 0..99 (``n_batches=100``), so these
problems are fresh draws (x, y uniform in 0..100), ``--groups`` of them × ``--group-size``
samples at T = 1, ``--max-tokens`` as the recipe's 5.
``nll``: ``SamplerNLLEvaluator`` on the test split ``FromConversationFileBuilder`` makes of the
cookbook's ``example_data/conversations.jsonl`` (``--test-size`` 16, shuffle seed 0), as the
supervised trainer does at its eval steps.
``counting``: ``RLTestSetEvaluator`` over ``rl_numerics_check``'s own ``CountingDatasetBuilder``
(whole episodes: ``read_page`` calls, then ``Answer: N``), on the batch of seed 1000 — the recipe
trains on seed 0's batches, ``make_counting_sft.py`` on ``sft-<i>`` — with the RL run's ``task.*``
settings (``--task FIELD=VALUE ...``); run it in the directory ``make_counting_corpus.py`` wrote
(the pages come from there). A pure Tinker user: ``tinker`` and
``tinker_cookbook`` only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import chz
import tinker

import run_recipe  # noqa: F401  (SmolLM2 in the cookbook's model table)
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset
from tinker_cookbook.recipes.rl_numerics_check.env import CountingDatasetBuilder, CountingTaskConfig
from tinker_cookbook.rl.metric_util import RLTestSetEvaluator
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.nll_evaluator import SamplerNLLEvaluator
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import get_tokenizer

import tinker_cookbook

CONVERSATIONS = str(Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl")


class HeldOut(ArithmeticDataset):
    """The recipe's dataset, but its one batch is the one seed ``seed`` draws."""

    def __init__(self, seed: int, **kw):
        super().__init__(n_batches=1, **kw)
        self.seed = seed

    def get_batch(self, index: int):
        return super().get_batch(self.seed + index)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["arithmetic", "nll", "counting"])
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("sampler_path", nargs="?")
    p.add_argument("--renderer", default="qwen3_instruct")
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=5)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--test-size", type=int, default=16)
    p.add_argument("--task", nargs="*", default=[], help="counting: the RL run's task.* settings, FIELD=VALUE")
    a = p.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    service = tinker.ServiceClient(base_url=a.url)
    sampler = await (service.create_sampling_client_async(model_path=a.sampler_path) if a.sampler_path
                     else service.create_sampling_client_async(base_model=a.model))
    tokenizer = get_tokenizer(a.model)
    renderer = renderers.get_renderer(a.renderer, tokenizer)
    t0 = time.time()
    if a.what == "arithmetic":
        data = HeldOut(a.seed, batch_size=a.groups, renderer=renderer, group_size=a.group_size)
        metrics = await RLTestSetEvaluator(data, max_tokens=a.max_tokens, num_groups_to_log=0)(sampler)
    elif a.what == "counting":
        task = chz.entrypoint(CountingTaskConfig, argv=[t.removeprefix("task.") for t in a.task])
        counting, _ = await CountingDatasetBuilder(
            batch_size=a.groups, group_size=a.group_size, model_name_for_tokenizer=a.model,
            renderer_name=a.renderer, task=task, seed=a.seed, n_batches=1,
            max_generation_tokens=a.max_tokens)()
        metrics = await RLTestSetEvaluator(counting, max_tokens=a.max_tokens, num_groups_to_log=0)(sampler)
    else:
        common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=a.model, renderer_name=a.renderer,
                                                max_length=32768, batch_size=8,
                                                train_on_what=renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES)
        _, test = FromConversationFileBuilder(common_config=common, file_path=CONVERSATIONS,
                                              test_size=a.test_size)()
        datums = [d for i in range(len(test)) for d in test.get_batch(i)]
        metrics = await SamplerNLLEvaluator(datums, tokenizer=tokenizer)(sampler)
    metrics["eval_seconds"] = round(time.time() - t0, 1)
    print(json.dumps({"what": a.what, "sampler": a.sampler_path or a.model, **metrics}))


if __name__ == "__main__":
    asyncio.run(main())
