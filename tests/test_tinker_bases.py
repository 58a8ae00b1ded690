"""Several base models on one ``serve-tinker`` (``tinker.models``), through Tinker's SDK: each is
listed, a training client trains on the base its create names and a sampler samples its own
(their logprobs are that model's own, computed here beside), a saved state brings its base
back, and a base not served is refused naming those that are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker import types  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncrl.algorithms import token_logprobs  # noqa: E402
from tinker_server import NAME, POLICY, TOKENS, ServerThread, tiny_config  # noqa: E402

OTHER = "countdown-tiny"
OTHER_PATH = Path(__file__).resolve().parents[1] / "models" / OTHER  # the same vocabulary, other weights


def own_logprobs(path: Path) -> list[float]:
    """log p(TOKENS[t+1] | TOKENS[:t+1]) under the model at ``path``, computed here."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits
    return token_logprobs(logits, torch.tensor([TOKENS[1:]]))[0].tolist()


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})


def test_each_client_and_sampler_runs_on_the_base_it_names(tmp_path):
    expected = {NAME: own_logprobs(POLICY), OTHER: own_logprobs(OTHER_PATH)}
    assert max(abs(a - b) for a, b in zip(*expected.values())) > 0.1  # the two bases tell apart
    with ServerThread(tiny_config(tmp_path, models={OTHER: str(OTHER_PATH)})) as server:
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-test")
        caps = tinker.RestClient(base_url=server.url, api_key="tml-test").get_server_capabilities().result()
        assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [(NAME, 32), (OTHER, 128)]
        for name, want in expected.items():
            training = service.create_lora_training_client(base_model=name, rank=4, seed=1).result()
            assert training.get_info().model_data.model_name == name
            got = training.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            assert got == pytest.approx(want, abs=1e-5)  # fresh adapters (B = 0): the base's own logprobs
            sampler = service.create_sampling_client(base_model=name).result()
            prompt = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
            assert prompt[1:] == pytest.approx(want, abs=1e-4)  # the engine's own forward: its rounding
        saved = training.save_state("other").result().path  # the last client: OTHER's
        resumed = service.create_training_client_from_state(saved).result()
        assert resumed.get_info().model_data.model_name == OTHER
        with pytest.raises(tinker.BadRequestError, match=rf"'nope' is not served here; this server serves '{NAME}', "
                                                          rf"'{OTHER}'"):
            service.create_lora_training_client(base_model="nope", rank=4).result()
        service.close("success").result()
