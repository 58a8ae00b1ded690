"""Smoke tests of the benchmark suites: they run end to end, write the promised keys and
announce each phase (start, then end with its figure and duration)."""

from __future__ import annotations

import json
import re

import pytest

from asyncrl.bench.progress import phase
from asyncrl.cli import main


def assert_phases(out: str, suite: str, ends: dict[str, str]) -> None:
    """Each phase NAME has a start line, then an end line whose figure matches ``ends[NAME]``."""
    lines = out.splitlines()
    for name, figure in ends.items():
        prefix = f"[bench {suite}] {name}"
        assert f"{prefix} ..." in lines, (name, out)
        start = lines.index(f"{prefix} ...")
        end = [i for i, line in enumerate(lines) if re.fullmatch(rf"{re.escape(prefix)}: {figure} \(\d+\.\d s\)", line)]
        assert end and end[0] > start, (name, out)


def test_phase_prints_start_end_and_failure(capsys):
    with phase("x", "work", total=3, unit="batch") as progress:
        for _ in range(3):
            progress.advance()
        progress.figure = "1,234 tok/s"
    with pytest.raises(ValueError), phase("x", "broken"):
        raise ValueError("boom")
    captured = capsys.readouterr()
    assert_phases(captured.out, "x", {"work": "1,234 tok/s", "broken": "failed"})
    assert "0/3 [" in captured.err and "/3 [" not in captured.out  # the bar stays out of the table on stdout


def test_bench_engine_smoke(tmp_path, capsys):
    out = tmp_path / "engine"
    assert main(["bench", "engine", "hidden_size=32", "num_layers=1", "batch_size=4", "uniform_tokens=4",
                 "longtail_requests=8", "short_tokens=[2,4]", "long_tokens=[8,12]", "repeats=1",
                 "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"tokens_per_s", "ratio_vs_generate_uniform", "ratio_vs_generate_longtail"} <= set(result)
    assert set(result["tokens_per_s"]) == {"generate", "torch"}
    tok_s = r"[\d,]+ tok/s"
    assert_phases(capsys.readouterr().out, "engine", {
        "warm-up": "done", "uniform": f"model.generate {tok_s}, TorchEngine {tok_s}",
        "longtail": f"model.generate {tok_s}, TorchEngine {tok_s}"})


def test_bench_modes_smoke(tmp_path, capsys):
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
    runs = r"[\d.]+ samples/s, wall [\d.]+ s"
    assert_phases(capsys.readouterr().out, "modes", {
        "sync (run 1/3)": runs, "one_step_off (run 2/3)": runs, "async_eta1_abort (run 3/3)": runs,
        "pure generation": r"T_gen [\d.]+ s, 8 samples", "pure training": r"T_train [\d.]+ s, 2 steps"})


def test_bench_modes_search_smoke(tmp_path, capsys):
    """The search workload: the shipped agent, its tool behind a delay, each mode's agent profile."""
    out = tmp_path / "modes-search"
    assert main(["bench", "modes", "task=search", "steps=1", "batch_size=2", "group_size=2", "max_tokens=96",
                 "tool_latency_s=0.05", "stalenesses=[1]", "partial_rollouts=[abort]", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert set(result["modes"]) == {"sync", "one_step_off", "async_eta1_abort"}
    for name, mode in result["modes"].items():
        assert mode["staleness_max"] <= mode["staleness_bound"], name
        assert mode["agent/tool_calls_mean"] > 0, name  # the shipped policy searches
        # every search waited on the delay (per-episode sums, so per-step means keep the bound)
        assert mode["agent/tool_latency_s_mean"] >= 0.05 * mode["agent/tool_calls_mean"], name
        assert mode["samples"] >= 2 * 2, name  # an agent episode is one trajectory or more
    assert "agent profile" in capsys.readouterr().out


def test_bench_rejects_unknown_setting(capsys):
    assert main(["bench", "modes", "stepz=2"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err


def test_bench_trl_smoke(tmp_path, capsys):
    pytest.importorskip("trl", reason="the TRL comparison needs the optional `bench` extra")
    out = tmp_path / "trl"
    assert main(["bench", "trl", "steps=2", "batch_size=2", "group_size=2", "max_tokens=8", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert set(result["systems"]) == {"trl", "asyncrl_sync", "asyncrl_async"}
    assert {"sync_vs_trl_samples_per_s", "async_vs_trl_time_to_target", "unmatched"} <= set(result)
    for system in result["systems"].values():
        assert {"samples_per_s", "wall_s", "final_reward", "time_to_target_s"} <= set(system)
        assert len(system["curve"]) == 2
    runs = r"[\d.]+ samples/s, final reward [\d.]+"
    assert_phases(capsys.readouterr().out, "trl", {
        "trl (run 1/3)": runs, "asyncrl_sync (run 2/3)": runs, "asyncrl_async (run 3/3)": runs})


def test_bench_gateway_smoke(tmp_path, capsys, policy_dir):
    out = tmp_path / "gateway"
    assert main(["bench", "gateway", f"model_path={policy_dir}", "num_prompts=4", "requests=6", "concurrency=3",
                 "latency_calls=2", "max_tokens=4", "repeats=1", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"requests_per_s", "ratio_sdk_vs_direct", "ratio_session_vs_direct", "added_latency_ms", "settings",
            "machine"} <= set(result)
    assert set(result["requests_per_s"]) == {"direct", "sdk", "session"}
    assert all(v > 0 for v in result["requests_per_s"].values())
    assert result["ratio_sdk_vs_direct"] > 0 and result["ratio_session_vs_direct"] > 0
    assert set(result["added_latency_ms"]) == {"mean", "median"}
    # greedy, end-of-sequence ignored: every path generates max_tokens per call, no more, no less
    assert result["tokens"]["throughput_run"] == {"direct": 6 * 4, "sdk": 6 * 4, "session": 6 * 4}
    assert result["tokens"]["latency_calls"] == {"direct": 2 * 4, "sdk": 2 * 4, "session": 2 * 4}
    req_s = r"direct [\d,.]+ req/s, sdk [\d,.]+ req/s, session [\d,.]+ req/s"
    assert_phases(capsys.readouterr().out, "gateway", {
        "warm-up": "done", "throughput, 6 requests, 3 in flight": req_s,
        "latency, 2 sequential calls": r"direct [\d.]+ ms, sdk [+-][\d.]+ ms, session [+-][\d.]+ ms"})
