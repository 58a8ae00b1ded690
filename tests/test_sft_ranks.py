"""``asyncrl sft`` over two learner ranks (gloo, spawned processes, a free port) takes the
step one rank takes, within the bounds tests/tolerances.py derives: the step goes through
the training core's one micro-batch loop, whose sharding is RL's (test_sharded_learner.py).
And the driver leaves no rank behind when one fails."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tolerances import adam_step_atol, assert_within, chain_terms, grad_atol, logprob_atol
from transformers import AutoModelForCausalLM

from asyncrl.cli import main
from asyncrl.sft.config import load_sft_config
from asyncrl.sft.ranks import run_ranks
from asyncrl.sft.trainer import SFTRun

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples/sft/conversations.yaml"
LR = 1e-3
BATCH, MAX_LENGTH = 3, 300


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_ranks_take_the_one_rank_step(tmp_path, monkeypatch, strategy):
    """One step of 3 conversations: one rank takes them in one pass; two ranks take 2 and 1
    in passes of one, so rank 1 runs a filler pass (FSDP gathers in every forward, DDP
    reduces in the last). The clip is active, so the global norm is part of what is
    compared; the held-out loss (before and after the step) is summed over ranks."""
    monkeypatch.chdir(REPO)  # the example names its files relative to the repository root
    common = ["total_steps=1", f"batch_size={BATCH}", f"data.max_length={MAX_LENGTH}", f"optim.lr={LR}",
              "optim.warmup_steps=0", "optim.schedule=constant", "optim.grad_clip=0.05",
              "optim.micro_batch_tokens=null"]
    one = SFTRun(load_sft_config(EXAMPLE, [*common, f"output_dir={tmp_path / 'one'}", "optim.micro_batch_size=4"]))
    one.run()
    assert main(["sft", str(EXAMPLE), *common, f"output_dir={tmp_path / 'two'}", "optim.micro_batch_size=1",
                 "learner.world_size=2", f"learner.strategy={strategy}", "learner.timeout_s=120"]) == 0

    model = one.state.model
    n = chain_terms(model.config, BATCH * MAX_LENGTH)
    expected = rows(tmp_path / "one/metrics.jsonl")
    actual = rows(tmp_path / "two/metrics.jsonl")
    assert [r["step"] for r in actual] == [r["step"] for r in expected] == [0, 1]
    assert actual[1]["tokens"] == expected[1]["tokens"]
    assert expected[1]["grad_norm"] > 0.05  # the clip was active
    for key, (a, e) in {"loss": (actual[1], expected[1]), "eval_loss before": (actual[0], expected[0]),
                        "eval_loss after": (actual[1], expected[1])}.items():
        name = key.split()[0]
        reference = torch.tensor(e[name])
        # the mean of per-token logprob bounds, plus the 6-digit rounding of the logged held-out loss
        assert_within(torch.tensor(a[name]), reference, logprob_atol(reference, n) + 1e-6, key)
    saved = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "two").named_parameters())
    for name, p in model.named_parameters():
        step = [(p.grad, grad_atol(p.grad, n))]  # the one rank's gradient, kept after its step
        assert_within(saved[name], p, adam_step_atol(LR, step, p), name)


RANK_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
assert os.environ["WORLD_SIZE"] == "2" and os.environ["MASTER_PORT"].isdigit()
if rank == 1:
    sys.exit(3)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(600)
"""


def test_a_failing_rank_ends_the_others_and_its_status_is_the_runs(tmp_path, capsys):
    """Rank 1 fails at once; rank 0 would wait ten minutes (as in a collective whose peer
    died): the driver returns rank 1's status, named, and rank 0 is gone."""
    pid_file = tmp_path / "rank0.pid"
    code = run_ranks([sys.executable, "-c", RANK_SCRIPT, str(pid_file)], 2)
    assert code == 3
    assert "learner rank 1 of 2 failed (exit status 3)" in capsys.readouterr().err
    if pid_file.exists():  # rank 0 got as far as writing its pid: that process must be gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def test_sft_refuses_what_it_has_no_use_for_and_maps_the_old_bfloat16():
    """One optimizer config and one learner section with train's meanings: RL's keys are
    refused by name; the old ``model.dtype: bfloat16`` keeps what it ran (float32 weights,
    bf16 compute) under the key that says so; a partial section keeps SFT's defaults."""
    from asyncrl.config import ConfigError

    cfg = load_sft_config(EXAMPLE, ["optim.lr=3e-3"])
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.schedule, cfg.learner.autocast) == (3e-3, (0.9, 0.95),
                                                                                        "cosine", "off")
    for key in ("optim.ppo_epochs=2", "learner.streaming=true"):
        with pytest.raises(ConfigError, match=key.split("=")[0]):
            load_sft_config(EXAMPLE, [key])
    with pytest.warns(UserWarning, match="learner.autocast=bfloat16"):
        old = load_sft_config(EXAMPLE, ["model.dtype=bfloat16"])
    assert (old.model.dtype, old.learner.autocast) == ("float32", "bfloat16")
    with pytest.raises(ConfigError, match="model.lora trains on one learner rank"):
        load_sft_config(EXAMPLE, ["model.lora.rank=4", "learner.world_size=2"])
