"""``asyncrl serve-tinker`` checks every request at the door, before it reaches a thread every
client shares, and a failure inside the engine fails one request: driven by Tinker's SDK on the
shipped tiny policy (vocabulary 261, context 32), the server on its own thread and free port,
stopped when the module's tests end, failed or not."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from asyncrl.tinker.futures import UserError  # noqa: E402
from asyncrl.tinker.service import SESSION_EXPIRY_S  # noqa: E402
from asyncrl.tinker.training import check_adam  # noqa: E402
import test_tinker_server as served  # noqa: E402
from test_tinker_server import KEY, datum  # noqa: E402
from tinker_server import NAME, TOKENS  # noqa: E402

VOCAB, CONTEXT = 261, 32
server, service_client = served.server, served.service_client  # the tiny policy's server, this module's own


def draw(sampler, prompt: list[int] = TOKENS[:6]) -> list[int]:
    params = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
    return sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0].tokens


def test_a_prompt_the_engine_cannot_run_is_refused_at_the_door_and_every_client_still_samples(service_client):
    training = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    samplers = [service_client.create_sampling_client(base_model=NAME).result(),
                training.save_weights_and_get_sampling_client().result()]
    before = [draw(s) for s in samplers]
    refused = {
        "outside": ([6, 7, VOCAB, 8], rf"prompt position 2 holds token id {VOCAB}, outside this model's vocabulary "
                                      rf"of {VOCAB} \(ids 0 to {VOCAB - 1}\)"),
        "negative": ([-1, 7, 10**9], r"prompt position 0 holds token id -1.*; 2 of the prompt's 3 tokens are outside"),
        "too long": ([6] * CONTEXT, rf"the prompt has {CONTEXT} tokens; the model's context holds {CONTEXT}"),
        "empty": ([], "the prompt is empty"),
    }
    for what, (prompt, message) in refused.items():
        with pytest.raises(tinker.BadRequestError, match=message):
            samplers[0].sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.BadRequestError, match=f"token id {VOCAB + 5}"):
        samplers[1].compute_logprobs(types.ModelInput.from_ints([6, VOCAB + 5])).result()
    with pytest.raises(tinker.BadRequestError, match="num_samples=1025; this server draws 1 to 1024 a request"):
        samplers[0].sample(types.ModelInput.from_ints(TOKENS[:3]), 1025, types.SamplingParams(max_tokens=1)).result()
    with pytest.raises(tinker.BadRequestError, match="top_p must be in"):
        samplers[0].sample(types.ModelInput.from_ints(TOKENS[:3]), 1, types.SamplingParams(top_p=0.0)).result()
    assert [draw(s) for s in samplers] == before  # both clients sample on, what they sampled before


def test_a_request_that_fails_inside_the_engine_fails_alone(server, service_client):
    """An error the door does not foresee (a hook on the embedding raising on a prompt holding
    ``POISON``, on the engine's model and on the base a fresh engine is copied from) ends the
    engine thread under every request batched with it; the others are served all the same, the
    culprit fails by itself, and the engine samples on."""
    poison, armed = 120, [True]

    def hook(module, args):
        ids = args[0]
        if armed[0] and ids.shape[-1] > 1 and bool((ids == poison).any()):  # prefills only: decode is (B, 1)
            raise RuntimeError("poisoned prompt")

    base = server.service.bases[NAME]
    sampler_before = base.sampler.engine
    handles = [m.get_input_embeddings().register_forward_pre_hook(hook) for m in (sampler_before.model, base.model)]
    training = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    samplers = [service_client.create_sampling_client(base_model=NAME).result(),
                training.save_weights_and_get_sampling_client().result()]
    alone = [draw(s) for s in samplers]  # on the engine, the hook armed: these prompts pass it
    params = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])

    async def together() -> list[object]:
        bad = samplers[0].sample(types.ModelInput.from_ints([6, 7, poison]), 1, params)
        good = [s.sample(types.ModelInput.from_ints(TOKENS[:6]), 1, params) for s in samplers for _ in range(2)]
        return await asyncio.gather(bad, *good, return_exceptions=True)

    try:
        bad, *good = asyncio.run(together())
    finally:
        armed[0] = False
        for handle in handles:
            handle.remove()
    assert isinstance(bad, tinker.RequestFailedError) and "alone on a fresh engine" in str(bad), bad
    assert "poisoned prompt" in str(bad)
    assert [g.sequences[0].tokens for g in good] == [alone[0], alone[0], alone[1], alone[1]]
    assert base.sampler.engine is not sampler_before  # it did die, and was replaced
    assert [draw(s) for s in samplers] == alone


@pytest.mark.parametrize(("adam", "message"), [
    ({"learning_rate": 1e6}, r"learning_rate=1000000.0 is outside \[0, 1.0\]"),
    ({"learning_rate": -1e-3}, r"learning_rate=-0.001 is outside"),
    ({"beta1": 1.0}, r"beta1=1.0 is outside \[0, 1\)"),
    ({"beta2": -0.1}, r"beta2=-0.1 is outside"),
    ({"eps": 0.0}, "eps=0.0 is not above 0"),
    ({"learning_rate": 0.1, "weight_decay": 10.0}, r"learning_rate × weight_decay = 1 >= 1"),
    ({"grad_clip_norm": -1.0}, r"grad_clip_norm=-1.0 is negative \(0: no clip\)"),
])
def test_absurd_adam_settings_are_refused_at_the_door(service_client, adam, message):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    client.forward_backward([datum()], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=message):
        client.optim_step(types.AdamParams(**adam)).result()
    before = client.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # the gradient is still there: it steps
    assert client.forward([datum()], "cross_entropy").result().metrics["loss:sum"] < before


def test_non_finite_adam_settings_are_refused_naming_each():
    """NaN and ±inf (the SDK sends them as null, which its own type refuses; a raw client's JSON
    may carry NaN)."""
    adam = types.AdamParams(learning_rate=float("nan"), eps=float("inf")).model_dump()
    with pytest.raises(UserError, match="learning_rate=nan is not a finite number; eps=inf is not a finite number"):
        check_adam(adam)
    check_adam(types.AdamParams().model_dump())  # the SDK's defaults pass


def test_a_request_past_the_token_budget_is_refused_naming_it_and_the_sdk_splits_its_calls(server):
    """A budget of 28 tokens: a raw request of five 7-token datums is refused naming the limit;
    the SDK, told 8 × 28 bytes a chunk by the server (it counts 16 bytes a token of a
    ``cross_entropy`` datum), sends the same call as three requests of two datums at most,
    whose sum is what five one-datum calls compute."""
    budget, server.service.max_request_tokens = server.service.max_request_tokens, 28
    try:
        with tinker.ServiceClient(base_url=server.url, api_key=KEY) as service:  # reads the client config now
            client = service.create_lora_training_client(base_model=NAME, rank=4, seed=1).result()
            rows = [datum(TOKENS[:k] + TOKENS[k + 1:] + [9]) for k in range(5)]
            issued = len(server.service.futures._futures)
            split = client.forward(rows, "cross_entropy").result()
            requests = len(server.service.futures._futures) - issued
            one_by_one = [client.forward([row], "cross_entropy").result() for row in rows]
            request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
                data=rows, loss_fn="cross_entropy"), model_id=client.model_id, seq_id=10_000)
            body = forward_backward_request_to_proto(request).SerializeToString()
            with httpx.Client(base_url=server.url, headers={"X-API-Key": KEY}) as http:
                reply = http.post("/api/v1/forward_backward", content=body,
                                  headers={"Content-Type": "application/x-protobuf"})
    finally:
        server.service.max_request_tokens = budget
    assert requests == 3
    assert split.metrics["loss:sum"] == pytest.approx(sum(o.metrics["loss:sum"] for o in one_by_one), rel=1e-6)
    for alone, out in zip(one_by_one, split.loss_fn_outputs, strict=True):  # batched by two: float32 rounding
        assert out["logprobs"].tolist() == pytest.approx(alone.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-5)
    assert reply.status_code == 400
    assert "holds 35 tokens in 5 datums; this server takes at most 28 tokens a request" in reply.text


def test_a_forward_backward_the_server_cannot_run_is_refused_before_it_queues(service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=rf"data\[1\] has token {VOCAB}, outside.*vocabulary of {VOCAB}"):
        client.forward_backward([datum(), datum(TOKENS[:3] + [VOCAB])], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=f"data\\[0\\] has {CONTEXT + 1} input tokens; .* 1 to {CONTEXT}"):
        client.forward([datum([6] * (CONTEXT + 2))], "cross_entropy").result()


def test_a_cancelled_request_and_one_whose_client_went_away_never_run(server, service_client):
    """Two ``forward_backward`` requests queued behind a running call: one cancelled by its
    client (``cancel_future``), one of a session silent past ``SESSION_EXPIRY_S`` (``reap``).
    Each poll says so, and neither gradient is applied: the next step moves nothing."""
    client = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=8).result()
    before = client.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    release = threading.Event()
    blocker = server.service._trainer.submit("other", lambda: release.wait(60))
    try:
        with httpx.Client(base_url=server.url, headers={"X-API-Key": KEY}) as http:
            queued = [http.post("/api/v1/forward_backward", headers={"Content-Type": "application/x-protobuf"},
                                content=forward_backward_request_to_proto(types.ForwardBackwardRequest(
                                    forward_backward_input=types.ForwardBackwardInput(data=[datum()],
                                                                                      loss_fn="cross_entropy"),
                                    model_id=client.model_id, seq_id=500 + k)).SerializeToString()
                                ).json()["request_id"] for k in range(2)]
            assert http.post("/api/v1/cancel_future", json={"request_id": queued[0]}).status_code == 200
            reaped = server.service.reap(now=time.monotonic() + SESSION_EXPIRY_S + 1)
            polls = [http.post("/api/v1/retrieve_future", json={"request_id": r}).json() for r in queued]
    finally:
        release.set()
    blocker.result(60)
    assert reaped == [queued[1]]
    assert polls == [{"error": "cancelled by its client (cancel_future)", "category": "user"},
                     {"error": "cancelled: its session sent no heartbeat for 60 s (the client went away)",
                      "category": "user"}]
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert client.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == before


def test_a_training_client_the_server_cannot_make_is_refused_before_it_queues(service_client):
    with pytest.raises(tinker.BadRequestError, match="trains no layer of this model.*LM head is tied: True"):
        service_client.create_lora_training_client(base_model=NAME, rank=4, train_mlp=False, train_attn=False).result()
    with pytest.raises(tinker.BadRequestError, match="rank=0 is refused"):
        service_client.create_lora_training_client(base_model=NAME, rank=0).result()


def test_run_metadata_that_get_training_run_could_not_read_and_a_bad_page_are_refused_naming_them(server):
    """``types.TrainingRun`` reads ``user_metadata`` as strings: a create sending other values
    is refused at the door (nothing is created), as is a ``list_training_runs`` page that is no count."""
    headers = {"X-API-Key": KEY}
    session = httpx.post(f"{server.url}/api/v1/create_session", headers=headers, timeout=60, json={
        "tags": [], "user_metadata": None, "sdk_version": tinker.__version__}).json()["session_id"]
    create = types.CreateModelRequest(session_id=session, model_seq_id=0, base_model=NAME,
                                      lora_config=types.LoraConfig(rank=2), user_metadata={"steps": 3})
    refused = httpx.post(f"{server.url}/api/v1/create_model", headers=headers, timeout=60,
                         json=create.model_dump(mode="json"))
    assert refused.status_code == 400 and "user_metadata: its values must be strings" in refused.text
    assert f"{session}:train:0" not in server.service.creating
    page = httpx.get(f"{server.url}/api/v1/training_runs", headers=headers, params={"limit": "-1"}, timeout=60)
    assert page.status_code == 400 and "limit='-1': a whole number from 0 is needed" in page.text
