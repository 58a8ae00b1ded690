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
