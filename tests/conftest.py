"""Shared fixtures: tiny models built from a config, nothing downloaded."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.tools.sandbox import SandboxUnavailable, bwrap_path

# Under pytest-xdist (pyproject's addopts) each test process gets its share of the cores,
# so two processes' math does not fight over both of them.
torch.set_num_threads(max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Ray, wherever a test starts it (a fixture's ray.init, a run's runtime=ray): set before Ray is
# imported, so its driver and the raylet it starts read them. Ray's memory monitor kills a
# worker when the *machine's* memory passes 95 %, whoever uses it: on a machine shared with
# other jobs it killed a test that passes alone, so the tests turn it off (the kernel's OOM
# killer still guards the machine). The object store is capped at 256 MiB (by default Ray
# sizes it at 30 % of memory); the tests' tiny policies put kilobytes in it.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
os.environ.setdefault("RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES", str(256 << 20))


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which names a test's group from these marks
def pytest_collection_modifyitems(config, items):
    """Every test that starts Ray runs in one test process (xdist's ``ray`` group), one
    after another: two local clusters at once would double Ray's memory and processes
    for nothing, and a module-scoped cluster fixture would start once per process. The
    tests of a module that share one of its module-scoped fixtures (a training run, a
    server, SmolLM2 loaded) run in one test process too (a group named after the module),
    so the fixture is built once, not once in each process (``--dist loadgroup`` hands out
    every other test alone). A test marked ``cuda`` is skipped where torch sees no CUDA device."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU (the `cuda` marker) and torch sees none")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "ray_cluster" in getattr(item, "fixturenames", ()) or "ray" in item.nodeid.lower().replace("array", ""):
            in_group(config, item, "ray")
        elif shares_a_module_fixture(item):
            in_group(config, item, item.nodeid.split("::", 1)[0])
    missing = sandbox_missing()
    for item in items:
        if missing and item.get_closest_marker("sandbox"):
            item.add_marker(pytest.mark.skip(reason=f"{SANDBOX_SKIP}: {missing}"))


def in_group(config, item, name: str) -> None:
    """Mark ``item`` for xdist's group ``name``, and on pytest >= 9.2 name the group in its
    node id as xdist's scheduler reads it (``<id>@<name>``): pytest-xdist 3.8 still writes the
    old ``_nodeid`` field, which pytest 9.2's structured ids ignore, so every group was
    silently handed out test by test (pytest-xdist issue 1386)."""
    item.add_marker(pytest.mark.xdist_group(name))
    if config.getoption("loadgroup", False) and hasattr(item, "_id") and "@" not in item.nodeid:
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(f"{item.nodeid}@{name}")


def shares_a_module_fixture(item) -> bool:
    """Whether ``item`` uses a fixture of scope ``module`` (its own module's: conftest has
    none). Read from the fixtures pytest resolved for the test (``_fixtureinfo``, private
    but stable since pytest 3); an item without them (a doctest) shares none."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


SANDBOX_SKIP = "needs the sandbox's bubblewrap"
"""The reason every test marked ``sandbox`` is skipped with where ``bwrap`` is missing: the
terminal summary counts the skips by it."""


def sandbox_missing() -> str | None:
    """Why the sandbox cannot run here (the library's own message, naming the package to
    install), or None: the one place the sandbox tests' skip is decided, at collection."""
    try:
        bwrap_path()
    except SandboxUnavailable as exc:
        return str(exc)
    return None


def pytest_terminal_summary(terminalreporter):
    """Say, where the summary is read, which tests did not run for want of bubblewrap and
    how to run them: a newcomer should not have to work it out from a skip count. Counted
    from the skip reports, so it holds under xdist too (its workers collect, not this one)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and SANDBOX_SKIP in r.longrepr[2]]
    if skipped:
        terminalreporter.write_sep("-", "sandbox tests skipped")
        terminalreporter.write_line(
            f"sandbox tests skipped: {len(skipped)} tests run model-written code in the sandbox, and bubblewrap "
            "(bwrap) is not found on PATH; apt-get install bubblewrap (Debian/Ubuntu; .ci/run installs it) "
            "runs them")


def make_model(seed: int = 0, vocab_size: int = 96, max_positions: int = 512) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=max_positions,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where a test that can run on either puts its model: the GPU when there is one (the
    equivalence tests then check the device's kernels), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def model() -> Qwen2ForCausalLM:
    return make_model()


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of ``tokens`` from one plain forward pass: what a learner computes."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float().cpu() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.fixture(scope="session")
def char_tokenizer():
    from asyncrl.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture
def tiny_policy(char_tokenizer):
    """A randomly initialised char-level Qwen2 with its chat-template tokenizer."""
    from asyncrl.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(char_tokenizer, seed=0)
    return model, tokenizer


class SpyEngine:
    """Wraps an engine and records every (prompt_ids, completion) it served."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[list[int], object]] = []

    @property
    def version(self):
        return self.engine.version

    async def generate(self, prompt_ids, sampling):
        completion = await self.engine.generate(prompt_ids, sampling)
        self.calls.append((list(prompt_ids), completion))
        return completion

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory, char_tokenizer):
    """A random tiny policy saved as a Hugging Face directory (what ``model.path`` takes)."""
    from asyncrl.tiny import build_tiny_model, save_tiny_policy

    path = tmp_path_factory.mktemp("policy")
    model, tokenizer = build_tiny_model(char_tokenizer, seed=0)
    save_tiny_policy(model, tokenizer, path)
    return path
