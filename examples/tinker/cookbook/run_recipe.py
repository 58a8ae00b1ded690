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

    python run_recipe.py --default MODULE:CLASS.FIELD=VALUE ... RECIPE ARGS

gives a field the recipe does not put on its command line another default (a string), for
a model name a recipe hard-codes: twenty-questions' answerer is ``Qwen/Qwen3.5-9B``, set in
``TwentyQuestionsDatasetBuilder.answerer_base_model``, which its ``CLIConfig`` does not
expose. ``CLASS`` is replaced in ``MODULE`` by a chz subclass with that default before the
recipe imports it (the recipe's module is run after, so it picks up the subclass); nothing
else of the class changes. A ``--default`` that names no such field stops here, naming it.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys

import chz
from tinker_cookbook import model_info

SMOLLM2 = next((arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith("model_name=")),
               os.environ.get("SMOLLM2_PATH", ""))
_table = model_info.get_model_attributes


def get_model_attributes(model_name: str) -> model_info.ModelAttributes:
    if SMOLLM2 and model_name.split(":", 1)[0].rstrip("/") == SMOLLM2.rstrip("/"):
        return model_info.ModelAttributes(organization="HuggingFaceTB", version_str="SmolLM2-135M-Instruct",
                                          size_str="135M", is_chat=True,
                                          recommended_renderers=("qwen3_instruct", "role_colon"))
    return _table(model_name)


model_info.get_model_attributes = get_model_attributes


def set_default(spec: str) -> None:
    """Apply one ``MODULE:CLASS.FIELD=VALUE``: ``MODULE.CLASS`` becomes a chz subclass whose
    ``FIELD`` defaults to ``VALUE``. Invariant: only that default differs (the subclass is an
    instance of the original, so the recipe's type checks still hold)."""
    target, _, value = spec.partition("=")
    module_name, _, dotted = target.partition(":")
    class_name, _, field = dotted.rpartition(".")
    if not (value and module_name and class_name and field):
        sys.exit(f"run_recipe.py: --default {spec!r}: write it MODULE:CLASS.FIELD=VALUE")
    module = importlib.import_module(module_name)
    base = getattr(module, class_name, None)
    if base is None or field not in getattr(base, "__chz_fields__", {}):
        sys.exit(f"run_recipe.py: --default {spec!r}: {module_name}.{class_name} has no chz field "
                 f"{field!r}; name a field of the class the recipe builds")
    subclass = chz.chz(type(class_name, (base,), {"__annotations__": {field: str}, field: value,
                                                  "__module__": module_name}))
    setattr(module, class_name, subclass)


if __name__ == "__main__":
    args = sys.argv[1:]
    while len(args) >= 2 and args[0] == "--default":
        set_default(args[1])
        args = args[2:]
    module, sys.argv = args[0], [args[0], *args[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
