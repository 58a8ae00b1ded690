"""A ``serve-tinker`` that dies with a training call under way, restarted on the same port and
checkpoint directory: the SDK's pending call and its next one fail in seconds with 404s that say
the server restarted (the pending one's poll as the SDK raises it: ``ValueError`` from
``NotFoundError``; the next call ``NotFoundError``) and name the client's saved states; nothing is
applied twice (the dead server's step died with it) and nothing saved is lost (a client
created from the saved state computes what the client computed when it saved)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker_server import NAME, TOKENS, ServerThread, tiny_config  # noqa: E402


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})


def test_a_server_that_died_mid_call_is_said_and_the_saved_state_continues(tmp_path):
    with socket.socket() as s:  # one port for both lives of the server: the client keeps its base_url
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tiny_config(tmp_path, port=port)
    with ServerThread(cfg) as first:
        service = tinker.ServiceClient(base_url=first.url, api_key="tml-test")
        client = service.create_lora_training_client(base_model="addition-tiny", rank=4, seed=7).result()
        client.forward_backward([datum()], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = client.save_state("before-the-crash").result().path
        at_save = client.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        first.service.futures.cut = lambda reason: []  # a crash: nothing is told its request was cut
        trainer = first.service._trainer
        # under way until the stop closes the training thread, so the request queued behind it never runs
        # (a fixed sleep let it run, and answer, on a loaded machine that took longer to get here)
        trainer.submit("other", lambda: _until(lambda: trainer._closed))
        requests = first.service.runs[client.model_id].requests
        issued = len(requests)
        pending = client.forward_backward([datum()] * 32, "cross_entropy")
        _until(lambda: len(requests) > issued)  # the dead server took it, and died with it unfinished
    with ServerThread(cfg):  # the same port and checkpoint directory, a new process's memory
        with pytest.raises(ValueError) as died:  # the SDK's poll raises a 404 so (tinker 0.38), from NotFoundError
            pending.result(timeout=120)
        assert isinstance(died.value.__cause__, tinker.NotFoundError) and "restarted" in str(died.value)
        with pytest.raises(tinker.NotFoundError) as again:
            client.forward_backward([datum()], "cross_entropy").result(timeout=120)
        assert "restarted" in str(again.value) and saved in str(again.value)
        resumed = service.create_training_client_from_state_with_optimizer(saved).result()
        assert resumed.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == at_save
        service.close("success").result()


def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within 60 s"
        time.sleep(0.01)


def test_a_stopping_server_cuts_what_is_unfinished_within_seconds_and_says_so(tmp_path, capsys):
    """Ctrl-C's path (``TinkerServer.stop``): with six calls queued and the first under way (a
    forward of half a minute: every module made slow), the server stops within a few seconds —
    the running call ends at its next module — each request's outcome says it was cut, and
    stderr lists them."""
    with ServerThread(tiny_config(tmp_path)) as running:
        client = tinker.ServiceClient(base_url=running.url, api_key="tml-test").create_lora_training_client(
            base_model=NAME, rank=4).result()
        model = running.service.runs[client.model_id].state.model
        for module in model.modules():  # each module call a slow layer: one forward takes ~half a minute
            module.register_forward_pre_hook(lambda *_: time.sleep(0.5))
        with httpx.Client(base_url=running.url) as http:
            queued = [http.post("/api/v1/forward_backward", headers={"Content-Type": "application/x-protobuf"},
                                content=forward_backward_request_to_proto(types.ForwardBackwardRequest(
                                    forward_backward_input=types.ForwardBackwardInput(data=[datum()] * 4,
                                                                                      loss_fn="cross_entropy"),
                                    model_id=client.model_id, seq_id=100 + k)).SerializeToString()
                                ).json()["request_id"] for k in range(6)]
        start = time.monotonic()
    took = time.monotonic() - start
    assert took < 5, f"the server took {took:.1f} s to stop"
    outcomes = [running.service.futures._futures[request_id].result() for request_id in queued]
    assert all("it was cut" in o.error and o.category == "server" for o in outcomes)
    err = capsys.readouterr().err
    assert "asyncrl serve-tinker: stopping; cut 6 unfinished requests (6 train)" in err
    assert all(request_id in err for request_id in queued)


def test_a_retried_request_is_answered_once_also_by_a_restarted_server(tmp_path):
    """The SDK's retry (the same body and ``X-Idempotency-Key``) of an optimizer step and of a
    sample gets the first answer back and runs nothing; after a restart the step's retry still
    gets its first answer (whose poll says it died with the old server), not a second step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tiny_config(tmp_path, port=port)
    step = types.OptimStepRequest(model_id="", seq_id=1000, adam_params=types.AdamParams(learning_rate=1e-2))
    with ServerThread(cfg) as first:
        service = tinker.ServiceClient(base_url=first.url, api_key="tml-test")
        client = service.create_lora_training_client(base_model=NAME, rank=4, seed=7).result()
        client.forward_backward([datum()], "cross_entropy").result()
        service.create_sampling_client(base_model=NAME).result()
        (sampler_id,) = first.service.samplers  # the one sampling session
        sample = types.SampleRequest(num_samples=1, prompt=types.ModelInput.from_ints(TOKENS[:4]),
                                     sampling_params=types.SamplingParams(max_tokens=2), seq_id=1,
                                     sampling_session_id=sampler_id)
        body = step.model_copy(update={"model_id": client.model_id}).model_dump(mode="json")
        steps = [_post(first.url, "optim_step", body, "step-1") for _ in range(2)]
        samples = [_post(first.url, "asample", sample.model_dump(mode="json"), "sample-1") for _ in range(2)]
        assert steps[0] == steps[1] and samples[0] == samples[1]  # each the one request id
        assert _result(first.url, steps[0]["request_id"]).status_code == 200
        assert first.service.runs[client.model_id].state.version == 1  # one step taken
        following = _post(first.url, "optim_step", {**body, "seq_id": 1001}, "step-2")  # the client's next call
        assert following != steps[0] and _result(first.url, following["request_id"]).status_code == 200
        assert first.service.runs[client.model_id].state.version == 2
    with ServerThread(cfg) as second:
        assert _post(second.url, "optim_step", body, "step-1") == steps[0]  # the first answer, from disk
        gone = _result(second.url, steps[0]["request_id"])
        assert gone.status_code == 404 and "restarted" in gone.text
        assert not second.service.runs  # nothing was created or stepped again
        unknown = httpx.post(f"{second.url}/api/v1/optim_step", json=body, headers={"X-Idempotency-Key": "step-3"})
        assert unknown.status_code == 404  # without the key's answer: the client died with the first server


def _post(url: str, route: str, body: dict, key: str) -> dict:
    answer = httpx.post(f"{url}/api/v1/{route}", json=body, headers={"X-Idempotency-Key": key}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _result(url: str, request_id: str) -> httpx.Response:
    """The request's result, polled until it is no longer running."""
    while (answer := httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": request_id}, timeout=60)
           ).status_code == 200 and answer.json().get("type") == "try_again":
        pass
    return answer


def test_a_training_run_is_read_back_with_its_metadata_and_checkpoints_also_after_a_restart(tmp_path):
    """``RestClient.get_training_run`` (what tinker-cookbook reads a checkpoint's renderer from):
    the create's ``user_metadata``, base, rank and latest saved state and sampler checkpoint;
    after a restart the record and the saved state still (sampler checkpoints live in memory)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg, metadata = tiny_config(tmp_path, port=port), {"renderer_name": "role_colon", "note": "sft"}
    with ServerThread(cfg) as first:
        service = tinker.ServiceClient(base_url=first.url, api_key="tml-test")
        client = service.create_lora_training_client(base_model=NAME, rank=4, user_metadata=metadata).result()
        plain = service.create_lora_training_client(base_model=NAME, rank=2).result()
        state = client.save_state("first").result().path
        sampler = client.save_weights_for_sampler("for-sampling").result().path
        rest = tinker.RestClient(base_url=first.url, api_key="tml-test")
        run = rest.get_training_run_by_tinker_path(sampler).result()
        assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank, run.user_metadata) == (
            client.model_id, NAME, True, 4, metadata)
        assert (run.last_checkpoint.tinker_path, run.last_checkpoint.checkpoint_type) == (state, "training")
        assert (run.last_sampler_checkpoint.tinker_path, run.last_sampler_checkpoint.checkpoint_id) == (
            sampler, "sampler_weights/for-sampling")
        other = rest.get_training_run(plain.model_id).result()
        assert (other.lora_rank, other.user_metadata, other.last_checkpoint) == (2, None, None)
        listed = rest.list_training_runs(limit=1, offset=1).result()
        assert [r.training_run_id for r in listed.training_runs] == [plain.model_id]
        assert listed.cursor.total_count == 2
        service.close("success").result()
    with ServerThread(cfg) as second:
        rest = tinker.RestClient(base_url=second.url, api_key="tml-test")
        run = rest.get_training_run(client.model_id).result()
        assert (run.base_model, run.lora_rank, run.user_metadata) == (NAME, 4, metadata)
        assert (run.last_checkpoint.tinker_path, run.last_sampler_checkpoint) == (state, None)
        service = tinker.ServiceClient(base_url=second.url, api_key="tml-test")
        resumed = service.create_training_client_from_state(state, user_metadata={"from": "first"}).result()
        assert rest.get_training_run(resumed.model_id).result().user_metadata == {"from": "first"}
        with pytest.raises(tinker.NotFoundError, match="no training run 'sess-gone:train:0' on this server"):
            rest.get_training_run("sess-gone:train:0").result()
        service.close("success").result()
