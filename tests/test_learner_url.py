"""``learner.url``: ``asyncrl train`` with its learner behind a Tinker-API URL
(``asyncrl/runtime/tinker_learner.py``), here asyncrl's own ``serve-tinker`` on the shipped
tiny addition policy, in this process on a free port (``tinker_server.py``).

The claim held to the letter: with η = 0 the run through the URL trains on the very samples
``sync`` trains on with its learner in process — same tokens every step (the two learners'
weights agree to float rounding, and the engines sample with the run's seeds) — and takes
the same steps (losses within float32 rounding of a summed loss against a mean; adapters
within Adam's rounding bound). The tokens agree because the weights differ by rounding only:
a sample flips only if its uniform draw lands within that rounding of a boundary of the
sampling distribution, which over these ~800 draws is a chance of the order of 1e-3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tinker")
pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402
from tinker_server import ServerThread  # noqa: E402

from asyncrl.cli import main  # noqa: E402
from asyncrl.config import Config, ConfigError, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "models" / "addition-tiny"
NAME = "addition-tiny"
RUN = ["examples/addition/sync.yaml", "model.lora=true", "algorithm.bypass=true", "optim.lr=0.003", "eval_every=0",
       "eval.num_tasks=8", "eval.samples_per_task=2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    cfg = Config.model_validate({"model": {"path": str(POLICY), "device": "cpu"}, "output_dir": str(
        tmp_path_factory.mktemp("tinker")), "tinker": {"port": 0, "base_model": NAME}})
    with ServerThread(cfg) as running:
        yield running


def through(url: str) -> list[str]:
    return [f"learner.url={url}", f"tinker.base_model={NAME}"]


def samples(out: Path) -> list[tuple[int, str, int, str, int, int]]:
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return sorted((r["step"], r["task_id"], r["episode"], r["response"], r["behavior_version_min"],
                   r["behavior_version_max"]) for r in rows)


def metrics(out: Path, key: str) -> list[float]:
    return [m[key] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in m]


def test_eta_zero_through_a_url_trains_on_syncs_samples_in_process(server, tmp_path):
    local, remote = tmp_path / "sync", tmp_path / "url"
    assert main(["train", *RUN, "mode=sync", "total_steps=3", f"output_dir={local}"]) == 0
    assert main(["train", *RUN, "mode=async", "max_staleness=0", "total_steps=3", f"output_dir={remote}",
                 *through(server.url)]) == 0
    ours, theirs = samples(local), samples(remote)
    assert len(ours) == 3 * 8 * 8 and ours == theirs  # every step's tokens, and each token's version
    assert all(lo == hi == step - 1 for step, _, _, _, lo, hi in theirs)  # η = 0: sampled by the previous version
    torch.testing.assert_close(torch.tensor(metrics(remote, "actor/loss")), torch.tensor(metrics(local, "actor/loss")),
                               rtol=1e-4, atol=1e-6)
    assert metrics(remote, "weight_sync/probe_max_abs_diff")[0] <= 1e-4  # checked against the server's forward
    lag0 = metrics(remote, "mismatch/k3_lag0")  # what asyncrl doctor checks first, from the server's logprobs
    assert len(lag0) == 3 and max(lag0) <= 1e-6
    a = load_file(local / "checkpoints" / "step_3" / "adapter_model.safetensors")
    b = load_file(remote / "checkpoints" / "step_3" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and any(t.abs().sum() > 0 for k, t in a.items() if "lora_B" in k)
    for key in a:  # Adam divides by √v: an element whose gradient is near zero moves up to 2·lr a step on
        # rounding alone (tests/tolerances.adam_step_atol), so that is the element-wise bound over 3 steps
        assert (b[key] - a[key]).abs().max() <= 3 * 2 * 0.003, key


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_the_other_schedules_train_through_a_url(server, tmp_path, mode):
    """``sync`` and ``one_step_off`` through the same calls: each step once, each sample no
    older than the schedule allows (η = 0 for sync, 1 for one_step_off), and the adapters move."""
    out = tmp_path / mode
    assert main(["train", *RUN, f"mode={mode}", "total_steps=2", f"output_dir={out}", *through(server.url)]) == 0
    assert metrics(out, "step")[1:] == [1, 2]
    rows = samples(out)
    assert {step for step, *_ in rows} == {1, 2}
    eta = 0 if mode == "sync" else 1
    assert all(step - 1 - lo <= eta and lo <= hi <= step - 1 for step, _, _, _, lo, hi in rows)
    adapters = load_file(out / "checkpoints" / "step_2" / "adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in adapters.items() if "lora_B" in k)  # B starts at 0: it trained


def test_a_run_through_a_url_resumes_from_the_servers_saved_state(server, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *RUN, "mode=async", "max_staleness=1", f"output_dir={out}", *through(server.url)]
    assert main([*args, "total_steps=2"]) == 0
    state = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert state["version"] == 2 and state["learner_url_state"].startswith("tinker://")
    assert main([*args, "total_steps=3", "resume=true"]) == 0
    assert metrics(out, "step")[1:] == [1, 2, 3]  # each step once (step 0 is the first evaluation's)
    resumed = {(lo, hi) for step, _, _, _, lo, hi in samples(out) if step == 3}
    assert resumed and resumed <= {(1, 1), (2, 2), (1, 2)}  # η = 1
    before = load_file(out / "checkpoints" / "step_2" / "adapter_model.safetensors")
    after = load_file(out / "checkpoints" / "step_3" / "adapter_model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the resumed client trained on
    # its optimizer state is on the server: resumed without learner.url it is refused, before any model loads
    assert main(["train", *RUN, "mode=async", "max_staleness=1", f"output_dir={out}", "total_steps=4",
                 "resume=true"]) == 2
    assert f"saved by a learner by URL (learner.url={server.url})" in capsys.readouterr().err


def test_an_unknown_base_model_is_refused_naming_the_served_one(server, tmp_path, capsys):
    code = main(["train", *RUN, "mode=async", "total_steps=1", f"output_dir={tmp_path / 'x'}",
                 f"learner.url={server.url}", "tinker.base_model=other-model"])
    assert code == 2
    assert f"serves ['{NAME}'], not 'other-model'" in capsys.readouterr().err


def test_what_a_url_cannot_train_is_refused_naming_each_key():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["learner.url=http://127.0.0.1:9", "algorithm.policy_loss=gspo", "optim.ppo_epochs=2"])
    text = str(refused.value)
    for named in ("model.lora=None (needs true", "algorithm.policy_loss=gspo (needs decoupled_ppo or cispo)",
                  "algorithm.bypass=False", "optim.ppo_epochs=2 (needs 1)"):
        assert named in text
    with pytest.raises(ConfigError) as refused:  # the server's LoRA has a fixed scale and no dropout
        load_config(None, ["learner.url=http://127.0.0.1:9", "model.lora=true", "algorithm.bypass=true",
                           "model.lora.alpha=16", "model.lora.dropout=0.1"])
    assert "model.lora.alpha=16.0 (needs 32" in str(refused.value)
    assert "model.lora.dropout=0.1 (needs 0" in str(refused.value)
    assert load_config(None, [f"model.path={POLICY}", "learner.url=http://127.0.0.1:9", "model.lora=true",
                              "algorithm.bypass=true"]).learner.url == "http://127.0.0.1:9"


def test_nothing_listening_at_the_url_is_a_usage_error_in_one_line(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # bound, never listening: refused, and no other test's server can take the port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        code = main(["train", *RUN, "mode=async", "total_steps=1", f"output_dir={tmp_path / 'x'}",
                     f"learner.url=http://127.0.0.1:{port}", f"tinker.base_model={NAME}"])
    err = capsys.readouterr().err
    assert code == 2 and f"learner.url: nothing answers at http://127.0.0.1:{port}" in err
    assert "Traceback" not in err
