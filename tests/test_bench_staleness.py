"""``asyncrl bench staleness``: the table's statistics by hand, and a smoke run end to end."""

from __future__ import annotations

import json
import math

import pytest
from test_bench import assert_phases

from asyncrl.bench.staleness import ci95, paired_difference, summarise_row
from asyncrl.cli import main


def test_ci95_is_the_student_t_half_width():
    # mean 0.5, sample sd of (0.4, 0.5, 0.6) = 0.1, t(0.975, 2) = 4.303: 4.303·0.1/√3
    assert ci95([0.4, 0.5, 0.6]) == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert ci95([0.7]) == 0.0


def test_paired_difference_is_seed_by_seed():
    # differences (−0.1, −0.3): mean −0.2, sd √0.02, t(0.975, 1) = 12.706
    diff = paired_difference({"final_rewards": [0.4, 0.3]}, {"final_rewards": [0.5, 0.6]})
    assert diff["mean"] == pytest.approx(-0.2)
    assert diff["ci95"] == pytest.approx(12.706 * math.sqrt(0.02) / math.sqrt(2))


def run(final: float, start: float, samples: int, hist: dict[str, int], ess: float | None = 0.9) -> dict:
    return {"final_reward": final, "start_reward": start, "samples": samples, "wall_s": 10.0,
            "staleness_mean": sum(int(k) * v for k, v in hist.items()) / sum(hist.values()),
            "staleness_max": max(int(k) for k in hist), "staleness_hist": hist, "is_weight_mean": 0.98,
            "is_truncated_fraction": 0.01, "ess": ess, "curve": [(0, start), (samples, final)]}


def test_a_row_pools_its_seeds():
    runs = [run(0.5, 0.3, 100, {"1": 10, "2": 30}), run(0.7, 0.3, 100, {"2": 40}, ess=0.7)]
    row = summarise_row(2, "decoupled", runs, bypass=False)
    assert row["final_reward_mean"] == pytest.approx(0.6)
    assert row["final_reward_ci95"] == pytest.approx(12.706 * math.sqrt(0.02) / math.sqrt(2))
    assert row["reward_per_sample"] == pytest.approx((0.2 / 100 + 0.4 / 100) / 2)
    assert row["staleness_hist"] == {"1": 10, "2": 70}
    assert row["staleness_max"] == 2 and row["ess"] == pytest.approx(0.8)
    assert row["curve"] == [(0, 0.3), (100, 0.6)]
    # bypass never computes π_prox: it has no importance weights to describe
    bypass = summarise_row(2, "bypass", runs, bypass=True)
    assert bypass["ess"] is None and bypass["is_weight_mean"] is None and bypass["is_truncated_fraction"] is None


SMOKE = ["etas=[0,2]", "seeds=2", "steps=4", "batch_size=2", "group_size=4", "eval_every=2", "eval_tasks=4",
         "eval_samples=2", "warmup_steps=20"]


@pytest.mark.slow
def test_bench_staleness_smoke(tmp_path, capsys):
    out = tmp_path / "staleness"
    main(["bench", "staleness", *SMOKE, "--out", str(out)])
    captured = capsys.readouterr().out
    assert_phases(captured, "staleness", {
        "warm-up policy (noisy addition)": r"[\d,]+ params, 20 steps, loss \d+\.\d+, expected held-out reward 0\.\d+",
        "eta2_naive seed 1 (run 8/8)": r"held-out \d\.\d+ → \d\.\d+, staleness mean \d\.\d+ max \d, \d+\.\d s",
    })
    result = json.loads((out / "bench.json").read_text())
    rows = {(r["eta"], r["objective"]): r for r in result["rows"]}
    assert sorted(rows) == [(0, "bypass"), (0, "decoupled"), (0, "naive"), (2, "bypass"), (2, "decoupled"),
                            (2, "naive")]
    # η = 0 is on-policy: one run per seed, shared by the three objectives
    assert rows[(0, "naive")]["final_rewards"] == rows[(0, "decoupled")]["final_rewards"]
    assert rows[(0, "decoupled")]["shared_with"] == ["bypass", "naive"]
    for (eta, objective), row in rows.items():
        assert row["num_seeds"] == 2 and row["staleness_max"] <= eta, row
        assert 0 <= row["final_reward_mean"] <= 1 and row["final_reward_ci95"] >= 0
        assert sum(row["staleness_hist"].values()) == 2 * 4 * 2 * 4  # seeds × steps × groups × samples
        assert [x for x, _ in row["curve"]] == [0, 16, 32]  # evaluations at steps 0, 2, 4
        if objective == "bypass" and eta > 0:
            assert row["ess"] is None
        else:
            assert 0 < row["ess"] <= 1 + 1e-6 and 0 <= row["is_truncated_fraction"] <= 1
    assert (out / "staleness.png").stat().st_size > 0
    assert rows[(2, "naive")]["vs_decoupled"]["mean"] == pytest.approx(
        sum(a - b for a, b in zip(rows[(2, "naive")]["final_rewards"], rows[(2, "decoupled")]["final_rewards"])) / 2)
    assert "vs_decoupled" not in rows[(2, "decoupled")] and "vs_decoupled" not in rows[(0, "naive")]

    # run again into the same directory: every finished run and the warm-up are reused
    main(["bench", "staleness", *SMOKE, "--out", str(out)])
    again = capsys.readouterr().out
    assert "warm-up policy: reused" in again and again.count("(reused)") == 8, again
    assert json.loads((out / "bench.json").read_text())["rows"] == result["rows"]
    # but not with other settings: they would mix two experiments in one table
    assert main(["bench", "staleness", *SMOKE, "steps=5", "--out", str(out)]) == 2
    assert "other settings (steps)" in capsys.readouterr().err
    # a wider table (one more η) reuses what is done and runs only what is new
    main(["bench", "staleness", *SMOKE, "etas=[0,1,2]", "--out", str(out)])
    wider = capsys.readouterr().out
    assert wider.count("(reused)") == 8 and wider.count("eta1_decoupled seed") == 4  # start + end, 2 seeds


def test_objective_keys_spell_out_every_knob():
    """Each row sets the loss, bypass, correction and mask itself: a row never inherits
    another's, and the later key wins where a row changes one."""
    from asyncrl.bench.staleness import OBJECTIVE_KEYS, SAME_ON_POLICY
    from asyncrl.config import load_config

    expected = {"decoupled": ("decoupled_ppo", False, True, "none"), "bypass": ("decoupled_ppo", True, True, "none"),
                "naive": ("decoupled_ppo", False, False, "none"), "gspo": ("gspo", False, True, "none"),
                "cispo": ("cispo", False, True, "none"), "icepop": ("icepop", False, True, "none"),
                "token_mask": ("decoupled_ppo", False, True, "token"),
                "sequence_mask": ("decoupled_ppo", False, True, "sequence"),
                "geometric_mask": ("decoupled_ppo", False, True, "geometric")}
    assert set(OBJECTIVE_KEYS) == set(expected)
    for name, keys in OBJECTIVE_KEYS.items():
        a = load_config(None, ["algorithm.policy_loss=gspo", "algorithm.is_mask=token", *keys]).algorithm
        assert (a.policy_loss, a.bypass, a.is_correction, a.is_mask) == expected[name], name
    assert "gspo" not in SAME_ON_POLICY and "cispo" not in SAME_ON_POLICY  # their clips are not PPO's


def test_engine_weight_noise_perturbs_only_the_engines_copy():
    """σ = 0.1: each element of the engine's copy is w·(1 + 0.1·ε), afresh at every load;
    the tensors sent are untouched; σ = 0 copies them exactly."""
    import asyncio

    import torch
    from conftest import make_model

    from asyncrl.engine.torch_engine import TorchEngine

    async def load(noise: float) -> tuple[dict[str, torch.Tensor], ...]:
        sent = {k: v.clone() for k, v in make_model(seed=1).state_dict().items() if "embed" in k or "mlp" in k}
        engine = TorchEngine(make_model(seed=0), weight_noise=noise, seed=3)
        try:
            await engine.update_weights(sent, 1)
            first = {k: v.detach().clone() for k, v in engine.model.named_parameters() if k in sent}
            await engine.update_weights(sent, 2)
            return sent, first, dict(engine.model.named_parameters())
        finally:
            await engine.shutdown()

    sent, first, second = asyncio.run(load(0.1))
    original = make_model(seed=1).state_dict()
    for name, tensor in sent.items():
        assert torch.equal(tensor, original[name])  # the learner's weights are not touched
        nonzero = tensor.abs() > 1e-6
        rel = (second[name].detach() / tensor - 1)[nonzero]
        assert abs(rel.std().item() - 0.1) < 0.01 and abs(rel.mean().item()) < 0.01, name
        assert not torch.equal(first[name], second[name].detach())  # a fresh draw per load
    sent, _, exact = asyncio.run(load(0.0))
    assert all(torch.equal(exact[name].detach(), tensor) for name, tensor in sent.items())


def test_engine_weight_noise_needs_the_delivery_check_off():
    from asyncrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="weight_sync.check_every=0"):
        load_config(None, ["rollout.engine_weight_noise=0.1"])
    assert load_config(None, ["rollout.engine_weight_noise=0.1", "weight_sync.check_every=0"])


MISMATCH = ["etas=[0]", "seeds=1", "steps=3", "eval_every=3", "eval_tasks=4", "eval_samples=2",
            "policy=models/addition-tiny", "objectives=[decoupled,icepop]"]


@pytest.mark.slow
def test_the_mismatch_workload_has_the_stated_mismatch_and_the_default_none(tmp_path, capsys):
    """On the shipped addition policy, mismatch=0.1 puts the engine's logprobs of its own
    tokens k3 ≈ 0.015 from the learner's (measured 0.012–0.017 over runs: 2–3 token
    answers, 64 a step); the default bench computes both sides alike (float32 noise,
    < 1e-6). With mismatch the learner recomputes π_prox even on policy, so the IS weights
    see it (ESS < 1) and IcePop's band drops tokens; without, η = 0 is one shared run."""
    def rows(out, *extra):
        main(["bench", "staleness", *MISMATCH, *extra, "--out", str(out)])
        capsys.readouterr()
        return {r["objective"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}

    noisy = rows(tmp_path / "mismatch", "mismatch=0.1")
    assert 0.005 < noisy["decoupled"]["mismatch_k3"] < 0.04, noisy["decoupled"]
    assert noisy["decoupled"]["mismatch_max_abs"] > 0.3
    assert noisy["decoupled"]["ess"] < 0.995 and noisy["icepop"]["masked_fraction"] > 0
    assert "shared_with" not in noisy["icepop"] and "vs_decoupled" in noisy["icepop"]  # a run of its own

    exact = rows(tmp_path / "exact")
    assert exact["decoupled"]["mismatch_k3"] < 1e-6 and exact["decoupled"]["mismatch_max_abs"] < 1e-3
    assert exact["icepop"]["shared_with"] == ["decoupled"] and exact["decoupled"]["shared_with"] == ["icepop"]


def test_runs_made_before_a_setting_existed_are_reused_at_its_default(tmp_path):
    """settings.json of a bench made before ``mismatch`` existed: its runs had none, so the
    default reuses them and ``mismatch=0.1`` (another workload) is refused."""
    from asyncrl.bench.staleness import StalenessBenchSettings, _settings_guard
    from asyncrl.config import ConfigError

    old = StalenessBenchSettings().model_dump(exclude={"threads", "seeds", "etas", "objectives", "mismatch"})
    (tmp_path / "settings.json").write_text(json.dumps(old))
    _settings_guard(StalenessBenchSettings(), tmp_path)
    with pytest.raises(ConfigError, match=r"other settings \(mismatch\)"):
        _settings_guard(StalenessBenchSettings(mismatch=0.1), tmp_path)
