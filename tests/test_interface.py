"""The names users and scripts rely on (the project's interface list: commands, config keys
and values, gateway routes, a run's files, metric and sample keys, bench keys) each exist,
and every import path the docs or examples ever taught still imports, warning with the new
path. The lists are copied here from the interface the project promises, because users
never see it: a rename that drops one fails here, naming it."""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

import pytest

import asyncrl
from asyncrl.cli import _parser
from asyncrl.config import Config, all_keys, load_config

ROOT = Path(asyncrl.__file__).parent

COMMANDS = ["train", "eval", "bench", "report", "serve", "models", "plan", "doctor", "sft", "serve-engine",
            "serve-tinker"]
BENCH_SUITES = ["engine", "modes", "trl", "staleness", "sync"]
CONFIG_KEYS = [
    "output_dir", "seed", "model.path", "task.name", "mode", "max_staleness", "partial_rollout", "total_steps",
    "batch_size", "group_size", "eval_every", "save_every", "resume", "runtime", "engine",
    "ray.num_rollout_workers", "gateway.host", "gateway.port", "workflow.name", "workflow.agent",
    "rollout.max_concurrent_episodes", "learner.world_size", "learner.strategy", "weight_sync",
    "hooks.on_policy_updated", "hooks.on_epoch_end", "hooks.on_step_end", "gateway.api_key", "gateway.tool_parser",
    "learner.streaming", "model.lora", "task.sampler", "sync_every", "teacher.url", "teacher.coef", "judge.url",
    "remote.urls", "engine_server.host", "engine_server.port", "tinker.host", "tinker.port",
]
CONFIG_VALUES = [  # key=value as a script writes it (then what it needs beside it): each is accepted
    ["mode=sync", "partial_rollout=off"], ["mode=one_step_off"], ["mode=async"], ["partial_rollout=abort"],
    ["partial_rollout=continue"], ["partial_rollout=off"], ["runtime=local"], ["runtime=ray"], ["engine=torch"],
    ["engine=vllm"], ["learner.strategy=fsdp2"], ["learner.strategy=ddp"], ["weight_sync=collective"],
    ["weight_sync=object_store"], ["workflow.name=openai_agent", "workflow.agent=examples/openai_agent/agent.py:run"],
    ["gateway.tool_parser=auto"], ["model.lora=null"], ["engine=remote", "remote.urls=[http://127.0.0.1:8100]"],
    ["mode=async", "max_staleness=0.5"],
]
GATEWAY_ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health"]
RUN_FILES = ["config.yaml", "metrics.jsonl", "samples.jsonl", "eval.json", "report.html", "errors.jsonl"]
METRIC_KEYS = ["step", "version", "reward/mean", "staleness/mean", "staleness/max", "time/step", "time/elapsed",
               "trainer/idle_ratio", "rollout/idle_ratio", "throughput/samples_per_s", "throughput/tokens_per_s"]
EVAL_METRIC_KEYS = ["eval/reward_mean"]
SAMPLE_KEYS = ["step", "task_id", "reward", "behavior_version_min", "behavior_version_max", "trained_version",
               "response_tokens", "finish_reason", "resumed"]
EVAL_JSON_KEYS = ["mean_reward", "pass@1", "num_tasks", "samples_per_task"]
BENCH_KEYS = {  # suite -> keys its bench.json holds (read from the suite's source: a bench run takes minutes)
    "engine": ["tokens_per_s", "ratio_vs_generate_uniform", "ratio_vs_generate_longtail"],
    "modes": ["samples_per_s", "wall_s", "trainer_idle_ratio", "rollout_idle_ratio", "staleness_max", "final_reward",
              "async_speedup_vs_sync", "ideal_overlap_bound", "overlap_efficiency", "peak_rss_mb"],
    "trl": ["samples_per_s", "wall_s", "final_reward", "time_to_target_s", "sync_vs_trl_samples_per_s",
            "async_vs_trl_time_to_target", "async_vs_trl_samples_per_s"],
    "staleness": ["rows", "eta", "objective", "num_seeds", "final_reward_mean", "final_reward_ci95",
                  "reward_per_sample", "wall_s", "staleness_mean", "staleness_max", "is_weight_mean",
                  "is_truncated_fraction", "ess"],
    "sync": ["object_store_s", "collective_s", "ratio"],  # sync_s per method, as <method>_s
}

# Promised, and being added as this list was written: NOT asserted. Whoever lands one moves it
# into the lists above (so it is asserted from then on).
PENDING: dict[str, list[str]] = {}

TAUGHT_IMPORTS = {  # every path docs/, README.md or examples/ ever taught (git log -p), and its home now
    "asyncrl.client": "asyncrl.rollout.client",
    "asyncrl.workflows": "asyncrl.rollout.workflows",
    "asyncrl.gateway": "asyncrl.rollout.gateway",
    "asyncrl.tasks.verifiers_env": "asyncrl.rollout.workflows.verifiers_agent",  # workflow.agent: ...:run
}
TAUGHT_NAMES = [  # (module, names) as the examples imported them
    ("asyncrl.client", ["Message", "Response"]),
    ("asyncrl.workflows", ["MultiTurnWorkflow", "WorkflowContext", "score"]),
    ("asyncrl.workflows.base", ["WorkflowContext", "run_episode"]),
    ("asyncrl.gateway", ["Gateway", "ParsedReply", "ToolCall", "hermes"]),
    ("asyncrl.tasks", ["Task"]),
    ("asyncrl.tasks.countdown", ["FORMAT_REWARD", "countdown_reward", "parse_expression"]),
    ("asyncrl.tasks.multihop", ["multihop_corpus", "multihop_reward", "write_corpus"]),
    ("asyncrl.tools.mcp_tools", ["MCPTools"]),
    ("asyncrl.tools.retrieval", ["RetrievalClient", "RetrievalError"]),
    ("asyncrl.plugins", ["load_named"]),
    ("asyncrl.policy", ["resolve_model_path"]),
    ("asyncrl.rollout.gateway.tool_calls", ["hermes"]),
    ("asyncrl.tasks.verifiers_env", ["run", "load_verifiers_splits", "prompt_messages", "score_reply",
                                     "verifiers_tasks"]),
]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_command_and_bench_suite_is_in_the_parser():
    commands = _subcommands(_parser())
    assert [c for c in COMMANDS if c not in commands] == []
    [suite] = [a for a in commands["bench"]._actions if a.dest == "suite"]
    assert [s for s in BENCH_SUITES if s not in suite.choices] == []


def test_every_config_key_is_in_the_config_model_and_each_value_is_accepted():
    keys = all_keys(Config)
    assert [k for k in CONFIG_KEYS if k not in keys and not any(x.startswith(k + ".") for x in keys)] == []
    for overrides in CONFIG_VALUES:
        key, _, value = overrides[0].partition("=")
        held = load_config(ROOT.parent / "examples/countdown/async.yaml", overrides)
        for part in key.split("."):
            held = getattr(held, part)
        if key == "weight_sync":
            held = held.method
        assert str(held if held is not None else "null") == value, overrides


def test_every_gateway_route_is_served():
    """The routes of a started gateway (a free port, stopped in ``finally``), and each under
    a training episode's session prefix."""
    import asyncio

    from asyncrl.rollout.gateway import Gateway, get_format

    async def routes() -> set[str]:
        gateway = Gateway(None, get_format("hermes"), model_name="m")
        await gateway.start()
        try:
            return {r.resource.canonical for r in gateway._runner.app.router.routes()}
        finally:
            await gateway.stop()

    served = asyncio.run(routes())
    assert [r for r in GATEWAY_ROUTES if r not in served] == []
    assert [r for r in GATEWAY_ROUTES if r != "/health" and "/sessions/{session}" + r not in served] == []


def test_a_steps_metric_row_and_its_samples_hold_every_promised_key():
    from asyncrl.orchestrator.buffer import ReadyGroup
    from asyncrl.orchestrator.metrics import StepTimes, eval_metrics, sample_rows, step_row
    from asyncrl.rollout.eval_scoring import EvalResult
    from asyncrl.types import Episode, Group, Trajectory

    t = Trajectory(prompt_ids=[0], response_ids=[5, 6], loss_mask=[1, 1], logprobs=[0.0, 0.0], versions=[0, 0],
                   reward=1.0)
    groups = [ReadyGroup(Group("t", [Episode(task_id="t", trajectories=[t], reward=1.0)], advantages=[0.0]), 0)]
    row = step_row(1, 1, 0, groups, [t], {}, StepTimes(2.0, 0.5, 1.0, 10.0), [1.0], {}, {})
    assert [k for k in METRIC_KEYS if k not in row] == []
    result = EvalResult(mean_reward=1.0, pass_at={1: 1.0}, num_tasks=1, samples_per_task=1, num_errors=0,
                        episodes=[])
    assert [k for k in EVAL_METRIC_KEYS if k not in eval_metrics(result, 1, 0.1)] == []
    assert [k for k in EVAL_JSON_KEYS if k not in result.summary()] == []
    [sample] = sample_rows(1, 0, groups, lambda ids: "x" * len(ids))
    assert [k for k in SAMPLE_KEYS if k not in sample] == []


def test_every_output_file_and_bench_key_is_written_somewhere():
    """A run's files and the bench keys, by name in the code that writes them (a run or a
    benchmark takes minutes; the keys' values are the runs' own tests')."""
    source = "\n".join(p.read_text() for p in ROOT.rglob("*.py"))
    assert [f for f in RUN_FILES if f'"{f}"' not in source] == []
    for suite, keys in BENCH_KEYS.items():
        text = (ROOT / "bench" / f"{suite}.py").read_text()
        assert [k for k in keys if not re.search(rf"\b{k}\b", text)] == [], suite


def fresh_import(name: str) -> tuple[object, list[str]]:
    """``name`` imported anew (an alias warns once, at its first import: forget it and the
    names it registered under itself first), and the warnings the import gave."""
    import importlib

    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]  # only the alias's own names: the modules they point at stay loaded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [str(w.message) for w in caught if w.category is DeprecationWarning]


@pytest.mark.parametrize("old", list(TAUGHT_IMPORTS))
def test_a_moved_import_path_still_imports_warning_with_the_new_one(old):
    import importlib

    new = TAUGHT_IMPORTS[old]
    module, said = fresh_import(old)
    assert len(said) == 1 and new in said[0] and old in said[0], said
    if old != "asyncrl.tasks.verifiers_env":  # a module split in two: its names (below), not one module
        assert module is importlib.import_module(new) is sys.modules[old]


def test_every_taught_name_imports():
    import importlib

    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for module, names in TAUGHT_NAMES:
            found = importlib.import_module(module)
            missing += [f"{module}.{n}" for n in names if not hasattr(found, n)]
    assert missing == []
    from asyncrl.rollout.workflows.base import WorkflowContext

    assert sys.modules["asyncrl.workflows.base"].WorkflowContext is WorkflowContext  # one class, not a copy


RENAMED_NAMES = [  # (module where the old name was importable, old name, its replacement there)
    (module, old, new) for module in ("asyncrl.rollout.gateway.tool_calls.formats",  # where they were defined
                                      "asyncrl.rollout.gateway.tool_calls", "asyncrl.rollout.gateway")
    for old, new in (("PARSERS", "FORMATS"), ("get_parser", "get_format"))
]


@pytest.mark.parametrize("module,old,new", RENAMED_NAMES)
def test_a_renamed_name_still_imports_where_it_was_warning_at_the_importing_line(module, old, new):
    """A user's ``from <module> import PARSERS`` keeps working where the name lived, the
    warning naming the replacement and pointing at the user's line, not at ours."""
    import importlib

    importlib.import_module(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(module), old)
    [said] = [w for w in caught if w.category is DeprecationWarning]
    assert f"{old} is deprecated: use" in str(said.message) and new in str(said.message), str(said.message)
    assert said.filename == __file__, said.filename
    replacement = getattr(importlib.import_module("asyncrl.rollout.gateway.tool_calls.formats"), new)
    assert value is replacement


def test_the_sandbox_keeps_its_promised_signature_and_result():
    import dataclasses
    import inspect

    from asyncrl.tools.sandbox import SandboxResult, run_python

    params = inspect.signature(run_python).parameters
    assert inspect.iscoroutinefunction(run_python)
    assert list(params)[:1] == ["code"] and all(params[k].kind is params[k].KEYWORD_ONLY
                                                 for k in ("timeout_s", "memory_mb", "files"))
    assert params["files"].default is None
    assert {"exit_code", "stdout", "stderr", "stopped_by"} <= {f.name for f in dataclasses.fields(SandboxResult)}
