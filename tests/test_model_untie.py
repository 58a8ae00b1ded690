"""A tied LM head on a fleet: named as the cause and untied by ``asyncrl models untie``.

vLLM's CPU build keeps a packed copy of a tied head that a reload over HTTP does not
refresh (docs/vllm.md). ``engine: remote`` refuses such a server at connect (``vllm serve``
on this CUDA-less machine, by its model card's ``owned_by``), a failed delivery probe on a
fleet names the head rather than the tolerance, and ``asyncrl models untie`` writes the
copy to serve: same logits, the head a tensor of its own. ``models/addition-tiny`` ties its
head, as SmolLM2 does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.cli import main
from asyncrl.config import RemoteConfig, load_config
from asyncrl.engine.remote import RemoteEngine, ServersUnusable
from asyncrl.model_untie import ties_head
from asyncrl.weight_sync.delivery import DeliveryCheck, WeightsNotDelivered

ROOT = Path(__file__).resolve().parents[1]
TIED = str(ROOT / "models/addition-tiny")


def test_untie_writes_a_copy_with_the_same_logits_and_a_head_of_its_own(tmp_path, capsys):
    out = tmp_path / "untied"
    assert main(["models", "untie", TIED, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert ties_head(TIED) and not ties_head(out)
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    source, copy = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (TIED, out))
    head, embeddings = copy.get_output_embeddings().weight, copy.get_input_embeddings().weight
    assert head.data_ptr() != embeddings.data_ptr() and torch.equal(head, embeddings)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(source(ids).logits, copy(ids).logits)
    with torch.no_grad():  # trained, the head moves alone: untied
        copy.get_output_embeddings().weight.add_(1.0)
    assert not torch.equal(copy.get_output_embeddings().weight, copy.get_input_embeddings().weight)
    # nothing to untie, and never over a directory that exists: one line each, exit 2
    assert main(["models", "untie", str(out)]) == 2
    assert main(["models", "untie", TIED, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"asyncrl models untie: {out} does not tie its LM head (tie_word_embeddings is false): serve it "
                   "as it is", f"asyncrl models untie: {out} exists: give another --out, or remove it"]


def _card_server(owner: str):
    """A stand-in server on a free loopback port whose model card says ``owned_by: owner``
    and which answers every other route with ``{}``."""
    from aiohttp import web

    from asyncrl.json_api import listen

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "owned_by": owner, "root": TIED, "max_model_len": 64}]})
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return listen(app, "127.0.0.1", 0)


@pytest.mark.parametrize("owner, model, refused", [("vllm", "tied", True), ("asyncrl", "tied", False),
                                                    ("vllm", "untied", False)])
def test_a_cpu_vllm_server_is_refused_at_connect_for_a_tied_head_naming_it_and_the_untie(
        monkeypatch, tmp_path, owner, model, refused):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the server is vLLM's CPU build
    path = TIED
    if model == "untied":
        path = str(tmp_path / "untied")
        assert main(["models", "untie", TIED, "--out", path]) == 0

    async def run():
        runner, url = await _card_server(owner)
        try:
            engine = await RemoteEngine.connect(RemoteConfig(urls=[url]), model_path=path)
            await engine.shutdown()
            return url, None
        except ServersUnusable as exc:
            return url, str(exc)
        finally:
            await runner.cleanup()

    url, error = asyncio.run(run())
    if not refused:
        assert error is None
        return
    assert error is not None and "\n" not in error
    assert error.startswith(f"remote.urls: engine server {url} is vLLM's CPU build")
    assert "ties its LM head to its input embeddings (tie_word_embeddings)" in error
    assert f"`asyncrl models untie {TIED}`, then start the servers on the copy it prints" in error


class _Handle:
    def __init__(self, answer):
        self.answer = answer

    async def apply(self, fn, *args):
        return self.answer


class _Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False):
        return type("Encoded", (), {"input_ids": [ord(c) % 90 + 1 for c in text]})()


def test_a_failed_probe_on_a_fleet_with_a_tied_head_names_the_head_not_the_tolerance():
    remote = ["engine=remote", "remote.urls=[http://10.0.0.1:8100]", f"model.path={TIED}"]
    cfg = load_config(ROOT / "examples/addition/async.yaml", remote)
    tokenizer = _Tokenizer()
    prompts = len(DeliveryCheck(_Handle([]), _Handle([]), tokenizer, every=1, tolerance=0.1).prompts)
    probed = [([5, 6], [-0.5, -0.5], [1, 1])] * prompts  # what the server sampled, at version 1
    learner = _Handle([[[-2.0, -2.0]] * prompts])  # the learner's logprobs: 1.5 apart
    check = DeliveryCheck.for_config(learner, _Handle([[("server http://10.0.0.1:8100", probed)]]), tokenizer, cfg)
    assert check.tied_head == TIED
    with pytest.raises(WeightsNotDelivered) as caught:
        asyncio.run(check.check(1))
    message = str(caught.value)
    assert "differ from the learner's by up to 1.5 (max |Δ|)" in message
    assert f"model.path {TIED!r} ties its LM head to its input embeddings" in message
    assert f"`asyncrl models untie {TIED}`" in message and "raise weight_sync.check_tolerance" not in message
    torch_cfg = load_config(ROOT / "examples/addition/async.yaml", [f"model.path={TIED}"])
    assert DeliveryCheck.for_config(learner, learner, tokenizer, torch_cfg).tied_head is None  # in process: repacked
