"""The engine kinds table: every kind buildable by the one factory, what each can do read
from its row, and no caller anywhere asking an engine's name."""

from __future__ import annotations

import ast
import asyncio
import copy
import importlib
import inspect
from pathlib import Path

import aiohttp
import pytest

from asyncrl.config import ConfigError, EngineServerConfig, GatewayConfig, RemoteConfig, load_config
from asyncrl.engine import TorchEngine
from asyncrl.config.engine_kinds import ENGINE_KINDS, engine_kind
from asyncrl.engine.remote import RemoteEngine
from asyncrl.learner.export import update_kind
from asyncrl.rollout.client import stop_token_ids
from asyncrl.rollout.engine_server import EngineServer
from asyncrl.rollout.gateway import Gateway
from asyncrl.rollout.gateway.tool_calls import get_format
from asyncrl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncrl"
TABLE = {PACKAGE / "engine" / "kinds.py", PACKAGE / "engine" / "factory.py"}


def test_every_kind_names_a_builder_the_factory_can_call():
    for name, kind in ENGINE_KINDS.items():
        assert kind.name == name
        module, function = kind.builder.split(":")
        builder = getattr(importlib.import_module(module), function)
        assert inspect.iscoroutinefunction(builder), kind.builder
        assert not kind.adapters_merged_locally or "adapters" in kind.deliveries, name
    with pytest.raises(ValueError, match="one of torch, vllm, remote"):
        engine_kind("tgi")


def name_comparisons(source: str) -> list[int]:
    """Lines comparing something with an engine kind's name (``== "vllm"``, ``in ("torch", …)``)."""
    names = set(ENGINE_KINDS)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                found.append(node.lineno)
                break
    return found


def test_the_checker_sees_a_name_comparison():
    assert name_comparisons('if cfg.engine == "vllm":\n    pass\nx = kind in ("torch", "remote")\n') == [1, 3]
    assert name_comparisons('if cfg.engine_kind.in_process:\n    pass\n') == []


def test_no_engine_is_told_apart_by_name_outside_the_table_and_the_factory():
    """Adding a kind touches its module, the table and the docs: no caller compares names.
    (``plan/fleet.py`` compares a server program's kind, ``vllm`` or ``asyncrl``, which is
    what a URL runs, not an engine kind: it is read from the plan's own ``SERVER_KINDS``.)"""
    allowed = TABLE | {PACKAGE / "plan" / "fleet.py"}
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(PACKAGE.rglob("*.py")) if path not in allowed
                 for line in name_comparisons(path.read_text())]
    assert offenders == []


def test_what_a_kind_can_do_decides_the_config_not_its_name():
    remote = ["engine=remote", "remote.urls=[http://127.0.0.1:1]"]
    assert load_config(None, ["mode=async"]).background_eval
    assert not load_config(None, ["mode=async", *remote]).background_eval  # said in the run's first line
    with pytest.raises(ConfigError, match="which engine=remote does on servers of evaluation's own"):
        load_config(None, ["mode=async", "eval.background=true", *remote])
    with pytest.raises(ConfigError, match="which engine=vllm does on servers of evaluation's own"):
        load_config(None, ["mode=async", "eval.background=true", "engine=vllm"])
    assert load_config(None, ["mode=async", "engine=vllm", "eval.urls=[http://127.0.0.1:2]"]).background_eval
    with pytest.raises(ConfigError, match="top_k=0"):
        load_config(None, [*remote, "sampling.top_k=5"])
    with pytest.raises(ConfigError, match="rollout.thread_sharing"):
        load_config(None, [*remote, "mode=async", "rollout.thread_sharing=colocated"])
    # the kind of update follows the row: merged LoRA is a subset where the kind takes one
    from asyncrl.config import LoraConfig
    assert update_kind(LoraConfig(sync="merged"), engine="torch") == "merged"
    assert update_kind(LoraConfig(sync="merged"), engine="remote") == "merged_every_weight"
    assert update_kind(LoraConfig(), engine="torch") == "adapters"
    assert update_kind(LoraConfig(), engine="torch", same_dtype=False) == "merged"  # it would merge in its dtype
    assert update_kind(LoraConfig(), engine="remote", same_dtype=False) == "adapters"  # the servers load them


def test_the_gateways_prompt_check_holds_with_a_remote_engine(char_tokenizer):
    """With ``engine: remote`` the gateway refuses, before tokenizing, a request that cannot
    fit the servers' context (it once looked for an attribute the remote client names
    otherwise, and let every prompt through)."""
    from asyncrl.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(char_tokenizer, seed=0)
    context = model.config.max_position_embeddings

    async def main():
        server = EngineServer(TorchEngine(copy.deepcopy(model).eval(), seed=0), model_name="tiny",
                              settings=EngineServerConfig(port=0))
        await server.start()
        remote = gateway = None
        try:
            remote = await RemoteEngine.connect(RemoteConfig(urls=[server.base_url]))
            assert remote.max_context == context
            gateway = Gateway(tokenizer, get_format("hermes"), model_name="tiny", engine=remote,
                              sampling=SamplingParams(max_tokens=4, stop_token_ids=stop_token_ids(tokenizer)),
                              settings=GatewayConfig())
            await gateway.start()
            messages = [{"role": "user", "content": "1+1="}] * (context + 1)
            async with aiohttp.ClientSession() as http:
                async with http.post(gateway.base_url + "/v1/chat/completions",
                                     json={"model": "tiny", "messages": messages}) as response:
                    return response.status, await response.json()
        finally:
            if gateway is not None:
                await gateway.stop()
            if remote is not None:
                await remote.shutdown()
            await server.stop()
            await server.engine.shutdown()

    status, body = asyncio.run(main())
    assert status == 400, body
    assert f"{context + 1} messages cannot fit the model's context of {context} tokens" in body["error"]["message"]
