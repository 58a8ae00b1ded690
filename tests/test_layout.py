"""The package's import graph has no cycle and no import climbs to a higher floor, lazy
imports included: a cycle or a climb hidden behind a function-level import is a part that
does not know which side of a boundary it is on. The floors are stated in docs/design.md
("Floors")."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncrl

ROOT = Path(asyncrl.__file__).parent


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("asyncrl", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):  # every import, at any depth
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    assert "asyncrl.orchestrator.trainer" in graph and graph["asyncrl.orchestrator.trainer"]
    assert cycles(graph) == []


FLOORS = {
    # 0 ground: definitions and plumbing everything shares
    "asyncrl": 0,  # the package's own __init__ only, not a default for the modules under it
    "asyncrl.types": 0, "asyncrl.modes": 0, "asyncrl.config": 0, "asyncrl.config_doc": 0, "asyncrl.seeding": 0,
    "asyncrl.jsonl": 0, "asyncrl.json_api": 0, "asyncrl.heap": 0, "asyncrl.threads": 0, "asyncrl.plugins": 0,
    "asyncrl.core_budget": 0,  # how the engine and the learner share the cores (rollout.thread_sharing)
    "asyncrl.model_store": 0,  # the known models and their cache; the conversion is model_convert (floor 1)
    "asyncrl.moved": 0,  # how a moved public import path stays an alias (the shims below use it)
    "asyncrl.rollout": 0,  # the rollout side's package: its own __init__ (a docstring), and per module below
    "asyncrl.rollout.chat_format": 0, "asyncrl.rollout.journal": 0, "asyncrl.rollout.deadline": 0,
    "asyncrl.engine": 0,  # the engine package's own __init__ (names resolved lazily), and per module below
    "asyncrl.engine.kinds": 0,  # the table of engine kinds: config validates against it
    # 1 parts: one job each
    "asyncrl.tasks": 1, "asyncrl.algorithms": 1, "asyncrl.policy": 1, "asyncrl.learner": 1,
    **{f"asyncrl.engine.{m}": 1 for m in ("protocol", "factory", "torch_engine", "scheduler", "kv_batch", "hf_cache",
                                          "sampling", "adapters", "vllm_engine", "remote", "remote_fleet",
                                          "remote_weights", "remote_wire", "remote_nccl")},
    "asyncrl.model_convert": 1,
    "asyncrl.rollout.eval_scoring": 1, "asyncrl.rollout.client": 1, "asyncrl.tools": 1, "asyncrl.weight_sync": 1,
    "asyncrl.frozen": 1,  # frozen models by URL: the judge, the teacher
    # 2 episodes over the client, and the rollout worker that runs them on an engine
    "asyncrl.rollout.workflows": 2, "asyncrl.rollout.gateway": 2, "asyncrl.rollout.worker": 2,
    # deprecated aliases of paths that moved under asyncrl.rollout, each on the floor of what it aliases
    "asyncrl.client": 1, "asyncrl.workflows": 2, "asyncrl.gateway": 2,
    "asyncrl.tasks.verifiers_env": 2,  # its tasks stayed in tasks/, its agent moved to rollout/workflows/
    "asyncrl.rollout.engine_server": 2,  # asyncrl serve-engine: a worker's engine over vLLM's HTTP API
    # 3 where the parts run
    "asyncrl.runtime": 3,
    # 4 runs: the gate, the loops, the entry points of train, eval, serve and sft
    "asyncrl.orchestrator": 4,
    # asyncrl sft: a run of its own (cold-start SFT), over the gateway's rendering and a learner helper
    "asyncrl.sft": 4,
    # asyncrl serve-tinker: the Tinker API over the training core and the built-in engine
    "asyncrl.tinker": 4,
    # 5 top: what drives or reads whole runs
    "asyncrl.cli": 5, "asyncrl.report": 5, "asyncrl.bench": 5, "asyncrl.tiny": 5, "asyncrl.plan": 5,
}


def floor(module: str, floors: dict[str, int] = FLOORS) -> int | None:
    """The floor of the longest table entry that is ``module`` or a package holding it;
    None for a module nobody placed (the root package is no catch-all)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in floors and (i > 1 or module == prefix):
            return floors[prefix]
    return None


def climbs(graph: dict[str, set[str]], floors: dict[str, int] = FLOORS) -> list[str]:
    """Every import that goes to a higher floor. Importing ``a.b.c`` also runs ``a.b``'s
    ``__init__``, so the packages on the way count as imported too (a module's own
    packages ran before it did)."""
    found = []
    for module, targets in sorted(graph.items()):
        here = floor(module, floors)
        for target in sorted(targets):
            parts = target.split(".")
            for name in (".".join(parts[:i]) for i in range(2, len(parts) + 1)):
                there = floor(name, floors)
                if here is not None and there is not None and there > here and not module.startswith(f"{name}."):
                    found.append(f"{module} (floor {here}) -> {name} (floor {there})")
    return sorted(set(found))


def test_the_checker_sees_a_climb():
    floors = {"p.low": 0, "p.high": 1}
    graph = {"p.low.a": {"p.high.b"}, "p.high.b": {"p.low.a"}, "p.low.c": {"p.low.a"}}
    assert climbs(graph, floors) == ["p.low.a (floor 0) -> p.high (floor 1)", "p.low.a (floor 0) -> p.high.b (floor 1)"]
    assert floor("p", floors) is None and floor("p.other", floors) is None


def test_every_module_has_a_floor():
    assert [m for m in import_graph() if floor(m) is None] == [], "place the new module in FLOORS"


def test_no_import_climbs_to_a_higher_floor():
    assert climbs(import_graph()) == []


def test_a_learner_call_is_one_method_on_the_worker_with_the_protocols_parameters():
    """Adding a learner call is a method on ``LearnerWorker``, one on the Protocol and one on
    the one handle (``LearnerGroup``), written out so grep finds the call the trainer makes;
    all three take the same parameters."""
    import inspect

    from asyncrl.runtime.learner_worker import LearnerWorker
    from asyncrl.runtime.protocol import LEARNER_CALLS, LearnerHandle
    from asyncrl.runtime.transport import LearnerGroup

    assert set(LEARNER_CALLS) == {"train_step", "accumulate", "finish_step", "publish", "save_checkpoint",
                                  "load_checkpoint"}
    for name in LEARNER_CALLS:
        declared = inspect.signature(getattr(LearnerHandle, name)).parameters
        worker = [p for p in inspect.signature(getattr(LearnerWorker, name)).parameters
                  if p != "_ray_trace_ctx"]  # added in place by ray.remote when a Ray test ran in this process
        assert worker == list(declared), name
        assert inspect.iscoroutinefunction(getattr(LearnerGroup, name)), name
        assert list(inspect.signature(getattr(LearnerGroup, name)).parameters) == list(declared), name


def test_a_rollout_call_is_one_method_on_the_worker_its_protocol_line_and_one_on_the_group():
    """The rollout side has the learner's shape: every call of ``RolloutHandle`` is written
    out on ``RolloutGroup`` (the one handle over any transport) with the Protocol's
    parameters, and each but the group's own bookkeeping is a ``RolloutWorker`` method."""
    import inspect

    from asyncrl.runtime.protocol import RolloutHandle
    from asyncrl.runtime.rollout_group import RolloutGroup
    from asyncrl.rollout.worker import RolloutWorker

    calls = [name for name in vars(RolloutHandle) if not name.startswith("_") and name != "restarts"]
    assert set(calls) >= {"run_group", "in_flight", "evaluate", "sync_weights", "apply", "engine_work",
                          "gateway_counts", "shutdown"}
    for name in calls:
        declared = list(inspect.signature(getattr(RolloutHandle, name)).parameters)
        assert list(inspect.signature(getattr(RolloutGroup, name)).parameters) == declared, name
        assert inspect.iscoroutinefunction(getattr(RolloutGroup, name)), name
        assert inspect.iscoroutinefunction(getattr(RolloutWorker, name)), name
