"""Smoke tests of the benchmark suites: they run end to end and write the promised keys."""

from __future__ import annotations

import json

from asyncrl.cli import main


def test_bench_engine_smoke(tmp_path):
    out = tmp_path / "engine"
    assert main(["bench", "engine", "hidden_size=32", "num_layers=1", "batch_size=4", "uniform_tokens=4",
                 "longtail_requests=8", "short_tokens=[2,4]", "long_tokens=[8,12]", "repeats=1",
                 "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"tokens_per_s", "ratio_vs_generate_uniform", "ratio_vs_generate_longtail"} <= set(result)
    assert set(result["tokens_per_s"]) == {"generate", "torch"}


def test_bench_modes_smoke(tmp_path):
    out = tmp_path / "modes"
    assert main(["bench", "modes", "steps=2", "batch_size=2", "group_size=2", "max_tokens=16",
                 "stalenesses=[1]", "partial_rollouts=[abort]", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"async_speedup_vs_sync", "ideal_overlap_bound", "overlap_efficiency"} <= set(result)
    assert set(result["modes"]) == {"sync", "one_step_off", "async_eta1_abort"}
    for name, mode in result["modes"].items():
        assert {"samples_per_s", "wall_s", "trainer_idle_ratio", "rollout_idle_ratio", "staleness_max",
                "final_reward"} <= set(mode)
        assert mode["staleness_max"] <= mode["staleness_bound"], name
        assert mode["samples"] == 2 * 2 * 2
    assert result["ideal_overlap_bound"] >= 1.0


def test_bench_rejects_unknown_setting(capsys):
    assert main(["bench", "modes", "stepz=2"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err


def test_bench_trl_smoke(tmp_path):
    import pytest

    pytest.importorskip("trl", reason="the TRL comparison needs the optional `bench` extra")
    out = tmp_path / "trl"
    assert main(["bench", "trl", "steps=2", "batch_size=2", "group_size=2", "max_tokens=8", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert set(result["systems"]) == {"trl", "asyncrl_sync", "asyncrl_async"}
    assert {"sync_vs_trl_samples_per_s", "async_vs_trl_time_to_target", "unmatched"} <= set(result)
    for system in result["systems"].values():
        assert {"samples_per_s", "wall_s", "final_reward", "time_to_target_s"} <= set(system)
        assert len(system["curve"]) == 2
