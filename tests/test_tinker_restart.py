"""A ``serve-tinker`` that dies with a training call under way, restarted on the same port and
checkpoint directory: the SDK's pending call and its next one fail in seconds with 404s in the
SDK's shape that say the server restarted and name the client's saved states; nothing is
applied twice (the dead server's step died with it) and nothing saved is lost (a client
created from the saved state computes what the client computed when it saved)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker import types  # noqa: E402
from tinker_server import ServerThread  # noqa: E402

from asyncrl.config import Config  # noqa: E402

POLICY = Path(__file__).resolve().parents[1] / "models" / "addition-tiny"
TOKENS = [6, 7, 16, 8, 9, 22, 9, 11]  # "12+34=46" in the tiny policy's characters


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})


def test_a_server_that_died_mid_call_is_said_and_the_saved_state_continues(tmp_path):
    with socket.socket() as s:  # one port for both lives of the server: the client keeps its base_url
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = Config.model_validate({"model": {"path": str(POLICY), "device": "cpu"}, "output_dir": str(tmp_path),
                                 "tinker": {"port": port, "base_model": "addition-tiny"}})
    with ServerThread(cfg) as first:
        service = tinker.ServiceClient(base_url=first.url, api_key="tml-test")
        client = service.create_lora_training_client(base_model="addition-tiny", rank=4, seed=7).result()
        client.forward_backward([datum()], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = client.save_state("before-the-crash").result().path
        at_save = client.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        pending = client.forward_backward([datum()] * 32, "cross_entropy")
    with ServerThread(cfg):  # the same port and checkpoint directory, a new process's memory
        with pytest.raises((tinker.NotFoundError, ValueError)) as died:
            pending.result(timeout=120)
        assert "restarted" in str(died.value)
        with pytest.raises(tinker.NotFoundError) as again:
            client.forward_backward([datum()], "cross_entropy").result(timeout=120)
        assert "restarted" in str(again.value) and saved in str(again.value)
        resumed = service.create_training_client_from_state_with_optimizer(saved).result()
        assert resumed.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == at_save
        service.close("success").result()
