"""Smoke tests of the benchmark suites: they run end to end, write the promised keys and
announce each phase (start, then end with its figure and duration)."""

from __future__ import annotations

import json
from pathlib import Path
import re

import pytest
import torch

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
    assert {"tokens_per_s", "ratio_vs_generate_uniform", "ratio_vs_generate_longtail",
            "ratio_vs_generate_static_uniform", "ratio_vs_generate_static_longtail"} <= set(result)
    assert set(result["tokens_per_s"]) == {"generate", "torch", "generate_static"}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # device=auto
    assert (result["device"], result["dtype"]) == (device, "bfloat16" if device == "cuda" else "float32")
    assert result["engine"]["kv_cache"] in {"static", "dynamic"}
    tok_s = r"[\d,]+ tok/s"
    assert_phases(capsys.readouterr().out, "engine", {
        "warm-up": "done", "uniform": f"model.generate {tok_s}, TorchEngine {tok_s}, generate\\(static\\) {tok_s}",
        "longtail": f"model.generate {tok_s}, TorchEngine {tok_s}, generate\\(static\\) {tok_s}"})


@pytest.mark.slow
def test_bench_modes_smoke(tmp_path, capsys):
    """Each schedule run batched and streamed (one bench for both: each run is a child
    process, the costliest part of the suite); the schedules compared batched."""
    out = tmp_path / "modes"
    assert main(["bench", "modes", "steps=2", "batch_size=2", "group_size=2", "max_tokens=16",
                 "stalenesses=[1]", "partial_rollouts=[abort]", "streaming=both", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"async_speedup_vs_sync", "ideal_overlap_bound", "overlap_efficiency"} <= set(result)
    names = ["sync", "one_step_off", "async_eta1_abort"]
    assert list(result["modes"]) == [n + way for n in names for way in ("", "_streamed")]
    assert set(result["streaming_speedup"]) == set(names)
    assert result["best_async"] == "async_eta1_abort"  # the schedules are compared batched
    for name, mode in result["modes"].items():
        assert {"samples_per_s", "wall_s", "trainer_idle_ratio", "rollout_idle_ratio", "staleness_max",
                "final_reward", "peak_rss_mb"} <= set(mode)
        assert 100 < mode["peak_rss_mb"] < 1500, name  # its own child process: torch loaded, nothing inherited
        assert mode["staleness_max"] <= mode["staleness_bound"], name
        assert mode["samples"] == 2 * 2 * 2
        assert mode["streaming"] == name.endswith("_streamed") and 0 <= mode["learner_idle_ratio"] <= 1
    assert result["ideal_overlap_bound"] >= 1.0
    assert "streaming: true" in (out / "sync_streamed.yaml").read_text()
    printed = capsys.readouterr().out
    assert "streaming sync: wall" in printed
    runs = r"[\d.]+ samples/s, wall [\d.]+ s"
    assert_phases(printed, "modes", {
        "sync (run 1/6)": runs, "one_step_off (run 3/6)": runs, "async_eta1_abort_streamed (run 6/6)": runs,
        "pure generation": r"T_gen [\d.]+ s, 8 samples", "pure training": r"T_train [\d.]+ s, 2 steps"})


@pytest.mark.slow
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
        assert 100 < mode["peak_rss_mb"] < 1500, name
    assert "agent profile" in capsys.readouterr().out


def test_bench_rejects_unknown_setting(capsys):
    assert main(["bench", "modes", "stepz=2"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_trl_smoke(tmp_path, capsys):
    pytest.importorskip("trl", reason="the TRL comparison needs the optional `bench` extra")
    out = tmp_path / "trl"
    assert main(["bench", "trl", "steps=2", "batch_size=2", "group_size=2", "max_tokens=8", "eval_every=1",
                 "eval_tasks=2", "eval_samples=1", "keep_checkpoints=true", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    systems = result["systems"]
    for name in systems:  # keep_checkpoints=true: every scored checkpoint stays
        assert all((out / name / "checkpoints" / f"step_{k}").is_dir() for k in (1, 2))
    assert (out / "asyncrl_sync" / "checkpoints" / "step_2" / "optimizer").is_dir()  # whole, resumable
    assert set(systems) == {"trl", "asyncrl_sync", "asyncrl_async"}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # model.device=auto: TRL follows asyncrl
    assert {(v["device"], v["dtype"], v["autocast"]) for v in systems.values()} == {
        (device, "float32", "bfloat16" if device == "cuda" else "off")}
    assert {"sync_vs_trl_samples_per_s", "async_vs_trl_samples_per_s", "async_vs_trl_time_to_target", "unmatched",
            "target_reward", "target_rule", "target_above_start"} <= set(result)
    assert "sizes" not in result  # one size: its keys at the top level only
    start = systems["trl"]["held_out"][0]
    assert start["step"] == 0 and start["time_s"] == 0.0
    target = result["target_reward"]
    assert target == systems["trl"]["held_out"][-1]["reward_mean"]  # the rule: TRL's last checkpoint
    assert result["target_above_start"] == (target > start["reward_mean"])
    for system in systems.values():
        assert {"samples_per_s", "wall_s", "final_reward", "time_to_target_s", "held_out",
                "final_held_out_reward", "train_curve"} <= set(system)
        assert len(system["train_curve"]) == 2
        curve = system["held_out"]
        assert curve[0] == start  # the start policy, evaluated once and shared
        assert [p["step"] for p in curve] == [0, 1, 2]
        times = [p["time_s"] for p in curve]
        assert times == sorted(times) and times[1] > 0 and times[-1] <= system["wall_s"] + 1e-9
        assert all(0 <= p["reward_mean"] <= 1 and 0 <= p["pass@1"] <= 1 for p in curve)
        assert system["final_held_out_reward"] == curve[-1]["reward_mean"]
        reached = [p["time_s"] for p in curve if p["reward_mean"] >= target - 1e-9]
        assert system["time_to_target_s"] == (reached[0] if reached else None)
    assert systems["trl"]["time_to_target_s"] is not None
    trl_t, async_t = systems["trl"]["time_to_target_s"], systems["asyncrl_async"]["time_to_target_s"]
    assert result["async_vs_trl_time_to_target"] == (async_t / trl_t if async_t is not None and trl_t else None)
    runs = r"[\d.]+ samples/s, final reward [\d.]+"
    held = r"[\d.]+ → [\d.]+ → [\d.]+"
    assert_phases(capsys.readouterr().out, "trl", {
        "trl (run 1/3)": runs, "asyncrl_sync (run 2/3)": runs, "asyncrl_async (run 3/3)": runs,
        "held-out eval: start policy": r"reward [\d.]+, pass@1 [\d.]+",
        "held-out eval: trl (2 checkpoints)": held, "held-out eval: asyncrl_sync (2 checkpoints)": held,
        "held-out eval: asyncrl_async (2 checkpoints)": held})


@pytest.mark.slow
def test_bench_trl_batch_sizes_without_held_out(tmp_path, capsys):
    """Several sizes in one invocation, speed only: each size's three systems under ``sizes``,
    the first size's also at the top level; no checkpoint saved or scored."""
    pytest.importorskip("trl", reason="the TRL comparison needs the optional `bench` extra")
    out = tmp_path / "trl"
    assert main(["bench", "trl", "steps=2", "batch_sizes=[1,2]", "group_size=2", "max_tokens=4", "held_out=false",
                 "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert set(result["sizes"]) == {"1x2", "2x2"}
    for label, size in result["sizes"].items():
        systems = size["systems"]
        assert set(systems) == {"trl", "asyncrl_sync", "asyncrl_async"}
        assert size["samples_per_step"] == int(label[0]) * 2
        for name in ("sync", "async"):
            ratio = systems[f"asyncrl_{name}"]["samples_per_s"] / systems["trl"]["samples_per_s"]
            assert size[f"{name}_vs_trl_samples_per_s"] == pytest.approx(ratio)
        for system in systems.values():
            assert system["samples_per_s"] > 0 and len(system["train_curve"]) == 2
            assert system["held_out"] == [] and system["time_to_target_s"] is None
            assert system["save_s"] == 0
        assert size["target_reward"] is None and size["async_vs_trl_time_to_target"] is None
        assert not (out / label / "trl" / "checkpoints").exists()
    first = result["sizes"]["1x2"]
    for key in ("systems", "sync_vs_trl_samples_per_s", "async_vs_trl_samples_per_s"):
        assert result[key] == first[key]
    printed = capsys.readouterr().out
    runs = r"[\d.]+ samples/s, final reward [\d.]+"
    assert_phases(printed, "trl", {"1x2: trl (run 1/3)": runs, "2x2: asyncrl_async (run 3/3)": runs})
    assert "held-out eval:" not in printed and "held-out evaluation skipped (held_out=false)" in printed
    assert re.search(r"^2x2 +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", printed, re.MULTILINE), printed


def test_bench_trl_checkpoints_and_time_to_target():
    from asyncrl.bench.trl import TrlBenchSettings, checkpoint_steps, time_to_target

    assert checkpoint_steps(TrlBenchSettings(steps=25, eval_every=10)) == [10, 20, 25]
    assert checkpoint_steps(TrlBenchSettings(steps=20, eval_every=10)) == [10, 20]
    assert checkpoint_steps(TrlBenchSettings(steps=20, eval_every=10, asyncrl_steps=35), 35) == [10, 20, 30, 35]
    curve = [{"step": 0, "time_s": 0.0, "reward_mean": 0.3}, {"step": 10, "time_s": 2.0, "reward_mean": 0.5},
             {"step": 20, "time_s": 4.0, "reward_mean": 0.45}]
    assert time_to_target(curve, 0.45) == 2.0 and time_to_target(curve, 0.3) == 0.0
    assert time_to_target(curve, 0.6) is None


def test_bench_trl_summarises_seeds_by_hand():
    """Time to target over seeds: each seed's, how many reached, the mean ± Student-t CI95 of
    those that did (t at 1 degree of freedom 12.706: values 10 and 14, sample s.d. 2√2 →
    12 ± 12.706 · 2√2/√2 = 25.412)."""
    from asyncrl.bench.trl import SYSTEMS, summarise_seeds

    def sitting(seed, times, finals):
        systems = {name: {"time_to_target_s": t, "final_held_out_reward": f, "samples_per_s": 100.0}
                   for name, t, f in zip(SYSTEMS, times, finals)}
        return {"seed": seed, "systems": systems, "target_reward": 0.5, "target_above_start": True}

    summary = summarise_seeds([sitting(0, [10.0, 6.0, None], [0.5, 0.6, 0.4]),
                               sitting(1, [14.0, None, None], [0.5, 0.4, 0.3])])
    trl, sync, async_ = (summary["systems"][n] for n in SYSTEMS)
    assert trl["time_to_target_s"] == [10.0, 14.0] and (trl["reached"], trl["of"]) == (2, 2)
    assert trl["time_to_target"]["mean"] == 12.0
    assert trl["time_to_target"]["ci95"] == pytest.approx(25.412, rel=1e-4)
    assert sync["reached"] == 1 and sync["time_to_target"] == {"mean": 6.0, "ci95": 0.0}
    assert async_["reached"] == 0 and async_["time_to_target"] == {"mean": None, "ci95": None}
    assert async_["final_held_out_reward"]["mean"] == pytest.approx(0.35)
    assert summary["seeds"] == [0, 1] and summary["targets"] == [0.5, 0.5]


def test_bench_trl_takes_a_train_config_for_both_sides():
    """``config=``: both sides read the model, task, reward and sampling from the user's
    config; the TRL prompt is what asyncrl's single-turn workflow renders."""
    from asyncrl.bench.trl import TrlBenchSettings, task_config, trl_prompt
    from asyncrl.rollout.workflows.registry import build_reward_fn, build_tasks

    countdown = task_config(TrlBenchSettings(), [])
    assert (countdown.task.name, countdown.model.path, countdown.sampling.max_tokens) == (
        "countdown", "models/countdown-tiny", 24)
    s = TrlBenchSettings(config="examples/jsonl/train.yaml", seed=3, max_tokens=12)
    cfg = task_config(s, ["total_steps=2"])
    assert (cfg.task.name, cfg.seed, cfg.sampling.max_tokens, cfg.total_steps) == ("jsonl", 3, 12, 2)
    task = build_tasks(cfg).train[0]
    assert trl_prompt(cfg, task) == [{"role": "user", "content": task.prompt}]
    plain = task_config(s, ["workflow.use_chat_template=false"])
    assert trl_prompt(plain, task) == task.prompt
    assert build_reward_fn(cfg)(task, "no expression here") == 0.0


@pytest.mark.slow
def test_bench_trl_seeds_on_a_users_config(tmp_path, capsys, monkeypatch):
    pytest.importorskip("trl", reason="the TRL comparison needs the optional `bench` extra")
    out = tmp_path / "trl"
    import asyncrl.bench.trl as trl_bench
    scored, score = [], trl_bench.held_out_eval

    def held_out_eval(s, model_dir, eval_out):  # what each checkpoint holds when it is scored
        scored.append((Path(model_dir), (Path(model_dir) / "model.safetensors").is_file(),
                       (Path(model_dir) / "optimizer").exists()))
        return score(s, model_dir, eval_out)
    monkeypatch.setattr(trl_bench, "held_out_eval", held_out_eval)
    assert main(["bench", "trl", "config=examples/jsonl/train.yaml", "seeds=2", "steps=2", "asyncrl_steps=3",
                 "batch_size=2", "group_size=2", "max_tokens=6", "eval_every=2", "eval_tasks=2", "eval_samples=1",
                 "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert [r["seed"] for r in result["seeds"]] == [0, 1]
    summary = result["across_seeds"]
    for k, sitting in enumerate(result["seeds"]):
        assert sitting["target_reward"] == sitting["systems"]["trl"]["held_out"][-1]["reward_mean"]
        assert sitting["held_out_eval"]["split"] == "examples/jsonl/train.yaml validation"
        for name, system in sitting["systems"].items():
            assert summary["systems"][name]["time_to_target_s"][k] == system["time_to_target_s"]
        # scored, then deleted (keep_checkpoints=false): the score stays, the weights go
        assert (out / f"seed_{k}" / "trl" / "held_out_eval" / "step_2").is_dir()
        assert not (out / f"seed_{k}" / "trl" / "checkpoints" / "step_2").exists()
        # asyncrl trains on past TRL's step count (asyncrl_steps=3): checkpoints 2 and 3
        assert [p["step"] for p in sitting["systems"]["asyncrl_async"]["held_out"]] == [0, 2, 3]
        assert [p["step"] for p in sitting["systems"]["trl"]["held_out"]] == [0, 2]
    assert summary["systems"]["trl"]["reached"] == 2  # TRL reaches its own final score
    # an asyncrl checkpoint is scored with its weights, its optimizer state already gone
    # (keep_checkpoints=false: it is deleted after scoring anyway)
    asyncrl_scored = [(w, o) for p, w, o in scored if "asyncrl_" in str(p)]
    assert len(asyncrl_scored) == 2 * 2 * 2 and all(w and not o for w, o in asyncrl_scored)
    assert "--- across seeds [0, 1]" in capsys.readouterr().out


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


def test_bench_trl_summarises_the_async_systems_sharing_the_cores_otherwise_beside_the_others():
    """``async_sharing``: an async system per setting, summarised over the seeds like the three."""
    from asyncrl.bench.trl import SYSTEMS, TrlBenchSettings, summarise_seeds

    s = TrlBenchSettings(async_sharing=["colocated", "colocated_learner"])
    names = (*SYSTEMS, *(f"asyncrl_async_{sharing}" for sharing in s.async_sharing))

    def sitting(seed, rate):
        systems = {name: {"time_to_target_s": None, "final_held_out_reward": None, "samples_per_s": rate}
                   for name in names}
        return {"seed": seed, "systems": systems, "target_reward": None, "target_above_start": None}

    summary = summarise_seeds([sitting(0, 2.0), sitting(1, 4.0)])
    assert list(summary["systems"]) == list(names)
    assert summary["systems"]["asyncrl_async_colocated_learner"]["samples_per_s"]["mean"] == 3.0


def test_bench_trl_ablation_arms_refuse_keys_the_bench_sets(capsys):
    """An ablation is ``sync`` with one named change: one that overrode the schedule or the
    sizes would not be the bench's run, and one without overrides would be plain ``sync``."""
    from asyncrl.bench.trl import check_ablations
    from asyncrl.config import ConfigError

    check_ablations({"beta2": ["optim.betas=[0.9,0.999]"], "two": ["algorithm.is_cap=5", "optim.grad_clip=2"]})
    with pytest.raises(ConfigError, match=r"ablations.bad: 'total_steps' is set by the bench"):
        check_ablations({"bad": ["total_steps=3"]})
    with pytest.raises(ConfigError, match=r"ablations.empty: no overrides"):
        check_ablations({"empty": []})
    assert main(["bench", "trl", 'ablations.x=["mode=async"]']) == 2
    assert "ablations.x: 'mode' is set by the bench itself" in capsys.readouterr().err


def _record_runs(monkeypatch) -> list[tuple]:
    """Stand in for every system's training in ``asyncrl.bench.trl``: each call's arguments
    are recorded (in order) and a one-step run returned; the list of calls comes back."""
    from asyncrl.bench import trl

    calls: list[tuple] = []

    def fake_run(train, *args):
        calls.append(args)
        run = trl.Run()
        run.train_curve, run.wall_s, run.save_s = [(1.0, 0.5)], 1.0, 0.0
        return run

    monkeypatch.setattr(trl, "_in_own_process", fake_run)
    return calls


def test_bench_trl_runs_each_ablation_as_sync_with_its_overrides(tmp_path, monkeypatch):
    """Each ablation becomes ``asyncrl_sync_<name>``: ``sync`` with the bench's settings and,
    after them, the ablation's overrides (so its change wins), trained after the others."""
    from asyncrl.bench import trl

    calls = _record_runs(monkeypatch)
    s = trl.TrlBenchSettings(held_out=False, ablations={"beta2": ["optim.betas=[0.9,0.999]"]})
    result = trl._bench_size(s, tmp_path, "")
    assert list(result["systems"]) == ["trl", "asyncrl_sync", "asyncrl_async", "asyncrl_sync_beta2"]
    *_, (settings, out, mode, sharing, extra) = calls
    assert (out.name, mode, sharing, extra) == ("asyncrl_sync_beta2", "sync", "split", ("optim.betas=[0.9,0.999]",))


def test_bench_trl_runs_each_ablation_in_each_listed_mode(tmp_path, monkeypatch):
    """``ablation_modes=["sync", "async"]``: each ablation twice, ``asyncrl_sync_<name>`` then
    ``asyncrl_async_<name>``, the same overrides, the mode the only difference."""
    from asyncrl.bench import trl

    calls = _record_runs(monkeypatch)
    s = trl.TrlBenchSettings(held_out=False, ablations={"zv": ["algorithm.filter_zero_variance=true"]},
                             ablation_modes=["sync", "async"])
    result = trl._bench_size(s, tmp_path, "")
    assert list(result["systems"]) == ["trl", "asyncrl_sync", "asyncrl_async", "asyncrl_sync_zv", "asyncrl_async_zv"]
    assert [(out.name, mode, sharing, extra) for _, out, mode, sharing, extra in calls[-2:]] == [
        ("asyncrl_sync_zv", "sync", "split", ("algorithm.filter_zero_variance=true",)),
        ("asyncrl_async_zv", "async", "split", ("algorithm.filter_zero_variance=true",))]


def test_bench_trl_gives_trl_the_device_and_precision_asyncrl_trains_in():
    """TRL is pinned to the CPU only where asyncrl's learner is on it, and autocasts to bf16
    exactly where asyncrl's learner does (``learner.autocast``, by default on CUDA)."""
    from asyncrl.bench.trl import TrlBenchSettings, precision, task_config, trl_precision_args

    cpu = precision(task_config(TrlBenchSettings(), ["model.device=cpu"]))
    assert cpu == {"device": "cpu", "dtype": "float32", "autocast": "off"}
    assert trl_precision_args(cpu) == {"use_cpu": True, "bf16": False, "model_init_kwargs": {"dtype": "float32"}}
    cast = precision(task_config(TrlBenchSettings(), ["model.device=cpu", "learner.autocast=bfloat16"]))
    assert trl_precision_args(cast)["bf16"] is True
    gpu = precision(task_config(TrlBenchSettings(), ["model.device=cuda"]))  # a config names cuda without one
    assert gpu == {"device": "cuda", "dtype": "float32", "autocast": "bfloat16"}
    assert trl_precision_args(gpu) == {"use_cpu": False, "bf16": True, "model_init_kwargs": {"dtype": "float32"}}


@pytest.mark.slow
def test_bench_tinker_smoke(tmp_path, capsys):
    """Both learners take the same first step (the same loss from the same weights), every
    timing is there, the ratios are the medians' and the server child is gone after."""
    pytest.importorskip("tinker")
    pytest.importorskip("peft")
    out = tmp_path / "tinker"
    assert main(["bench", "tinker", "rows=2", "prompt_tokens=8", "response_tokens=8", "repeats=1", "lora_rank=4",
                 "--out", str(out)]) == 0
    step = json.loads((out / "bench.json").read_text())["step"]
    assert step["first_loss"]["url"] == pytest.approx(step["first_loss"]["local"], rel=1e-4, abs=1e-6)
    assert {len(v) for v in step["times"].values()} == {1} and all(v > 0 for v in step["medians"].values())
    m = step["medians"]
    assert step["step_ratio"] == pytest.approx(m["url_step"] / m["local_step"])
    assert m["url_forward_backward"] <= m["url_step"]
    assert_phases(capsys.readouterr().out, "tinker", {
        f"step: 2 rows, {step['model_tokens']} model tokens, addition-tiny":
            r"step [\d.]+ s through the URL, [\d.]+ s in process: [\d.]+x"})
