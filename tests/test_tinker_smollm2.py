"""``asyncrl serve-tinker`` on a real model, SmolLM2-135M-Instruct, named as configured: the
SDK's supervised loop on a chat-rendered conversation (loss only on the assistant's tokens),
its tokenizer from the server's directory, a stop string that is the chat template's end of
turn, and a sampler computing the learner's logprobs. Skipped until the model is fetched
(``asyncrl models get smollm2-135m-instruct``)."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker import types  # noqa: E402

from asyncrl.config import Config  # noqa: E402
from asyncrl.model_store import cached_model  # noqa: E402

from test_tinker_server import ServerThread  # noqa: E402

NAME = "smollm2-135m-instruct"


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


@pytest.mark.slow
def test_supervised_steps_and_sampling_on_smollm2(tmp_path):
    if cached_model(NAME) is None:
        pytest.skip(f"{NAME} is not cached: asyncrl models get {NAME}")
    cfg = Config.model_validate({"model": {"path": NAME, "device": "cpu"}, "output_dir": str(tmp_path),
                                 "tinker": {"port": 0}})
    with ServerThread(cfg) as server, tinker.ServiceClient(base_url=server.url, api_key="tml-local") as service:
        training = service.create_lora_training_client(base_model=NAME, rank=8, seed=0).result()
        tokenizer = training.get_tokenizer()
        chat = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3 = 5."}]
        ids = _ids(tokenizer.apply_chat_template(chat, tokenize=True))
        prompt = _ids(tokenizer.apply_chat_template(chat[:1], tokenize=True, add_generation_prompt=True))
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(ids) - len(prompt))
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})
        losses = []
        for _ in range(4):
            step = training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            losses.append(step.result().metrics["loss:sum"])
        assert losses[-1] < losses[0] / 4
        sampler = training.save_weights_and_get_sampling_client().result()
        drawn = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                               types.SamplingParams(max_tokens=12, temperature=0.7, stop=["<|im_end|>"])).result()
        for seq in drawn.sequences:
            assert seq.stop_reason == "stop" and tokenizer.decode(seq.tokens).endswith("<|im_end|>")
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
        learner = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert scored[1:] == pytest.approx(learner, abs=1e-4)  # the engine's merged weights, the learner's forward
