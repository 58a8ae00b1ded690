"""Run a tinker-cookbook recipe module unchanged, on SmolLM2 served by ``asyncrl serve-tinker``.

    python run_recipe.py tinker_cookbook.recipes.sl_basic model_name=/path/to/smollm2 base_url=URL ...

The recipe runs as ``python -m MODULE ARGS`` would run it. One thing is added first: the
cookbook's model table (``tinker_cookbook.model_info``) gets an entry for the model the
recipe's ``model_name=`` names (SmolLM2's directory, which ``asyncrl models get
smollm2-135m-instruct`` prints; ``$SMOLLM2_PATH`` where the recipe is given none), so that the
recipes that look their renderer up by model name (``sl_basic``, ``rl_basic``, ...) find one:
SmolLM2-Instruct speaks ChatML, which the cookbook's ``qwen3_instruct`` renderer writes
(``<|im_start|>role\\n...<|im_end|>``, no ``<think>``). The table knows Llama, Qwen, DeepSeek,
gpt-oss, Kimi, GLM, Nemotron and Inkling only, and raises on any other name. Nothing else is
touched; the tokenizer is loaded from the path by the cookbook itself (no hub).
"""

from __future__ import annotations

import os
import runpy
import sys

from tinker_cookbook import model_info

SMOLLM2 = next((arg.split("=", 1)[1] for arg in sys.argv[2:] if arg.startswith("model_name=")),
               os.environ.get("SMOLLM2_PATH", ""))
_table = model_info.get_model_attributes


def get_model_attributes(model_name: str) -> model_info.ModelAttributes:
    if SMOLLM2 and model_name.split(":", 1)[0].rstrip("/") == SMOLLM2.rstrip("/"):
        return model_info.ModelAttributes(organization="HuggingFaceTB", version_str="SmolLM2-135M-Instruct",
                                          size_str="135M", is_chat=True,
                                          recommended_renderers=("qwen3_instruct", "role_colon"))
    return _table(model_name)


model_info.get_model_attributes = get_model_attributes

if __name__ == "__main__":
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
