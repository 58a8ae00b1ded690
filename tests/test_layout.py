"""The package's import graph has no cycle, no import climbs to a higher floor and no two
folders import each other, lazy imports included: a cycle or a climb hidden behind a
function-level import is a part that does not know which side of a boundary it is on. The
floors are ``FLOORS`` below, and the tables of docs/design.md ("Floors") and docs/layout.md
("The floors") state them: each table lists every entry, on its floor."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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
    "asyncrl.weight_updates": 0,  # what a weight sync sends, typed: both sides speak it
    "asyncrl": 0,  # the package's own __init__ only, not a default for the modules under it
    "asyncrl.types": 0, "asyncrl.modes": 0, "asyncrl.config": 0, "asyncrl.config_doc": 0, "asyncrl.seeding": 0,
    "asyncrl.jsonl": 0, "asyncrl.json_api": 0, "asyncrl.heap": 0, "asyncrl.threads": 0, "asyncrl.plugins": 0,
    "asyncrl.core_budget": 0,  # how the engine and the learner share the cores (rollout.thread_sharing)
    "asyncrl.model_store": 0,  # the known models and their cache; the conversion is model_convert (floor 1)
    "asyncrl.moved": 0,  # how a moved public import path stays an alias (the shims below use it)
    "asyncrl.rollout": 0,  # the rollout side's package: its own __init__ (a docstring), and per module below
    "asyncrl.rollout.chat_format": 0, "asyncrl.rollout.journal": 0, "asyncrl.rollout.deadline": 0,
    # 1 parts: one job each
    "asyncrl.tasks": 1, "asyncrl.algorithms": 1, "asyncrl.policy": 1, "asyncrl.learner": 1,
    "asyncrl.engine": 1,
    "asyncrl.model_convert": 1,
    "asyncrl.model_untie": 1,  # a tied LM head's model copied untied (asyncrl models untie); the remote engine asks it
    "asyncrl.rollout.eval_scoring": 1, "asyncrl.rollout.client": 1, "asyncrl.tools": 1, "asyncrl.weight_sync": 1,
    "asyncrl.frozen": 1,  # frozen models by URL: the judge, the teacher
    # 2 episodes over the client, and the rollout worker that runs them on an engine
    "asyncrl.rollout.workflows": 2, "asyncrl.rollout.gateway": 2, "asyncrl.rollout.worker": 2,
    # deprecated aliases of paths that moved under asyncrl.rollout, each on the floor of what it aliases
    "asyncrl.client": 1, "asyncrl.workflows": 2, "asyncrl.gateway": 2,
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


@pytest.mark.slow
def test_every_floor_is_of_a_module_that_exists():
    assert [m for m in FLOORS if m not in import_graph()] == [], "a module left FLOORS behind: remove its entry"


DOCS = ROOT.parent / "docs"


def doc_floors(text: str) -> dict[str, int]:
    """The floor table of a doc: each row ``| N name | ... | `a`, `b/c` ... |`` puts every
    name in backticks of its last cell on floor N (``b/c`` is ``asyncrl.b.c``; a package's
    ``x/__init__`` is the package ``x`` alone). A name listed twice is on floor -1, which
    no entry of ``FLOORS`` is: the comparison names it."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and (m := re.match(r"(\d+) ", cells[0])):
            for name in re.findall(r"`([\w/]+)`", cells[-1]):
                module = "asyncrl." + name.replace("/", ".").removesuffix(".__init__")
                found[module] = -1 if module in found else int(m.group(1))
    return found


def test_the_doc_table_reader_sees_each_row():
    table = "| floor | what | modules |\n|---|---|---|\n| 0 ground | `types` here | `types`, `rollout/__init__` |\n" \
            "| 1 parts | x | `tasks`, `rollout/client` (and `client`, an alias) |\n"
    assert doc_floors(table) == {"asyncrl.types": 0, "asyncrl.rollout": 0, "asyncrl.tasks": 1,
                                 "asyncrl.rollout.client": 1, "asyncrl.client": 1}
    assert doc_floors(table + "| 2 episodes | x | `tasks` |\n")["asyncrl.tasks"] == -1


@pytest.mark.parametrize("doc", ["design.md", "layout.md"])
def test_the_docs_floor_table_lists_every_module_on_its_floor(doc):
    """A module missing from the doc's table, one it names that ``FLOORS`` does not, or one
    on another floor fails; and the doc's floors, read alone, hold the imports."""
    stated = doc_floors((DOCS / doc).read_text())
    wanted = {m: f for m, f in FLOORS.items() if m != "asyncrl"}  # the root package: no part to read
    assert sorted(set(wanted) - set(stated)) == [], f"docs/{doc}: add these to its floor table"
    assert sorted(set(stated) - set(wanted)) == [], f"docs/{doc}: its floor table names these, FLOORS does not"
    assert {m: (stated[m], f) for m, f in wanted.items() if stated[m] != f} == {}, f"docs/{doc}: (doc, FLOORS)"
    assert climbs(import_graph(), {**stated, "asyncrl": 0}) == []


def folder(module: str, packages: set[str]) -> str:
    """The folder a module's file is in: a package's own ``__init__`` is in the package."""
    return module if module in packages else module.rpartition(".")[0]


def two_way(graph: dict[str, set[str]], packages: set[str]) -> list[str]:
    """Every pair of folders, neither inside the other, that import each other, with one
    import each way. (A folder and one inside it are the floors' business.)"""
    one_way: dict[tuple[str, str], str] = {}
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = folder(module, packages), folder(target, packages)
            if a != b and not a.startswith(f"{b}.") and not b.startswith(f"{a}."):
                one_way.setdefault((a, b), f"{module} -> {target}")
    return [f"{a} <-> {b}: {one_way[a, b]}; {one_way[b, a]}" for a, b in sorted(one_way) if a < b and (b, a) in one_way]


def test_the_checker_sees_two_folders_importing_each_other():
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": {"p.a.z"}, "p.a.z": set(), "p.c": {"p.a.x"}, "p.a": {"p.c"}}
    assert two_way(graph, {"p", "p.a", "p.b"}) == ["p.a <-> p.b: p.a.x -> p.b.y; p.b.y -> p.a.z"]


def test_no_two_folders_import_each_other():
    graph = import_graph()
    packages = {m for m in graph if (ROOT.joinpath(*m.split(".")[1:]) / "__init__.py").is_file()}
    assert "asyncrl.rollout.workflows" in packages and "asyncrl.tasks" in packages
    assert two_way(graph, packages) == []


def test_the_train_loop_reads_in_one_short_module_and_every_module_stays_small():
    """The trainer is the story (take B groups, train, sync, evaluate, log, hooks, checkpoint)
    and its bookkeeping lives beside it in modules named for their concept: it stays within
    300 lines, every module of the package within 500 (one grown past is split by concern,
    as ``engine/remote.py`` was into the fleet, the weights and the wire)."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert sizes["orchestrator/trainer.py"] <= 300
    assert {name: n for name, n in sizes.items() if n > 500} == {}


def test_a_moved_module_without_a_file_is_named_by_no_module_of_the_package():
    """An old path that ``asyncrl.moved.MOVED_MODULES`` resolves has no file (a file would be
    placed and checked above instead), its new modules exist, and no module but ``moved``
    names it: the package never leans on an old path, whose dependency no floor can see."""
    from asyncrl.moved import MOVED_MODULES

    graph = import_graph()
    for old, new in MOVED_MODULES.items():
        assert old not in graph and [m for m in new if m not in graph] == [], old
        assert [p.name for p in ROOT.rglob("*.py") if p.name != "moved.py" and old in p.read_text()] == [], old


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
