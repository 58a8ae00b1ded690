"""A learner behind a Tinker-API URL (``learner.url``): the rollout side here, the learner
on another machine — ``asyncrl serve-tinker`` (``asyncrl/tinker/``) or Tinker's hosted
service — reached with Tinker's own SDK.

:class:`TinkerLearnerWorker` has the calls of a learner rank (``learner_worker.py``), so
the one :class:`~asyncrl.runtime.transport.LearnerGroup` drives it over the ``InProcess``
transport, with its deadlines, and the trainer, its schedules, its staleness gate and its
checks read the same whichever learner runs underneath. What each call becomes:

- ``train_step``: one ``forward_backward`` with Tinker's ``ppo`` loss (``cispo`` for
  ``policy_loss: cispo``) on the step's batch as Tinker datums, each advantage divided by
  the step's model tokens (why that is asyncrl's loss: ``asyncrl/learner/tinker_api.py``,
  where the translation's pure functions are), one ``optim_step`` and the new version's
  ``save_weights_external`` (a PEFT adapter directory on the server), all three sent before
  the first is awaited (the SDK sends a client's calls in order, the server runs them so):
  a step waits on one round trip, not three. The learning rate is asyncrl's schedule at the
  step (``learner/core.lr_lambda``), sent as ``AdamParams``.
- ``publish``: the saved adapters' files downloaded from the URLs
  ``get_external_weights_urls`` gives (one HTTP connection, reused), read into an
  :class:`~asyncrl.engine.protocol.AdapterUpdate` that the engines merge onto their own
  base (``model.path``, which both sides load); the previous version's files are deleted
  on the server, that deletion awaited at the next publish rather than this one.
- ``probe_logprobs`` (the delivery check): ``forward`` with ``cross_entropy``, the
  server's own logprobs of the engine's greedy tokens.
- ``save_checkpoint`` / ``load_checkpoint``: ``save_state`` on the server (adapters and
  Adam state), its ``tinker://`` path in the run's checkpoint beside the trainer state;
  resuming creates the training client from it (``create_training_client_from_state_
  with_optimizer``).

Invariant: every call that changes the learner's weights is one SDK call carrying the
SDK's sequence id, so a retry after a lost reply applies nothing twice (the server keeps
the first answer, ``asyncrl/tinker/service.py``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from asyncrl.config import Config, ConfigError
from asyncrl.weight_updates import AdapterUpdate
from asyncrl.engine.remote_wire import read_peft_adapter
from asyncrl.learner import TrainBatch
from asyncrl.learner.checkpoint_io import STATE_FILE, URL_STATE_KEY, place_checkpoint, rng_state, set_rng_state
from asyncrl.learner.core import lr_lambda
from asyncrl.learner.tinker_api import TINKER_LOSS, datums, lora_groups, ratio_metrics

T = TypeVar("T")

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What a PEFT adapter directory holds (``read_peft_adapter`` reads these)."""
LEAVE_S = 30.0
"""How long each of the calls that end the session may take: a run ending because its
server died must not wait behind the SDK's minutes of retries to say so."""


REFUSED_GRACE_S = 5.0
"""How long a refused connection at ``learner.url`` is retried before the run is refused: a
server starting beside the trainer binds its port within it; a wrong URL fails in seconds
rather than behind the SDK's minutes of retries."""


def reachable(url: str) -> None:
    """Something answers HTTP at ``url`` (any status: the SDK says the rest), or a
    ConfigError (exit 2) in one line naming the URL and what to do."""
    import httpx

    deadline = time.monotonic() + REFUSED_GRACE_S
    while True:
        try:
            httpx.get(url.rstrip("/") + "/api/v1/healthz", timeout=10.0)
            return
        except (httpx.ConnectError, httpx.TimeoutException) as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(f"learner.url: nothing answers at {url} ({type(exc).__name__}: {exc}). Start the "
                                  "server first (asyncrl serve-tinker CONFIG prints its URL), or correct the URL"
                                  ) from None
            time.sleep(0.5)


def build(cfg: Config, request: Any) -> Any:
    """The ``tinker`` row's builder (``asyncrl/config/learner_kinds.py``): this rank driven
    over the ``InProcess`` transport, as a learner on a thread is."""
    from asyncrl.runtime.learner_factory import BuiltLearner
    from asyncrl.runtime.transport import InProcess

    return BuiltLearner(InProcess(TinkerLearnerWorker(cfg)))


class TinkerLearnerWorker:
    """The learner rank's calls over a Tinker-API URL (see the module docstring)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.version = 0
        self.service: Any = None
        self.training: Any = None
        self.rest: Any = None
        self.published: str | None = None  # the last external checkpoint's tinker:// path
        self.published_version = -1  # and the version it holds
        self.update_bytes = 0
        self._lr = lr_lambda(cfg.optim, cfg.total_steps)
        self._saving: tuple[int, Any] | None = None  # (version, its save_weights_external future)
        self._deleting: list[tuple[str, Any]] = []  # deletions sent, their answers not read yet
        self._http: Any = None  # the httpx client that downloads adapters
        self.base_model = cfg.tinker.base_model or cfg.model.path

    # ------------------------------------------------------------ the group
    def join(self, init_method: str | None = None, local_rank: int = 0) -> None:
        """Connect, check the server serves the base model, and create the LoRA client."""
        try:
            import tinker
        except ImportError:
            raise ConfigError("learner.url needs Tinker's SDK: pip install 'asyncrl[tinker]'") from None
        url, lora = self.cfg.learner.url, self.cfg.model.lora
        if url is None or lora is None:  # the config refuses learner.url without model.lora
            raise ConfigError("a learner behind a URL needs learner.url and model.lora")
        key = self.cfg.tinker.api_key or os.environ.get("TINKER_API_KEY") or "tml-asyncrl-local"
        reachable(url)
        self.service = tinker.ServiceClient(base_url=url, api_key=key)
        self.rest = tinker.RestClient(base_url=url, api_key=key)
        wait = self.cfg.watchdog.learner_call_s
        served = [m.model_name for m in self.rest.get_server_capabilities().result(timeout=wait).supported_models]
        if self.base_model not in served:
            raise ConfigError(f"learner.url={url} serves {served}, not {self.base_model!r} (tinker.base_model, or "
                              "model.path as written): name the served base model in tinker.base_model")
        attn, mlp = lora_groups(lora.target_modules)
        self.training = self.service.create_lora_training_client(
            base_model=self.base_model, rank=lora.rank, seed=self.cfg.seed, train_attn=attn, train_mlp=mlp,
            train_unembed=False).result(timeout=wait)

    def leave(self) -> None:
        """Delete the adapters still on the server (the last published, the last step's if
        never published) and close the session, each within :data:`LEAVE_S`; a failure is one
        line, never raised over the run's own end."""
        if self._saving is not None:  # saved with the last step, never published
            try:
                self._forget(self._saving[1].result(timeout=LEAVE_S).path)
            except Exception as exc:  # noqa: BLE001 - the run has ended; its own status stands
                print(f"asyncrl: learner.url: the last step's adapters were not saved ({exc})", file=sys.stderr)
            self._saving = None
        if self.published is not None:
            self._forget(self.published)
        self._settle()
        if self._http is not None:
            self._http.close()
        if self.service is not None:
            try:
                self.service.close("success").result(timeout=LEAVE_S)
            except Exception as exc:  # noqa: BLE001 - the run has ended; its own status stands
                print(f"asyncrl: learner.url: the session did not close ({type(exc).__name__}: {exc})",
                      file=sys.stderr)

    def apply(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(self, *args)

    # ------------------------------------------------------------ LearnerHandle's calls
    def train_step(self, batch: TrainBatch, on_policy: bool) -> dict[str, float]:
        from tinker import types

        algo, optim = self.cfg.algorithm, self.cfg.optim
        rows, tokens = datums(batch)
        trained = self.version  # the weights the server computes this step's logprobs with
        config = {"clip_low_threshold": 1.0 - algo.clip_low, "clip_high_threshold": 1.0 + algo.clip_high}
        start = time.perf_counter()
        lr = optim.lr * self._lr(self.version)
        # both sent before either is awaited: the SDK sends a client's calls in order and the
        # server runs them in that order, so the step waits one round trip, not two
        backward = self.training.forward_backward(rows, TINKER_LOSS[algo.policy_loss], config)
        stepped = self.training.optim_step(types.AdamParams(
            learning_rate=lr, beta1=optim.betas[0], beta2=optim.betas[1], eps=1e-8, weight_decay=optim.weight_decay,
            grad_clip_norm=optim.grad_clip))
        # and the new version's adapters saved for the engines behind it: every step is
        # published (weight_sync), so publish finds them saved, one round trip fewer
        saving = self.training.save_weights_external(f"asyncrl-v{self.version + 1}")
        fb = backward.result()
        answered = time.perf_counter() - start
        step = stepped.result()
        self.version += 1
        self._saving = (self.version, saving)
        metrics = {"actor/loss": float(fb.metrics["loss:sum"]), "actor/lr": lr, "actor/tokens": float(tokens),
                   "actor/optimizer_steps": 1.0, "time/learner_url_s": time.perf_counter() - start,
                   "time/learner_url_forward_backward_s": answered}
        if step.metrics and "grad_norm:mean" in step.metrics:
            metrics["actor/grad_norm"] = float(step.metrics["grad_norm:mean"])
        metrics.update(ratio_metrics(batch, [torch.tensor(out["logprobs"].tolist()) for out in fb.loss_fn_outputs],
                                     trained))
        return metrics

    def accumulate(self, batch: TrainBatch, on_policy: bool) -> None:
        raise ConfigError("learner.streaming is refused with learner.url (the config check says why)")

    def finish_step(self) -> dict[str, float]:
        raise ConfigError("learner.streaming is refused with learner.url (the config check says why)")

    def publish(self) -> AdapterUpdate:
        """The adapters at this version, downloaded from the server (see the module docstring)."""
        directory = Path(tempfile.mkdtemp(prefix="asyncrl-learner-url-"))
        try:
            self._download(directory)
            update = read_peft_adapter(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self.update_bytes = update.nbytes
        return update

    def _download(self, directory: Path) -> None:
        """This version's adapters as a PEFT directory in ``directory``: saved on the server
        once a version (``save_weights_external``), the previous version's deleted there."""
        import httpx

        if self.published is None or self.published_version != self.version:
            saved, saving = self._saving if self._saving is not None else (-1, None)
            self._saving = None
            if saved != self.version or saving is None:  # not saved with the step (a resumed client's first)
                saving = self.training.save_weights_external(f"asyncrl-v{self.version}")
            path = saving.result().path
            self._settle()  # the deletion the last publish sent
            if self.published is not None:
                self._forget(self.published)
            self.published, self.published_version = path, self.version
        urls = self.rest.get_external_weights_urls(self.published).result().urls
        if self._http is None:  # one client for every download: its connection is reused
            self._http = httpx.Client(timeout=self.cfg.watchdog.learner_call_s, follow_redirects=True)
        for name in ADAPTER_FILES:
            if name not in urls:
                raise RuntimeError(f"learner.url: {self.published} has no {name} (its files: {sorted(urls)}); "
                                   "the server did not save a PEFT adapter")
            response = self._http.get(urls[name])
            response.raise_for_status()
            (directory / name).write_bytes(response.content)

    def save_checkpoint(self, path: Path, extra: dict[str, Any], files: dict[str, str]) -> Path:
        """The server saves adapters and Adam state (``save_state``); ``path`` gets the
        trainer state with its ``tinker://`` path and the adapters as a PEFT directory
        (``PeftModel.from_pretrained(base, path)`` loads them), written under
        ``<path>.tmp`` and renamed."""
        saved = self.training.save_state(f"asyncrl-v{self.version}-{os.getpid()}").result().path
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._download(tmp)
        for name, text in files.items():
            (tmp / name).write_text(text)
        torch.save({"version": self.version, "rng": rng_state(), URL_STATE_KEY: saved,
                    "learner_url": self.cfg.learner.url, **extra}, tmp / STATE_FILE)
        place_checkpoint(tmp, path)
        return path

    def load_checkpoint(self, path: Path) -> int:
        """Continue from ``path`` (the trainer's ``resume_point`` has checked a learner by URL
        wrote it): a training client created from the server's saved state."""
        state = torch.load(path / STATE_FILE, weights_only=False, map_location="cpu")
        self.training = self.service.create_training_client_from_state_with_optimizer(state[URL_STATE_KEY]).result()
        set_rng_state(state["rng"])
        self.version = int(state["version"])
        return self.version

    # ------------------------------------------------------------ the delivery check's
    def probe_logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """log π(token) of each completion under the server's current weights (``forward``)."""
        from tinker import types

        out: list[list[float]] = [[] for _ in sequences]
        live = [(i, p, c) for i, (p, c) in enumerate(sequences) if c]
        if not live:
            return out
        # Datum converts lists to TensorData (its __post_init__), though tinker annotates TensorData only
        rows = [types.Datum(model_input=types.ModelInput.from_ints((p + c)[:-1]), loss_fn_inputs={
            "target_tokens": (p + c)[1:], "weights": [0.0] * (len(p) + len(c) - 1)}) for _, p, c in live]  # type: ignore[dict-item]
        done = self.training.forward(rows, "cross_entropy").result()
        for (i, p, _), result in zip(live, done.loss_fn_outputs, strict=True):
            out[i] = result["logprobs"].tolist()[len(p) - 1:]
        return out

    def engine_update_bytes(self) -> int:
        return self.update_bytes

    def _forget(self, path: str) -> None:
        """Send the deletion of ``path`` on the server, not awaited (a version's publish does
        not wait on the previous one's deletion): the next publish or :meth:`leave` reads its
        answer (:meth:`_settle`), so at most one is in flight across a step."""
        self._deleting.append((path, self.rest.delete_checkpoint_from_tinker_path(path)))

    def _settle(self) -> None:
        """Read the answers of the deletions sent; a failure is one line (a leftover file on
        the server is not worth failing a run for)."""
        pending, self._deleting = self._deleting, []
        for name, deleting in pending:
            try:
                deleting.result(timeout=LEAVE_S)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                print(f"asyncrl: learner.url: could not delete {name} on the server ({exc})", file=sys.stderr)
