"""The sessions, training clients, checkpoints and sampling sessions of the served base models,
and the calls the routes make on them (``server.py`` only reads and writes the wire).

Several base models may be served (``model.path`` and ``tinker.models``): each is a
:class:`Base` with its own sampling engine; a training client trains adapters on the base its
create names, a sampler samples the base it names or its checkpoint's, and every saved state
records its base (a client created from it trains on that base again).

Names, as the SDK derives or expects them:

- a session ``sess-<hex>``; its training client number k is ``<session>:train:<k>`` (the SDK
  computes this id itself when it creates a client from a saved state) and its sampling
  session number k ``<session>:sample:<k>``;
- a saved state ``tinker://<model id>/weights/<name>``, a sampler checkpoint
  ``tinker://<model id>/sampler_weights/<name>``, each a directory under
  ``tinker.checkpoint_dir`` (``<model id>/<kind>/<name>``, ``:`` written ``_``).

Idempotence: every training call carries the client's sequence id (``seq_id``, from 1, one
counter a client). The first call with a given id is queued; a repeat (the SDK's retry after a
lost reply) gets the request id of the first back and queues nothing, so no step is applied
twice. Every call's retry, samples included and across a restart, is also answered once by its
idempotency key (``answers.py``, in the server's middleware). Training calls run one at a time
on one thread, each client's in the order they arrived: the SDK sends a client's calls in its
sequence order (each after the previous was accepted; this server tells it not to send a call's
chunks in parallel), so arrival order is sequence order. The clients take turns (``turns.py``):
one request of each, round and round.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import RolloutConfig
from asyncrl.engine.protocol import AdapterUpdate
from asyncrl.tinker.futures import FutureStore, NotFound, Outcome, UserError
from asyncrl.tinker.sampling import EngineSampler, SampleCall
from asyncrl.tinker.losses import LossInputError, tinker_loss
from asyncrl.tinker.runs_info import NAME, RunRecords, checkpoint_entry
from asyncrl.tinker.training import TinkerLora, TrainingRun, check_adam, lora_targets, pack, read_lora
from asyncrl.tinker.turns import Turns
from asyncrl.tinker.wire import PROTO, ForwardBackwardCall, forward_backward_proto, sample_proto

T = TypeVar("T")
REQUEST_TOKENS = 4096
"""Tokens a ``forward``/``forward_backward`` request of several datums may hold when the
micro-batch has no token bound (``optim.micro_batch_tokens``; else that bound): the training
thread is every client's, so one request holds it for one micro-batch's time at most. The
SDK splits its calls to fit (:meth:`TinkerService.chunk_bytes`, told it in the client config)."""
SESSION_EXPIRY_S = 60.0
"""A session whose client has not sent a heartbeat for this long has gone (the SDK beats every
10 s): its unfinished requests are cancelled (:meth:`TinkerService.reap`)."""
UNNAMED_KEPT = 16
"""Unnamed samplers (``save_weights_and_get_sampling_client()``) kept per training client: an RL
loop makes one a step and never says when it is done with one, so the oldest past this many is
forgotten (its samples are refused naming why). A named checkpoint stays until deleted."""


def _session(client_id: str) -> str:
    """The session a training client's or sampler's id names (``<session>:train:<k>``)."""
    return client_id.split(":", 1)[0]


class ServerStopping(RuntimeError):
    """Raised inside a training call's forward when the server stops (``_abort_training``)."""


@dataclass
class Base:
    """One served base model: its weights (frozen, shared by its training clients), the
    directory its tokenizer loads from, and the sampling engine its samplers share."""

    name: str
    model_dir: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    sampler: EngineSampler


@dataclass
class Checkpoint:
    path: str  # tinker://<model id>/<kind>/<name>
    run_id: str
    kind: str  # training | sampler | external
    directory: Path
    lora: TinkerLora
    base: str  # the base model's name it adapts
    adapters: AdapterUpdate | None = None  # a sampler's weights, copied when saved
    token: str | None = None  # an external checkpoint's: its files' download URLs carry it
    created: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    deleted: bool = False


@dataclass(frozen=True)
class Sampler:
    """A sampling session: the weights it samples (``key`` into the engine's turns)."""

    key: str | None  # None: the base model
    model_path: str | None
    adapters: AdapterUpdate | None
    base: str  # the base model's name
    checkpoint: Checkpoint | None = None


class TinkerService:
    def __init__(self, models: list[tuple[str, Path, PreTrainedModel, PreTrainedTokenizerBase]], *,
                 checkpoint_dir: Path, max_rank: int, seed: int = 0, micro_rows: int = 64,
                 micro_tokens: int | None = 4096, rollout: RolloutConfig | None = None,
                 engine_dtype: str | None = None, recompute: bool | str = "auto",
                 activation_budget: int = 768 << 20) -> None:
        """``models``: each served base model as (name, directory, weights, tokenizer), the
        first the default (a sampler or client that names none gets it)."""
        self.bases = {name: Base(name, directory, model, tokenizer, EngineSampler(
            model, tokenizer, seed=seed, rollout=rollout, dtype=engine_dtype))
            for name, directory, model, tokenizer in models}
        self.default = models[0][0]
        self.checkpoint_dir = checkpoint_dir
        self.run_options = {"max_rank": max_rank, "micro_rows": micro_rows, "micro_tokens": micro_tokens,
                            "recompute": recompute, "activation_budget": activation_budget}
        self.max_request_tokens = micro_tokens or REQUEST_TOKENS
        self.futures = FutureStore()
        self.sessions: dict[str, float] = {}  # session id -> its last heartbeat (time.monotonic())
        self.runs: dict[str, TrainingRun] = {}
        self.run_base: dict[str, str] = {}  # model id -> the base model it trains
        self.creating: dict[str, str] = {}  # model id -> the create request's id (a retried create is one)
        self.checkpoints: dict[str, Checkpoint] = {}
        self.samplers: dict[str, Sampler] = {}
        self.unnamed: dict[str, list[str]] = {}  # training client -> its unnamed samplers, oldest first
        self.unnamed_kept = UNNAMED_KEPT
        self.forgotten: dict[str, str] = {}  # sampler id -> why it is gone
        self.records = RunRecords(checkpoint_dir)  # what get_training_run answers (runs_info.py)
        self._trainer = Turns("asyncrl-tinker-train")  # one thread, the clients in turns (turns.py)

    async def shutdown(self) -> None:
        self._abort_training()
        for base in self.bases.values():
            await base.sampler.shutdown()
        self._trainer.shutdown()  # the call running ends at its next module (below); the queued never run

    def _abort_training(self) -> None:
        """The call running on the training thread ends at its model's next module call: a
        forward pre-hook on every module raises. A stopping server does not wait out a
        micro-batch that can take minutes on a loaded CPU: the clients' state dies with the
        process anyway, and a state being saved is written to a ``.tmp`` directory first
        (``checkpoint_io``), which nothing reads. A backward under way still ends its micro-batch."""
        def stop(module: object, args: object) -> None:
            raise ServerStopping("the server is stopping: this call was cut")

        for run in list(self.runs.values()):
            for module in run.state.model.modules():
                module.register_forward_pre_hook(stop)

    # ------------------------------------------------------------------ helpers
    def _on_trainer(self, owner: str, fn: Callable[[], T]) -> asyncio.Future[T]:
        """``fn`` queued on the training thread now, after ``owner``'s earlier calls (each
        client's queue keeps its arrival order; clients take turns, ``turns.py``)."""
        return asyncio.wrap_future(self._trainer.submit(owner, fn))

    def run(self, model_id: str) -> TrainingRun:
        if model_id not in self.runs:
            saved = self.records.saved_states(model_id)
            raise NotFound(f"no training client {model_id!r} on this server: training clients live in the server's "
                           "memory, and this one was created by another server or before this one restarted; "
                           + (f"its saved states here: {', '.join(saved)} — create_training_client_from_state_with_"
                              "optimizer(path) continues from one" if saved else "it saved no state here (save_state)"))
        return self.runs[model_id]

    def _training_call(self, run: TrainingRun, seq_id: int | None, fn: Callable[[], Outcome]) -> dict[str, Any]:
        """Queue ``fn`` as ``run``'s call ``seq_id``, once (a repeat answers the first's id)."""
        if seq_id is not None and seq_id in run.requests:
            return {"request_id": run.requests[seq_id], "model_id": run.model_id}
        self.records.touch(run.model_id)
        request_id = self.futures.submit(self._on_trainer(run.model_id, fn), prefix="train",
                                         session=_session(run.model_id))
        if seq_id is not None:
            run.requests[seq_id] = request_id
        return {"request_id": request_id, "model_id": run.model_id}

    def base(self, base_model: str | None) -> Base:
        """The base model ``base_model`` names (None: the default); one not served is a UserError."""
        name = self.default if base_model is None else base_model
        if name not in self.bases:
            raise UserError(f"base_model {base_model!r} is not served here; this server serves "
                            f"{', '.join(map(repr, self.bases))} (tinker.base_model and tinker.models)")
        return self.bases[name]

    def _directory(self, run_id: str, kind: str, name: str) -> Path:
        if not NAME.match(run_id):
            raise UserError(f"{run_id!r} is not a training client's id")
        if not NAME.match(name) or ":" in name:
            raise UserError(f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-' only")
        return self.checkpoint_dir / run_id.replace(":", "_") / kind / name

    def checkpoint(self, path: str) -> Checkpoint:
        """The checkpoint a tinker:// path names; a saved state not yet seen by this server
        (saved before a restart) is found on disk."""
        found = self.checkpoints.get(path)
        if found is None:
            match = re.match(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$", path)
            if match is None:
                raise NotFound(f"{path!r} is not a tinker://<model id>/weights|sampler_weights/<name> path")
            run_id, kind, name = match.groups()
            directory = self._directory(run_id, kind, name)
            if kind != "weights" or not directory.is_dir():
                raise NotFound(f"no checkpoint {path!r} on this server")
            lora, base = read_lora(directory)
            found = self.checkpoints[path] = Checkpoint(path, run_id, "training", directory, lora,
                                                        base or self.default)
        if found.deleted:
            raise NotFound(f"checkpoint {path!r} was deleted")
        return found

    # ------------------------------------------------------------------ sessions and models
    def create_session(self) -> str:
        session_id = f"sess-{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = time.monotonic()
        return session_id

    def heartbeat(self, session_id: str) -> None:
        self.sessions[session_id] = time.monotonic()

    def finish_session(self, session_id: str) -> list[str]:
        """The client closed its session (``ServiceClient.close``): what it left unfinished is
        cancelled. Their request ids."""
        self.sessions.pop(session_id, None)
        return self.futures.cancel_session(session_id, "cancelled: its session was closed (ServiceClient.close)")

    def reap(self, now: float | None = None) -> list[str]:
        """Cancel the unfinished requests of every session silent for :data:`SESSION_EXPIRY_S`
        (its client went away: nobody will fetch what they compute). Their request ids."""
        now = time.monotonic() if now is None else now
        gone = [session for session, beat in self.sessions.items() if now - beat > SESSION_EXPIRY_S]
        return [request_id for session in gone for request_id in self.futures.cancel_session(
            session, f"cancelled: its session sent no heartbeat for {SESSION_EXPIRY_S:.0f} s (the client went away)")]

    def create_model(self, session_id: str, model_seq_id: int, base_model: str, lora: TinkerLora,
                     user_metadata: dict[str, str] | None = None) -> dict[str, Any]:
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id not in self.creating:
            base = self.base(base_model)  # at the door, as the rank and the layers it trains
            if not 1 <= lora.rank <= self.run_options["max_rank"]:
                raise UserError(f"lora_config.rank={lora.rank} is refused: this server trains ranks 1 to "
                                f"{self.run_options['max_rank']} (tinker.max_lora_rank)")
            lora_targets(base.model, lora)

            def build() -> Outcome:
                run = TrainingRun(model_id, base.model, base.tokenizer, lora, **self.run_options)
                self._add_run(run, base.name, user_metadata)
                return Outcome({"model_id": model_id, "type": "create_model"})

            self.creating[model_id] = self.futures.submit(self._on_trainer(model_id, build), prefix="create",
                                                          session=session_id)
        return {"request_id": self.creating[model_id], "model_id": model_id}

    def _add_run(self, run: TrainingRun, base: str, user_metadata: dict[str, str] | None) -> None:
        self.runs[run.model_id], self.run_base[run.model_id] = run, base
        self.records.record(run.model_id, base, run.lora.rank, user_metadata)

    def get_info(self, model_id: str) -> dict[str, Any]:
        run = self.run(model_id)
        base = self.bases[self.run_base[model_id]]
        return {"type": "get_info", "model_id": model_id, "model_name": base.name, "is_lora": True,
                "lora_rank": run.lora.rank,
                # tokenizer_id: the model's own directory, so the SDK's get_tokenizer() loads it with no hub
                "model_data": {"arch": type(base.model).__name__, "model_name": base.name,
                               "tokenizer_id": str(base.model_dir)}}

    # ------------------------------------------------------------------ training calls
    def chunk_bytes(self) -> int:
        """The SDK's ``fwdbwd_max_chunk_bytes_count`` for this server: it estimates a datum at 4
        bytes a token plus its loss inputs' bytes, at least 4 a token more (``target_tokens``), so
        a chunk of this many bytes holds at most :attr:`max_request_tokens` tokens."""
        return 8 * self.max_request_tokens

    def check_call(self, run: TrainingRun, call: ForwardBackwardCall) -> None:
        """At the door, before the call queues on the training thread: the loss served, every
        datum's lengths, shapes and token ids (``pack``'s checks, the very ones), and the
        request's tokens within :attr:`max_request_tokens` (a lone datum: within the context)."""
        try:
            tinker_loss(call.loss_fn)
        except LossInputError as exc:
            raise UserError(str(exc)) from None
        pack(call.data, run.vocab, run.max_positions)
        tokens = sum(len(d.tokens) for d in call.data)
        if len(call.data) > 1 and tokens > self.max_request_tokens:
            raise UserError(f"this request holds {tokens} tokens in {len(call.data)} datums; this server takes at "
                            f"most {self.max_request_tokens} tokens a request of several datums (one micro-batch: "
                            "optim.micro_batch_tokens), so that no client holds the shared training thread for longer; "
                            "the SDK splits its calls to fit (it reads the limit from the server), other clients "
                            "send smaller requests")

    def forward_backward(self, call: ForwardBackwardCall) -> dict[str, Any]:
        run = self.run(call.model_id)
        if call.seq_id not in run.requests:  # a retry was checked the first time
            self.check_call(run, call)

        def work() -> Outcome:
            outputs, metrics = run.forward_backward(call.data, call.loss_fn, call.loss_fn_config,
                                                    forward_only=call.forward_only)
            return Outcome(forward_backward_proto(outputs, metrics), PROTO)

        return self._training_call(run, call.seq_id, work)

    def optim_step(self, model_id: str, seq_id: int | None, adam: dict[str, Any]) -> dict[str, Any]:
        run = self.run(model_id)
        check_adam(adam)  # at the door: a refused step queues nothing

        def work() -> Outcome:
            metrics = run.optim_step(adam["learning_rate"], adam["beta1"], adam["beta2"], adam["eps"],
                                     adam["weight_decay"], adam["grad_clip_norm"])
            return Outcome({"metrics": metrics})

        return self._training_call(run, seq_id, work)

    def save_state(self, model_id: str, seq_id: int | None, name: str | None) -> dict[str, Any]:
        run = self.run(model_id)
        name = name or f"state-{run.state.version:06d}"
        path, directory = f"tinker://{model_id}/weights/{name}", self._directory(model_id, "weights", name)

        def work() -> Outcome:
            run.save_state(directory, base=self.run_base[model_id])
            self.checkpoints[path] = Checkpoint(path, model_id, "training", directory, run.lora,
                                                self.run_base[model_id])
            return Outcome({"path": path, "type": "save_weights"})

        return self._training_call(run, seq_id, work)

    def save_for_sampler(self, model_id: str, seq_id: int | None, name: str | None,
                         sampling_session_seq_id: int | None) -> dict[str, Any]:
        """A named sampler checkpoint (its path back), or with no name an unnamed one handed
        straight to a new sampling session (its id back)."""
        run = self.run(model_id)
        directory = None if name is None else self._directory(model_id, "sampler_weights", name)

        def work() -> Outcome:
            adapters = run.adapters()
            if directory is None:
                session = model_id.split(":", 1)[0]
                sampler_id = f"{session}:sample:{sampling_session_seq_id}:{uuid.uuid4().hex[:8]}"
                self.samplers[sampler_id] = Sampler(sampler_id, None, adapters, self.run_base[model_id])
                self._keep_unnamed(model_id, sampler_id)
                return Outcome({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})
            path = f"tinker://{model_id}/sampler_weights/{name}"
            run.save_adapters(directory)
            self.checkpoints[path] = Checkpoint(path, model_id, "sampler", directory, run.lora,
                                                self.run_base[model_id], adapters)
            return Outcome({"path": path, "type": "save_weights_for_sampler"})

        return self._training_call(run, seq_id, work)

    def save_external(self, model_id: str, seq_id: int | None, name: str) -> dict[str, Any]:
        """The adapters as a PEFT directory under ``external_weights/<name>``: what
        ``save_weights_external`` makes, and what a learner by URL (``learner.url``,
        ``asyncrl/runtime/tinker_learner.py``) downloads file by file to hand its engines."""
        run = self.run(model_id)
        directory = self._directory(model_id, "external_weights", name)

        def work() -> Outcome:
            path = f"tinker://{model_id}/external_weights/{name}"
            run.save_adapters(directory)
            self.checkpoints[path] = Checkpoint(path, model_id, "external", directory, run.lora,
                                                self.run_base[model_id], token=secrets.token_urlsafe(24))
            return Outcome({"path": path, "type": "save_weights_external"})

        return self._training_call(run, seq_id, work)

    def external_files(self, run_id: str, checkpoint_id: str) -> tuple[str, list[str]]:
        """An external checkpoint's download token and its files (paths relative to it)."""
        saved = self.checkpoint(f"tinker://{run_id}/{checkpoint_id}")
        if saved.kind != "external" or saved.token is None:
            raise UserError(f"tinker://{run_id}/{checkpoint_id} is not an external weights checkpoint "
                            "(save_weights_external makes those)")
        files = sorted(str(f.relative_to(saved.directory)) for f in saved.directory.rglob("*") if f.is_file())
        return saved.token, files

    def external_file(self, token: str, relative: str) -> Path:
        """The file a download URL names; the token must be a live external checkpoint's."""
        for saved in self.checkpoints.values():
            if saved.token is not None and not saved.deleted and secrets.compare_digest(saved.token, token):
                path = (saved.directory / relative).resolve()
                if path.is_file() and path.is_relative_to(saved.directory.resolve()):
                    return path
                break
        raise NotFound("no such file: the URL's checkpoint was deleted, or the URL was not issued by this server")

    def load_state(self, path: str, optimizer: bool, *, model_id: str | None = None, seq_id: int | None = None,
                   session_id: str | None = None, model_seq_id: int | None = None,
                   user_metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """A saved state into an existing client (``model_id``), or into a new one (``session_id``
        and ``model_seq_id``: the SDK's create-from-state, recording ``user_metadata``)."""
        if model_id is not None:
            run = self.run(model_id)

            def load() -> Outcome:
                saved = self.checkpoint(path)
                if saved.base != self.run_base[model_id]:
                    raise UserError(f"{path} adapts base model {saved.base!r}, this client "
                                    f"{self.run_base[model_id]!r}; create a client from it instead "
                                    "(create_training_client_from_state)")
                run.load_state(saved.directory, optimizer=optimizer)
                return Outcome({"path": path, "model_id": model_id, "type": "load_weights"})

            return self._training_call(run, seq_id, load)
        new_id = f"{session_id}:train:{model_seq_id}"
        if new_id not in self.creating:
            def create() -> Outcome:
                saved = self.checkpoint(path)
                base = self.base(saved.base)
                run = TrainingRun(new_id, base.model, base.tokenizer, saved.lora, **self.run_options)
                run.load_state(saved.directory, optimizer=optimizer)
                self._add_run(run, base.name, user_metadata)
                return Outcome({"path": path, "model_id": new_id, "type": "load_weights"})

            self.creating[new_id] = self.futures.submit(self._on_trainer(new_id, create), prefix="create",
                                                        session=session_id)
        return {"request_id": self.creating[new_id], "model_id": new_id}

    # ------------------------------------------------------------------ sampling
    def create_sampler(self, session_id: str, seq_id: int, model_path: str | None, base_model: str | None) -> str:
        sampler_id = f"{session_id}:sample:{seq_id}"
        if model_path is None:
            self.samplers[sampler_id] = Sampler(None, None, None, self.base(base_model).name)
            return sampler_id
        saved = self.checkpoint(model_path)
        if saved.kind != "sampler":
            raise UserError(f"{model_path} is a training state; sample from a sampler checkpoint "
                            "(save_weights_for_sampler) of it")
        self.samplers[sampler_id] = Sampler(model_path, model_path, saved.adapters, saved.base, saved)
        return sampler_id

    def _keep_unnamed(self, model_id: str, sampler_id: str) -> None:
        kept = self.unnamed.setdefault(model_id, [])
        kept.append(sampler_id)
        while len(kept) > self.unnamed_kept:
            old = kept.pop(0)
            del self.samplers[old]
            self.forgotten[old] = (f"sampling session {old!r} was forgotten: this server keeps the last "
                                   f"{self.unnamed_kept} unnamed samplers of a training client; "
                                   "save_weights_for_sampler(name) keeps one until it is deleted")

    def get_sampler(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise NotFound(self.forgotten.get(sampler_id, f"no sampling session {sampler_id!r} on this server"))
        return self.samplers[sampler_id]

    def sample(self, sampler_id: str, call: SampleCall) -> dict[str, Any]:
        """``call`` checked here, at the door (a :class:`UserError`, 400), then queued on the engine."""
        sampler = self.get_sampler(sampler_id)
        engine = self.bases[sampler.base].sampler
        request = engine.check(call)

        async def work() -> Outcome:
            if sampler.checkpoint is not None and sampler.checkpoint.deleted:
                raise UserError(f"the sampler's checkpoint {sampler.model_path} was deleted; nothing samples it now")
            rows, prompt_lps = await engine.sample(sampler.key, sampler.adapters, request)
            return Outcome(sample_proto(rows, prompt_lps), PROTO)

        request_id = self.futures.submit(work(), prefix="sample", session=_session(sampler_id))
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(call.num_samples)]}

    # ------------------------------------------------------------------ checkpoints
    def list_checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        return [checkpoint_entry(c) for c in self.checkpoints.values() if c.run_id == run_id and not c.deleted]

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        """Forgets the checkpoint and removes its directory; samplers of it fail from then on."""
        saved = self.checkpoint(f"tinker://{run_id}/{checkpoint_id}")
        saved.deleted, saved.adapters, saved.token = True, None, None
        shutil.rmtree(saved.directory, ignore_errors=True)

    def weights_info(self, path: str) -> dict[str, Any]:
        saved = self.checkpoint(path)
        lora = saved.lora
        return {"base_model": saved.base, "is_lora": True, "lora_rank": lora.rank, "train_unembed": lora.train_unembed,
                "train_mlp": lora.train_mlp, "train_attn": lora.train_attn}
