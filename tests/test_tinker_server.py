"""``asyncrl serve-tinker`` driven by Tinker's official SDK (``tinker``, nothing of it changed
but ``base_url``): training clients, losses, optimizer steps, sampling clients, saved states,
the async API, idempotent retries and the refusals, on the shipped tiny policy
(models/addition-tiny). The server runs in this process on a free port, on its own thread and
event loop, and is shut down when the module's tests end, failed or not."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402

from tinker_server import NAME, POLICY, TOKENS, ServerThread, tiny_config  # noqa: E402

KEY = "tml-asyncrl-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with ServerThread(tiny_config(tmp_path_factory.mktemp("tinker"), api_key=KEY)) as running:
        yield running


@pytest.fixture
def service_client(server: ServerThread):
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as client:
        yield client


def datum(tokens: list[int] = TOKENS, weight: float = 1.0) -> types.Datum:
    """Next-token prediction over ``tokens``, every target weighted ``weight``."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [weight] * (len(tokens) - 1)})


def train(client, steps: int, lr: float = 1e-2) -> None:
    for _ in range(steps):
        client.forward_backward([datum()], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=lr)).result()


def forward_logprobs(client) -> list[float]:
    return client.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def test_capabilities_name_the_configured_base_model(server):
    caps = tinker.RestClient(base_url=server.url, api_key=KEY).get_server_capabilities().result()
    assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [(NAME, 32)]


def test_a_wrong_key_is_refused(server):
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=server.url, api_key="tml-wrong").get_server_capabilities().result()


def test_supervised_steps_lower_the_loss_and_forward_reads_what_forward_backward_trains(service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=1).result()
    assert client.get_tokenizer().encode("12+34=46") == TOKENS  # loaded from the server's model directory
    before = client.forward([datum()], "cross_entropy").result()
    fb = client.forward_backward([datum()], "cross_entropy").result()
    assert fb.loss_fn_outputs[0]["logprobs"].tolist() == before.loss_fn_outputs[0]["logprobs"].tolist()
    assert fb.metrics["loss:sum"] == pytest.approx(-sum(before.loss_fn_outputs[0]["logprobs"].tolist()), rel=1e-6)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    train(client, 4)
    after = client.forward([datum()], "cross_entropy").result()
    assert after.metrics["loss:sum"] < before.metrics["loss:sum"] - 1.0


def test_per_datum_weights_scale_each_datums_loss(service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    one = client.forward([datum(weight=1.0)], "cross_entropy").result().metrics["loss:sum"]
    mixed = client.forward([datum(weight=2.0), datum(weight=0.0)], "cross_entropy").result().metrics["loss:sum"]
    assert mixed == pytest.approx(2 * one, rel=1e-6)


def test_a_sampler_of_an_older_checkpoint_keeps_sampling_its_weights(service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=2).result()
    train(client, 2)
    path = client.save_weights_for_sampler("older").result().path
    assert path.endswith("/sampler_weights/older")
    older = service_client.create_sampling_client(model_path=path).result()
    prompt = types.ModelInput.from_ints(TOKENS)
    first = older.compute_logprobs(prompt).result()
    train(client, 3)
    newer = client.save_weights_and_get_sampling_client().result()
    newest = newer.compute_logprobs(prompt).result()
    assert older.compute_logprobs(prompt).result() == first  # the older weights, after the engine held newer ones
    assert newest != first
    # the engine's merged weights compute the learner's adapter forward (float32 rounding apart)
    learner = forward_logprobs(client)
    assert newest[1:] == pytest.approx(learner, abs=1e-4)


def test_sampling_honours_num_samples_stops_and_reports_its_logprobs(service_client):
    sampler = service_client.create_sampling_client(base_model=NAME).result()
    prompt = types.ModelInput.from_ints(TOKENS[:6])
    drawn = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])).result()
    assert len(drawn.sequences) == 3
    for seq in drawn.sequences:
        assert (len(seq.tokens), seq.stop_reason) == (6, "length")  # stop=[]: not even EOS ends it
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS[:6] + seq.tokens)).result()
        assert seq.logprobs == pytest.approx(scored[6:], abs=1e-4)
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    tokens = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    by_id = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[tokens[1]])).result()
    assert (by_id.sequences[0].tokens, by_id.sequences[0].stop_reason) == (tokens[:2], "stop")
    stop_text = tinker_tokenizer().decode(tokens[2:4])
    by_text = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=stop_text)).result()
    assert tinker_tokenizer().decode(by_text.sequences[0].tokens).endswith(stop_text)
    assert by_text.sequences[0].stop_reason == "stop"


def tinker_tokenizer():
    """The policy's tokenizer (a sampling client's get_tokenizer() looks its base model's name up
    on the hub; a training client's loads the server's model directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(POLICY)


def test_a_saved_state_resumes_with_its_optimizer(service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=3).result()
    train(client, 2)
    path = client.save_state("resume-me").result().path
    train(client, 1)
    continued = forward_logprobs(client)
    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    train(resumed, 1)
    assert forward_logprobs(resumed) == pytest.approx(continued, abs=1e-6)
    existing = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=9).result()
    with pytest.warns(FutureWarning, match="load_state"):  # the SDK's older call, on a client of the same shape
        existing.load_state_with_optimizer(path).result()
    train(existing, 1)
    assert forward_logprobs(existing) == pytest.approx(continued, abs=1e-6)
    fresh_optimizer = service_client.create_training_client_from_state(path).result()
    train(fresh_optimizer, 1)
    assert forward_logprobs(fresh_optimizer) != pytest.approx(continued, abs=1e-6)  # Adam's moments were reset


def test_clients_on_one_base_model_train_apart(service_client):
    a = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=4).result()
    b = service_client.create_lora_training_client(base_model=NAME, rank=8, seed=4).result()
    b_before = forward_logprobs(b)
    train(a, 3)
    assert forward_logprobs(b) == b_before
    assert forward_logprobs(a) != b_before


def _retrieve(http: httpx.Client, request_id: str) -> httpx.Response:
    for _ in range(60):
        reply = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if "json" not in reply.headers["content-type"] or reply.json().get("type") != "try_again":
            return reply
        time.sleep(0.1)
    raise AssertionError(f"{request_id} never finished")


def test_a_retried_training_call_is_applied_once(server, service_client):
    retried = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=5).result()
    once = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=5).result()
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum()], loss_fn="cross_entropy"),
        model_id=retried.model_id, seq_id=1000)
    body = forward_backward_request_to_proto(request).SerializeToString()
    with httpx.Client(base_url=server.url, headers={"X-API-Key": KEY}) as http:
        sent = [http.post("/api/v1/forward_backward", content=body,
                          headers={"Content-Type": "application/x-protobuf"}).json() for _ in range(2)]
        assert sent[0]["request_id"] == sent[1]["request_id"]  # the retry is the first call
        output = deserialize_forward_backward_output(_retrieve(http, sent[0]["request_id"]).content)
        step = {"adam_params": {"learning_rate": 1e-2}, "model_id": retried.model_id, "seq_id": 1001}
        assert _retrieve(http, http.post("/api/v1/optim_step", json=step).json()["request_id"]).status_code == 200
    assert output.metrics["loss:sum"] > 0
    train(once, 1)
    assert forward_logprobs(retried) == forward_logprobs(once)  # one gradient, one step: not two


def test_the_async_api_samples_beside_training(server):
    async def main() -> tuple[float, int, list[float | None], list[float | None]]:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        training = await client.create_lora_training_client(base_model=NAME, rank=4)
        older = await training.save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints(TOKENS)
        before = await older.compute_logprobs(prompt)
        # one engine samples the older weights while the trainer steps
        fb = training.forward_backward([datum()], "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))
        drawn, result, _ = await asyncio.gather(older.sample(types.ModelInput.from_ints(TOKENS[:6]), 2,
                                                             types.SamplingParams(max_tokens=3)), fb, step)
        after = await older.compute_logprobs(prompt)
        await client.close("success")
        return result.metrics["loss:sum"], len(drawn.sequences), before, after

    loss, samples, before, after = asyncio.run(main())
    assert loss > 0 and samples == 2
    assert after == before  # the sampler's weights are the ones it was made with


# ---------------------------------------------------------------------- refusals, in the SDK's shape
def test_an_unknown_base_model_is_refused_naming_the_served_one(service_client):
    with pytest.raises(tinker.BadRequestError, match=f"'Qwen/Qwen3-8B' is not served here.*'{NAME}'"):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()


def test_a_rank_past_the_servers_limit_is_refused(service_client):
    with pytest.raises(tinker.BadRequestError, match="rank=512 is refused.*1 to 128"):
        service_client.create_lora_training_client(base_model=NAME, rank=512).result()


def test_a_datum_whose_lengths_disagree_is_refused_naming_it(service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    short = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * 3})
    with pytest.raises(tinker.BadRequestError, match=r"data\[1\].*'weights'.* has shape \[3\].*7 tokens"):
        client.forward_backward([datum(), short], "cross_entropy").result()


def test_a_loss_the_server_does_not_run_is_refused_naming_those_it_does(service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="'stable_reinforce' is not implemented.*cross_entropy.*ppo"):
        client.forward_backward([datum()], "stable_reinforce").result()


def test_a_sampler_of_a_deleted_checkpoint_is_refused(server, service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    path = client.save_weights_for_sampler("soon-gone").result().path
    sampler = service_client.create_sampling_client(model_path=path).result()
    prompt, params = types.ModelInput.from_ints(TOKENS[:4]), types.SamplingParams(max_tokens=2)
    assert len(sampler.sample(prompt, 1, params).result().sequences) == 1
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    listed = rest.list_checkpoints(client.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("sampler_weights/soon-gone", "sampler", path)]
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(client.model_id).result().checkpoints == []
    with pytest.raises(tinker.RequestFailedError, match="soon-gone was deleted"):
        sampler.sample(prompt, 1, params).result()
    with pytest.raises(tinker.NotFoundError, match="soon-gone.*was deleted"):
        service_client.create_sampling_client(model_path=path).result()


def test_unnamed_samplers_past_the_kept_number_are_refused_naming_why(server, service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    kept, server.service.unnamed_kept = server.service.unnamed_kept, 2
    try:
        samplers = [client.save_weights_and_get_sampling_client().result() for _ in range(3)]
    finally:
        server.service.unnamed_kept = kept
    prompt, params = types.ModelInput.from_ints(TOKENS[:4]), types.SamplingParams(max_tokens=2)
    assert len(samplers[2].sample(prompt, 1, params).result().sequences) == 1
    with pytest.raises(tinker.NotFoundError, match="keeps the last 2 unnamed samplers.*save_weights_for_sampler"):
        samplers[0].sample(prompt, 1, params).result()


def test_a_checkpoint_name_that_would_leave_its_directory_is_refused(service_client):
    client = service_client.create_lora_training_client(base_model=NAME, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=r"checkpoint name '\.\.'"):
        client.save_state("..").result()


def test_external_weights_download_as_the_peft_adapter_the_client_trained(server, service_client, tmp_path):
    """``save_weights_external`` then ``get_external_weights_urls``: each file downloads, with no
    key, from the URL the server issued; the adapter they make is the client's own (its
    sampler's logprobs are the engine's with those adapters merged) — what a learner by URL
    hands its engines. A deleted checkpoint's URLs stop working."""
    from asyncrl.engine.remote_wire import read_peft_adapter

    client = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=3).result()
    train(client, 2)
    path = client.save_weights_external("v2").result().path
    assert path == f"tinker://{client.model_id}/external_weights/v2"
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    urls = rest.get_external_weights_urls(path).result().urls
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(urls)  # peft adds a README.md
    for name, url in urls.items():
        response = httpx.get(url)  # no key: the URL is the signature
        assert response.status_code == 200, (name, response.text)
        (tmp_path / name).write_bytes(response.content)
    downloaded = read_peft_adapter(tmp_path)
    trained = server.service.run(client.model_id).adapters()
    assert downloaded.rank == trained.rank == 4 and downloaded.alpha == trained.alpha
    assert sorted(downloaded.layers) == sorted(trained.layers)
    for name, layer in trained.layers.items():
        assert torch.equal(downloaded.layers[name].a, layer.a) and torch.equal(downloaded.layers[name].b, layer.b)
    assert any(layer.b.abs().sum() > 0 for layer in trained.layers.values()), "two steps moved the adapters"
    assert httpx.get(urls["adapter_config.json"].replace("/files/", "/files/x")).status_code == 404
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert httpx.get(urls["adapter_config.json"]).status_code == 404


def test_gspo_is_served_as_tinkers_formula_on_the_servers_own_logprobs(service_client):
    """``gspo`` through the SDK: its ``loss:sum`` is Tinker's published formula on the logprobs
    the server's ``forward`` computes (the sequence ratio over the answer's tokens only)."""
    client = service_client.create_lora_training_client(base_model=NAME, rank=4, seed=6).result()
    lp = forward_logprobs(client)
    n = len(lp)
    sampled = [x - 0.05 * (i % 3) for i, x in enumerate(lp)]
    advantages, in_ratio = [0.0] * 5 + [1.5] * (n - 5), [0.0] * 5 + [1.0] * (n - 5)  # the answer "46" and EOS
    row = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={
        "target_tokens": TOKENS[1:], "logprobs": sampled, "advantages": advantages,
        "sequence_ratio_mask": in_ratio})
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    got = client.forward_backward([row], "gspo", config).result().metrics["loss:sum"]
    s = torch.exp((torch.tensor(lp) - torch.tensor(sampled))[torch.tensor(in_ratio) != 0].mean())
    assert got == pytest.approx(float(-torch.minimum(s * torch.tensor(advantages),
                                                     s.clamp(0.8, 1.2) * torch.tensor(advantages)).sum()), rel=1e-5)
