"""``asyncrl plan``: the virtual clock, the simulated runtime under the real trainer, the
costs fitted to a real run, and the command. The proof that the virtual clock changes
nothing but the speed: the same simulated run on the virtual clock and on a standard
event loop (really sleeping, the costs scaled down) writes the same events in the same
order, and the virtual one takes a fraction of the simulated time."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.jsonl import read_jsonl
from asyncrl.orchestrator.metrics import run_figures
from asyncrl.orchestrator.trainer import Trainer
from asyncrl.plan import virtual_clock
from asyncrl.plan.costs import Costs, EngineCosts, LearnerCosts, SyncCosts, Workload, _fit_engine, fit_run, read_cluster
from asyncrl.plan.planner import simulate
from asyncrl.plan.simulated import simulated_runtime
from asyncrl.plan.virtual_clock import SimulationStuck, run_virtual

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples/countdown/async.yaml")


def test_the_virtual_clock_jumps_to_each_timer_and_keeps_their_order():
    async def main():
        loop, order = asyncio.get_running_loop(), []

        async def wake(name: int, after: float) -> None:
            await asyncio.sleep(after)
            order.append((name, loop.time()))

        async with asyncio.TaskGroup() as tg:
            for i in range(4):
                tg.create_task(wake(i, 3600.0 * (4 - i)))
        return order

    start = time.perf_counter()
    order, simulated = run_virtual(main())
    assert order == [(3, 3600.0), (2, 7200.0), (1, 10800.0), (0, 14400.0)]
    assert simulated == 14400.0 and time.perf_counter() - start < 5  # four simulated hours


def test_work_on_a_thread_takes_no_simulated_time_and_comes_back_before_later_timers():
    async def main():
        loop, seen = asyncio.get_running_loop(), []

        async def timer() -> None:
            await asyncio.sleep(0.001)
            seen.append(("timer", loop.time()))

        async def thread() -> None:
            await asyncio.to_thread(time.sleep, 0.2)  # 200 real ms, against a 1-ms simulated timer
            seen.append(("thread", loop.time()))

        async with asyncio.TaskGroup() as tg:
            tg.create_task(timer())
            tg.create_task(thread())
        return seen

    seen, _ = run_virtual(main())
    assert seen == [("thread", 0.0), ("timer", 0.001)]


def test_a_simulation_that_can_never_wake_says_so(monkeypatch):
    monkeypatch.setattr(virtual_clock, "STUCK_AFTER_S", 0.2)

    async def waits_forever():
        await asyncio.Event().wait()

    with pytest.raises(SimulationStuck, match="stuck"):
        run_virtual(waits_forever())


COSTS = Costs(  # a run of a few simulated minutes: 0.25 s per decode step, 10 s per learner step
    engine=EngineCosts(step_s=0.25, per_sequence_s=0.02, prefill_s=0.5, prefill_per_row_s=0.1),
    learner=LearnerCosts(per_token_s=0.02, step_s=4.0, recompute=0.25, overhead_s=0.3, warmup_s=2.0),
    sync=SyncCosts(fixed_s=1.0), workload=Workload(response_tokens=(3, 7, 12, 20), prompt_tokens=(30,)),
    episode_lead_s=0.05, episode_tail_s=0.2)


def _events(run_dir: Path) -> list[tuple]:
    return [(e["kind"], e.get("group"), e.get("step"), e.get("version"))
            for e in read_jsonl(run_dir / "timeline.jsonl")]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.slow
def test_the_virtual_clock_runs_the_same_events_in_the_same_order_as_a_slowed_real_run(tmp_path, mode):
    """Minutes of simulated training in seconds; the same simulated run on a standard loop
    (sleeping for real, every cost scaled by 1/60) gives the same timeline and samples."""
    overrides = [f"mode={mode}", "total_steps=6", "batch_size=2", "group_size=2", "eval_every=0", "save_every=0",
                 "weight_sync.method=object_store", f"partial_rollout={'continue' if mode == 'async' else 'off'}"]
    virtual_cfg = load_config(EXAMPLE, [f"output_dir={tmp_path / 'virtual'}", *overrides])
    start = time.perf_counter()
    _, simulated = run_virtual(Trainer(virtual_cfg, runtime=simulated_runtime(COSTS, 1)).run_async())
    virtual_s = time.perf_counter() - start

    scale = 1 / 60
    real_cfg = load_config(EXAMPLE, [f"output_dir={tmp_path / 'real'}", *overrides])
    start = time.perf_counter()
    asyncio.run(Trainer(real_cfg, runtime=simulated_runtime(COSTS.scaled(scale), 1)).run_async())
    real_s = time.perf_counter() - start

    assert simulated > 60, "the simulated run is minutes long"
    # A clock that slept would take all of `simulated` (~67 s); the run's own compute took 6.8 s once
    # with other jobs on both cores, over a tenth. Half is generous for that and still tells a jump
    # from a sleep.
    assert virtual_s < simulated / 2, (virtual_s, simulated)
    assert real_s >= simulated * scale * 0.9  # it really slept
    assert _events(tmp_path / "virtual") == _events(tmp_path / "real")
    versions = [[(s["task_id"], s["behavior_version_min"], s["behavior_version_max"], s["trained_version"])
                 for s in read_jsonl(tmp_path / name / "samples.jsonl")] for name in ("virtual", "real")]
    assert versions[0] == versions[1]
    rows = read_jsonl(tmp_path / "virtual" / "metrics.jsonl")
    assert rows[-1]["time/elapsed"] == pytest.approx(simulated, rel=0.05)  # metrics are in simulated seconds


def test_the_engine_fit_recovers_decode_and_prefill_costs_timed_apart_or_together():
    """Step rows made from known costs (decode 4 ms + 0.5 ms per sequence + 2 µs per cache
    position; prefill 6 ms + 9 ms per prompt row): with ``rollout/prefill_s`` every part
    comes back; without it (an engine that does not time its prefills) the one fit over all
    busy seconds ties a prefill's fixed cost to a decode step's and reproduces each step
    only roughly."""
    rows = []
    for decode_steps, prefills, fresh, reused, sequences, positions in [
            (7, 2, 3, 5, 60, 900), (9, 3, 3, 9, 90, 4000), (5, 1, 1, 7, 30, 700), (12, 4, 6, 10, 140, 2500),
            (8, 2, 4, 4, 70, 3000)]:
        prefill_s = 0.006 * prefills + 0.009 * fresh
        decode_s = 0.004 * decode_steps + 0.0005 * sequences + 2e-6 * positions
        rows.append({"rollout/busy_s": decode_s + prefill_s, "rollout/prefill_s": prefill_s,
                     "rollout/decode_steps": decode_steps, "rollout/prefills": prefills, "rollout/prefill_rows": fresh,
                     "rollout/prefill_reused": reused, "rollout/tokens": sequences + fresh + reused,
                     "rollout/decode_positions": positions})
    apart = _fit_engine(rows, 1, 64, [])
    assert (apart.step_s, apart.per_sequence_s) == (pytest.approx(0.004), pytest.approx(0.0005))
    assert apart.per_context_token_s == pytest.approx(2e-6) and apart.padded
    assert (apart.prefill_s, apart.prefill_per_row_s) == (pytest.approx(0.006), pytest.approx(0.009))
    # an engine that times neither its prefills nor its cache positions (and pays nothing per position)
    rows = [{**{k: v for k, v in r.items() if k not in ("rollout/prefill_s", "rollout/decode_positions")},
             "rollout/busy_s": r["rollout/busy_s"] - 2e-6 * r["rollout/decode_positions"]} for r in rows]
    together = _fit_engine(rows, 1, 64, [])
    assert together.prefill_s == together.step_s
    for r in rows:
        busy = (together.decode_step(0, 0) * (r["rollout/decode_steps"] + r["rollout/prefills"])
                + together.per_sequence_s * r["rollout/tokens"]
                + together.prefill_per_row_s * r["rollout/prefill_rows"])
        assert busy == pytest.approx(r["rollout/busy_s"], rel=0.05)


@pytest.mark.slow
def test_a_plan_fitted_to_a_real_run_predicts_its_samples_per_s(tmp_path):
    """A small real async run (the shipped Countdown example), then ``plan --from`` it: the
    simulated run's samples/s within 40 % of the real one — 16 steps are noisy: eight such
    runs on 2026-11-24 gave −11 … +23 %, one CI run +30 % (the docs table holds the
    tighter figures of longer runs) and its staleness within η."""
    run = tmp_path / "run"
    assert main(["train", EXAMPLE, f"output_dir={run}", "total_steps=16", "batch_size=4", "eval_every=0"]) == 0
    costs = fit_run(run)
    # the engine's busy seconds are spread over forward passes, tokens and prompt rows by the fit
    # (on ~6-token Countdown answers these are nearly collinear, so which one carries them varies)
    assert costs.engine.decode_step(8, 0) + costs.engine.prefill([15]) > 0
    assert costs.learner.step(1000, on_policy=False) > 0
    assert 0 < costs.episode_lead_s < 0.5 and 0 < costs.episode_tail_s < 0.5  # an episode's own time, timed
    cfg = load_config(str(run / "config.yaml"), [])
    predicted, measured = simulate(cfg, costs, tmp_path / "plan"), run_figures(run)
    assert predicted["samples"] == measured["samples"]
    assert predicted["samples_per_s"] == pytest.approx(measured["samples_per_s"], rel=0.40)
    assert predicted["staleness_max"] <= 2


@pytest.mark.slow
def test_the_plan_command_writes_a_plan_with_a_sweep(tmp_path, capsys):
    table = tmp_path / "cluster.yaml"
    table.write_text(json.dumps({
        "name": "a test cluster", "rollout_devices": 4, "learner_devices": 4, "model_params_b": 1,
        "engine": {"decode_step_s": 0.02, "per_sequence_s": 0.0002, "max_batch": 64},
        "learner": {"tokens_per_s_per_device": 4000},
        "weight_sync": {"fixed_s": 0.5},
        "workload": {"prompt_tokens": 100, "response_tokens": {"mean": 300, "sigma": 0.8, "max": 1000}},
        "run": {"batch_size": 4, "group_size": 4, "total_steps": 8, "sampling.max_tokens": 1000},
    }))
    out = tmp_path / "plan"
    assert main(["plan", EXAMPLE, "--cluster", str(table), "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["config"]["batch_size"] == 4 and plan["prediction"]["samples"] == 8 * 4 * 4
    assert plan["prediction"]["speedup_vs_sync"] > 1  # async with η = 2 beats sync on a long tail
    assert list(plan["sweep"]) == ["4:4", "6:2", "7:1"]  # rollout:learner devices, 8 in all
    cells = next(iter(plan["sweep"].values()))
    assert list(cells) == ["sync", "one_step_off", "async_eta1_abort", "async_eta2_abort",
                           "async_eta4_abort", "async_eta8_abort"]
    assert all(int(k) <= 8 for cell in cells.values() for k in cell["staleness_hist"])
    if plan["figure"]:
        assert Path(plan["figure"]).is_file()
    assert "speed-up" not in capsys.readouterr().err  # the table goes to stdout
    # a second plan into the same directory replaces its own runs
    assert main(["plan", EXAMPLE, "--cluster", str(table), "--out", str(out), "--no-sweep"]) == 0
    assert not (out / "sweep").exists()


def test_the_plan_command_refuses_what_it_cannot_plan_from(tmp_path, capsys):
    assert main(["plan", EXAMPLE]) == 2
    assert "--from RUN_DIR" in capsys.readouterr().err
    assert main(["plan", EXAMPLE, "--from", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err
    table = tmp_path / "t.yaml"
    table.write_text("rollout_devices: 2\n")
    with pytest.raises(ValueError, match="learner_devices"):
        read_cluster(table)
    assert main(["plan", EXAMPLE, "--cluster", str(table)]) == 2
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("mine")
    table.write_text(json.dumps({"rollout_devices": 1, "learner_devices": 1, "engine": {"decode_step_s": 0.01},
                                 "learner": {"tokens_per_s_per_device": 1e4},
                                 "workload": {"response_tokens": [5, 9]}}))
    assert main(["plan", EXAMPLE, "--cluster", str(table), "--out", str(busy)]) == 2
    assert "not empty" in capsys.readouterr().err and (busy / "x").read_text() == "mine"


def test_a_cluster_table_calibrated_to_a_published_sync_baseline_reproduces_it(tmp_path):
    """The decode step is calibrated so that the colocated sync baseline generates a step's
    batch in ``sync_generation_s`` (queueing beyond ``max_batch`` included), and its step is
    that plus the published training and remaining seconds."""
    table = tmp_path / "published.yaml"
    table.write_text(json.dumps({
        "rollout_devices": 2, "learner_devices": 2, "devices_per_engine": 1,
        "engine": {"sync_generation_s": 60.0, "batch_doubling": 16, "max_batch": 8},
        "learner": {"seconds_per_step": 30.0},
        "sync_baseline": {"layout": "colocated", "learner_seconds_per_step": 40.0, "other_s": 5.0},
        "workload": {"prompt_tokens": 50, "response_tokens": {"mean": 200, "sigma": 0.7, "max": 800}},
        "run": {"batch_size": 6, "group_size": 4, "total_steps": 12, "sampling.max_tokens": 800},
    }))
    costs, run = read_cluster(table)
    assert costs.engines == 2 and costs.sync_engines == 4
    cfg = load_config(EXAMPLE, [f"{k}={json.dumps(v)}" for k, v in run.items()] + ["mode=sync", "partial_rollout=off"])
    simulate(cfg, costs, tmp_path / "sync")
    rows = [r for r in read_jsonl(tmp_path / "sync" / "metrics.jsonl") if "time/step" in r]
    waits = [r["time/step"] * r["trainer/idle_ratio"] for r in rows]
    learner = [r["time/learner"] for r in rows]
    assert sum(waits) / len(waits) == pytest.approx(60.0, rel=0.15)  # other draws than the calibration's
    assert sum(learner) / len(learner) == pytest.approx(45.0, rel=0.10)  # 40 s training + 5 s the rest


def test_the_learner_computes_slower_while_the_engine_it_shares_the_cores_with_is_busy():
    """1 s of learner work at contention 0.5 beside an engine busy for its first 0.6 s: 0.4 s
    of work done then (at 1/1.5 speed), the other 0.6 s alone: it ends at 1.2 s."""
    from asyncrl.plan.engine import SharedCores

    async def main():
        cores = SharedCores()
        cores.set_engine(True)
        asyncio.get_running_loop().call_later(0.6, cores.set_engine, False)
        await cores.compute(1.0, 0.5)
        return asyncio.get_running_loop().time()

    ended, _ = run_virtual(main())
    assert ended == pytest.approx(1.2)


def _fake_run(run: Path, steps: list[dict], tokens: list[int]) -> None:
    """A finished run's files as ``fit_run`` reads them: one on-policy group per step."""
    run.mkdir()
    (run / "config.yaml").write_text("mode: async\n")
    rows = [{"step": i + 1, "trainer/idle_ratio": 0.0, "rollout/groups_accepted_total": i + 1, **row}
            for i, row in enumerate(steps)]
    for before, row in zip([None, *rows], rows):  # the steps back to back
        row["time/elapsed"] = (before["time/elapsed"] if before else 0.0) + row["time/step"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [{"step": i + 1, "task_id": str(i), "group": i, "response_tokens": n - 10, "prompt_tokens": 10,
                "trained_version": i, "behavior_version_min": i, "behavior_version_max": i}
               for i, n in enumerate(tokens)]
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def test_the_fits_find_how_much_learner_and_engine_slow_each_other_and_leave_out_drain_waits(tmp_path):
    """Steps made from known costs: the learner 100 µs per token alone and 1.5× slower beside
    the busy engine, the engine's decode 2 ms per step alone and 1.25× slower beside the
    learner; each step's overlap fraction differs. Both factors come back, and the alone
    costs. With every step fully shared the two cannot be told apart: no factor, and the
    learner's cost is its shared one. A weight sync's wait for running sequences
    (``rollout/drain_s``) is not counted as its cost."""
    tokens = [1000, 2000, 3000, 1500, 2500, 1000, 2000, 3000]

    def steps(fractions):
        out = []
        for n, f in zip(tokens, fractions):
            work = 1e-4 * n
            learner_s = work / (1 - f * 0.5 / 1.5)  # learner_s = work + k·overlap, overlap = f·learner_s
            overlap = f * learner_s
            decode_steps = 40 + n // 100
            decode_s = 0.002 * decode_steps + overlap * 0.25 / 1.25  # the same law with k = c / (1 + c)
            out.append({"time/learner": learner_s, "time/learner_overlap": overlap, "time/step": learner_s + 0.01,
                        "time/weight_sync": 0.002 + 0.05 * f, "rollout/drain_s": 0.05 * f,
                        "rollout/busy_s": decode_s + 0.001, "rollout/prefill_s": 0.001, "rollout/prefills": 1,
                        "rollout/prefill_rows": 1, "rollout/prefill_reused": 0, "rollout/decode_steps": decode_steps,
                        "rollout/tokens": 1 + decode_steps})
        return out

    _fake_run(tmp_path / "mixed", steps([0.0, 1.0, 0.2, 0.9, 0.1, 1.0, 0.0, 0.8]), tokens)
    mixed = fit_run(tmp_path / "mixed")
    assert mixed.learner.contention == pytest.approx(0.5, rel=1e-3)
    assert mixed.engine.contention == pytest.approx(0.25, rel=1e-3)
    assert mixed.engine.step_s == pytest.approx(0.002, rel=1e-3)
    assert mixed.sync.fixed_s == pytest.approx(0.002)
    _fake_run(tmp_path / "shared", steps([1.0] * 8), tokens)
    shared = fit_run(tmp_path / "shared")
    assert shared.learner.contention == 0 and shared.engine.contention == 0
    assert shared.learner.per_token_s == pytest.approx(1.5e-4, rel=0.05)  # what the learner cost beside the engine


def test_a_plan_deals_a_runs_groups_rather_than_drawing_them():
    """Each group of the run once per round, in a shuffled order: a plan as long as its run
    generates its tokens."""
    groups = tuple((10, (n, n + 1)) for n in range(1, 40))
    dealt = Workload(groups=groups).deal(seed=3)
    first, second = [next(dealt) for _ in groups], [next(dealt) for _ in groups]
    assert sorted(first) == sorted(second) == sorted(groups) and first != list(groups)


# ------------------------------------------------------------------ engine=remote: the fleet
FLEET_TABLE = {
    "name": "two test servers", "learner_devices": 1, "model_params_b": 1,
    "engine": {"decode_step_s": 0.02, "per_sequence_s": 0.0002, "max_batch": 64},
    "learner": {"tokens_per_s_per_device": 4000}, "weight_sync": {"fixed_s": 0.5, "per_engine_s": 0.2},
    "workload": {"prompt_tokens": 100, "response_tokens": {"mean": 300, "sigma": 0.8, "max": 1000}},
    "servers": {"urls": ["http://gpu1:8100", "http://gpu2:8100"], "kind": "vllm", "weights_dir": "/shared/asyncrl"},
    "run": {"batch_size": 4, "group_size": 4, "total_steps": 8, "sampling.max_tokens": 1000},
}


def _command(out: str, starts: str) -> list[str]:
    import shlex

    line = next(line.strip() for line in out.splitlines() if line.strip().startswith(starts))
    return shlex.split(line)


def test_a_fleet_of_vllm_servers_is_described_with_each_servers_flags_and_no_key(capsys):
    urls = "remote.urls=[http://gpu1:8100,http://gpu2:8101]"
    assert main(["plan", EXAMPLE, "engine=remote", urls, "remote.weights_dir=/shared/w", "remote.api_key=topsecret",
                 "model.lora=true", "--server", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "topsecret" not in out and "export ASYNCRL_REMOTE_KEY=" in out
    servers = [line.strip() for line in out.splitlines() if line.strip().startswith(("gpu1: ", "gpu2: "))]
    assert [s.split(":", 1)[0] for s in servers] == ["gpu1", "gpu2"]
    for server, port in zip(servers, ("8100", "8101")):
        assert server.split(": ", 1)[1].startswith("VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                                                   "vllm serve --model models/countdown-tiny ")
        for flag in ("--logprobs-mode processed_logprobs", "--generation-config vllm", "--enable-lora",
                     "--dtype float32", "--max-lora-rank 16", f"--port {port}", '--api-key "$ASYNCRL_REMOTE_KEY"'):
            assert flag in server, (flag, server)
    assert out.index("gpu2: ") < out.index("asyncrl train ")  # the servers first, then the trainer
    assert "/shared/w" in out and "no throughput prediction" in out and "problem:" not in out


@pytest.mark.parametrize("device, cuda, on_cpu", [("auto", False, True), ("auto", True, False), ("cpu", True, True),
                                                   ("cuda", False, False)])
def test_the_vllm_server_command_names_a_directory_and_the_entry_point_for_the_servers_device(
        monkeypatch, tmp_path, device, cuda, on_cpu):
    """On 83737f1 ``asyncrl plan --server vllm`` printed ``vllm serve`` on ``device=auto`` (the
    CPU build rejects it) and ``--model smollm2-135m-instruct`` (asyncrl's name, which vLLM
    looks up on the hub and exits)."""
    import shlex

    import torch

    from asyncrl import policy
    from asyncrl.plan.fleet import server_command

    monkeypatch.setattr(policy, "cached_model", lambda name: tmp_path / name)  # as `asyncrl models get` left it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = load_config(EXAMPLE, ["engine=remote", "remote.urls=[http://127.0.0.1:8100]", f"model.device={device}",
                                "model.path=smollm2-135m-instruct"])
    words = shlex.split(server_command(cfg, EXAMPLE, [], cfg.remote.urls[0], "vllm", keyed=True))
    assert words[words.index("--model") + 1] == str(tmp_path / "smollm2-135m-instruct")
    program = words[words.index("VLLM_SERVER_DEV_MODE=1") + (2 if on_cpu else 1):words.index("--model")]
    assert program == (["python", "-m", "vllm.entrypoints.openai.api_server"] if on_cpu else ["vllm", "serve"])
    assert ("VLLM_CPU_KVCACHE_SPACE=1" in words) == on_cpu  # 1 GiB: the machine's memory left to the trainer
    sized = load_config(EXAMPLE, ["engine=remote", "remote.urls=[http://127.0.0.1:8100]", "model.device=cpu",
                                  "vllm.kv_cache_gb=3"])
    assert "VLLM_CPU_KVCACHE_SPACE=3" in server_command(sized, EXAMPLE, [], sized.remote.urls[0], "vllm", keyed=True)


def test_a_loopback_fleet_of_serve_engines_needs_no_key_and_the_trainers_command_reads_back(capsys):
    urls = "remote.urls=[http://127.0.0.1:8100,http://127.0.0.1:8101]"
    assert main(["plan", EXAMPLE, "engine=remote", urls, "batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert "ASYNCRL_REMOTE_KEY" not in out
    train = _command(out, "asyncrl train")
    cfg = load_config(train[2], train[3:])
    assert (cfg.engine, cfg.remote.urls, cfg.batch_size) == ("remote", ["http://127.0.0.1:8100",
                                                                         "http://127.0.0.1:8101"], 4)
    serve = _command(out, "127.0.0.1: asyncrl serve-engine")[1:]
    served = load_config(serve[2], serve[3:])  # what serve-engine would run: its own engine on that port
    assert (served.engine, served.engine_server.host, served.engine_server.port) == ("torch", "127.0.0.1", 8100)
    # servers on other machines without a shared weights directory: said, and the exit status is 1
    assert main(["plan", EXAMPLE, "engine=remote", "remote.urls=[http://gpu1:8100]"]) == 1
    assert "problem: remote.weights_dir is unset" in capsys.readouterr().out
    assert main(["plan", EXAMPLE, "--probe"]) == 2  # not engine=remote: nothing to probe
    assert "engine=remote" in capsys.readouterr().err


def test_probe_names_the_servers_that_do_not_answer_and_what_the_others_serve():
    import socket

    from aiohttp import web
    from conftest import make_model

    from asyncrl.config import EngineServerConfig
    from asyncrl.engine import TorchEngine
    from asyncrl.json_api import listen
    from asyncrl.plan.fleet import probe
    from asyncrl.rollout.engine_server import EngineServer

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def main():
        release = asyncio.Event()

        async def hang(request):
            await release.wait()
            return web.Response()

        app = web.Application()
        app.router.add_get("/health", hang)
        runner, hung = await listen(app, "127.0.0.1", 0)
        server = EngineServer(TorchEngine(make_model(max_positions=32), seed=0), model_name="tiny",
                              settings=EngineServerConfig(port=0))
        await server.start()
        try:
            return hung, server.base_url, await probe([server.base_url, dead, hung], None, timeout_s=0.5)
        finally:
            release.set()
            await server.stop()
            await server.engine.shutdown()
            await runner.cleanup()

    hung, up, (live, refused, silent) = asyncio.run(main())
    assert live == "up: serves 'tiny', max_model_len 32"
    assert refused.startswith("unreachable: GET /health after ") and "Connect" in refused
    assert silent == "unreachable: GET /health did not answer within 0.5 s"


def test_a_cluster_tables_servers_are_the_runs_engines(tmp_path):
    from asyncrl.plan.costs import with_servers

    table = tmp_path / "fleet.yaml"
    table.write_text(json.dumps(FLEET_TABLE))
    costs, run = read_cluster(table)
    assert costs.engines == 2 and costs.table["rollout_devices"] == 2  # one engine per server
    assert run == {"engine": "remote", "remote.urls": FLEET_TABLE["servers"]["urls"],
                   "remote.weights_dir": "/shared/asyncrl", **FLEET_TABLE["run"]}
    assert with_servers({**FLEET_TABLE, "rollout_devices": 6})["rollout_devices"] == 6  # given: kept


@pytest.mark.slow
def test_the_plan_of_a_cluster_tables_fleet_predicts_it_against_one_server(tmp_path, capsys):
    table = tmp_path / "fleet.yaml"
    table.write_text(json.dumps(FLEET_TABLE))
    out = tmp_path / "plan"
    assert main(["plan", EXAMPLE, "--cluster", str(table), "--out", str(out), "--no-sweep"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    fleet = plan["fleet"]
    assert fleet["kind"] == "vllm" and [s["url"] for s in fleet["servers"]] == FLEET_TABLE["servers"]["urls"]
    assert fleet["scaling"]["servers"] == 2
    assert fleet["scaling"]["samples_per_s"] == plan["prediction"]["samples_per_s"]
    assert fleet["scaling"]["one_server_samples_per_s"] < fleet["scaling"]["samples_per_s"]
    printed = capsys.readouterr().out
    assert "on 2 servers against" in printed and "not modelled" in printed
    assert "remote.weights_dir=/shared/asyncrl" in fleet["trainer_command"]


def test_a_run_on_remote_servers_cannot_be_fitted_and_says_what_to_plan_from(tmp_path):
    """Its rows have no engine steps or prefills (the servers keep them)."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/step": 1.0, "rollout/busy_s": 0.5}) + "\n")
    (tmp_path / "samples.jsonl").write_text("")
    (tmp_path / "config.yaml").write_text("engine: remote\n")
    with pytest.raises(ValueError, match="engine=remote.*engine=torch"):
        fit_run(tmp_path)


def test_a_side_alone_with_every_core_computes_its_speedup_faster_and_only_where_the_run_hands_them_over():
    """rollout.thread_sharing=colocated. The learner: 1 s of work on its share at contention
    0.5 beside an engine busy for its first 0.6 s: 0.4 s of work done then (1/1.5 speed);
    the other 0.6 s with every core at 2× is 0.3 s: it ends at 0.9 s (1.2 s under split,
    where alone it keeps its share). The engine: a prefill that costs nothing samples the
    first of 10 units, then 9 decode steps of 10 ms, each 1.25× faster with the learner
    idle: 9 × 8 ms = 72 ms (90 ms under split)."""
    from asyncrl.plan.engine import EngineCosts, SharedCores, SimulatedEngine

    async def learner(whole):
        cores = SharedCores(whole_when_alone=("learner",) if whole else ())
        cores.set_engine(True)
        asyncio.get_running_loop().call_later(0.6, cores.set_engine, False)
        await cores.compute(1.0, 0.5, alone_speedup=2.0)
        return asyncio.get_running_loop().time()

    async def engine(whole):
        sim = SimulatedEngine(EngineCosts(step_s=0.01, alone_speedup=1.25), unit=1,
                              cores=SharedCores(whole_when_alone=("engine", "learner") if whole else ("learner",)))
        loop = asyncio.ensure_future(sim.run())
        await sim.generate(1, 10, ("task", 0))
        loop.cancel()
        return asyncio.get_running_loop().time()

    assert run_virtual(learner(True))[0] == pytest.approx(0.9)
    assert run_virtual(learner(False))[0] == pytest.approx(1.2)
    assert run_virtual(engine(True))[0] == pytest.approx(0.072)
    assert run_virtual(engine(False))[0] == pytest.approx(0.090)


def test_in_turns_the_simulated_engine_parks_while_the_learner_computes_and_neither_slows_the_other():
    """rollout.thread_sharing=turns, contention 0 (the learner alone computes 2x faster than on
    its share, the engine's decode unit is 10 ms on a share, 5 ms alone). The prefill samples
    the first of 10 units; decode units at 0-5, 5-10, 10-15 ms. The learner starts 1 s of
    share-work at 12 ms, inside the third unit: 3 ms on its share beside it, then the engine
    parks at the unit's end, and the other 997 ms at every core take 498.5 ms: it ends at
    513.5 ms. The engine's other 6 units follow, alone: 543.5 ms."""
    from asyncrl.plan.engine import EngineCosts, SharedCores, SimulatedEngine

    async def main():
        loop = asyncio.get_running_loop()
        cores = SharedCores(whole_when_alone=("engine", "learner"), engine_yields=True)
        sim = SimulatedEngine(EngineCosts(step_s=0.01, alone_speedup=2.0), unit=1, cores=cores)
        engine_loop = asyncio.ensure_future(sim.run())
        learner_ended = loop.create_future()

        async def learner():
            await asyncio.sleep(0.012)
            await cores.compute(1.0, 0.0, alone_speedup=2.0)
            learner_ended.set_result(loop.time())

        learner_task = asyncio.ensure_future(learner())
        await sim.generate(1, 10, ("task", 0))
        ended = loop.time()
        await learner_task
        engine_loop.cancel()
        return ended, learner_ended.result()

    (engine_ended, learner_ended), _ = run_virtual(main())
    assert learner_ended == pytest.approx(0.5135)
    assert engine_ended == pytest.approx(0.5435)


def test_the_fit_finds_the_learners_speedup_with_every_core_from_a_colocated_runs_steps(tmp_path):
    """Steps made from known costs: the learner's work 100 µs per token on its share, 1.6×
    faster with every core, a different fraction g of each step at every core, so
    T = W − 0.6·g·T, T = W / (1 + 0.6·g). The speedup and the share's cost come back."""
    tokens = [1000, 2000, 3000, 1500, 2500, 1000, 2000, 3000]
    rows = []
    for n, g in zip(tokens, [0.0, 1.0, 0.2, 0.9, 0.1, 1.0, 0.0, 0.8]):
        learner_s = 1e-4 * n / (1 + 0.6 * g)
        decode_steps = 40 + n // 100
        rows.append({"time/learner": learner_s, "time/learner_all_cores_s": g * learner_s,
                     "time/learner_overlap": 0.0, "time/step": learner_s + 0.01, "time/weight_sync": 0.002,
                     "rollout/busy_s": 0.002 * decode_steps + 0.001, "rollout/prefill_s": 0.001,
                     "rollout/prefills": 1, "rollout/prefill_rows": 1, "rollout/prefill_reused": 0,
                     "rollout/decode_steps": decode_steps, "rollout/tokens": 1 + decode_steps})
    _fake_run(tmp_path / "colocated", rows, tokens)
    costs = fit_run(tmp_path / "colocated")
    assert costs.learner.alone_speedup == pytest.approx(1.6, rel=1e-3)
    assert costs.learner.per_token_s == pytest.approx(1e-4, rel=1e-3)
    assert costs.engine.alone_speedup == 1.0  # its steps logged no seconds at every core
    assert any("the learner is 1.60× and a decode step 1.00× faster" in line for line in costs.describe())
