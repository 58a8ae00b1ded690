"""``asyncrl train`` with ``workflow.name=openai_agent``: agents written against the
OpenAI SDK train unchanged, in the local and the Ray runtime."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main

SMALL = ["total_steps=2", "batch_size=2", "group_size=2", "eval.num_tasks=2", "eval.samples_per_task=1",
         "task.num_train=16", "task.num_validation=4", "algorithm.filter_zero_variance=false"]


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_sdk_agent_trains_on_every_call_it_made(tmp_path, policy_dir):
    out = tmp_path / "agent"
    assert main(["train", "examples/openai_agent/train.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "workflow.agent=tests/agent_two_calls.py:run", *SMALL]) == 0
    samples = rows(out / "samples.jsonl")
    assert len(samples) == 2 * 2 * 2  # steps × groups × samples: one trajectory per episode
    for s in samples:  # both calls in one trajectory: the model, the agent's turn (mask 0), the model
        roles = [seg["role"] for seg in s["response_segments"]]
        assert roles == ["model", "environment", "model"]
        assert "user\ncheck again\nassistant\n" in s["response_segments"][1]["text"]  # specials are not shown
    metrics = rows(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    trained = metrics[1:]  # step 0's row is the evaluation before training
    for m in trained:  # both of the agent's calls counted as turns of one episode, in every episode
        assert m["agent/turns_mean"] == 2 and m["agent/multi_turn_fraction"] == 1
    assert metrics[-1]["rollout/sampling_overrides_total"] == 0  # the agent asks for no sampling settings
    # The agent sends no tool results, so its episodes' tool errors are parse errors, all of
    # which the gateway counted when their sessions closed (and more, of episodes not trained).
    assert metrics[-1]["rollout/tool_parse_errors_total"] >= sum(m["agent/tool_errors_total"] for m in trained)


def test_a_bad_agent_name_exits_2(tmp_path, policy_dir, capsys):
    code = main(["train", "examples/openai_agent/train.yaml", f"model.path={policy_dir}",
                 f"output_dir={tmp_path / 'x'}", "workflow.agent=tests/agent_two_calls.py:missing"])
    assert code == 2 and "workflow.agent" in capsys.readouterr().err


@pytest.mark.slow
def test_the_example_agent_trains_on_ray(tmp_path, policy_dir):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    assert main(["train", "examples/openai_agent/train.yaml", f"model.path={policy_dir}", f"output_dir={out}",
                 "runtime=ray", "ray.num_cpus=2", "ray.num_rollout_workers=2", "ray.worker_cpus=0.5",
                 "ray.learner_cpus=1", *SMALL]) == 0
    assert len(rows(out / "samples.jsonl")) == 8


def test_an_agent_that_raises_or_hangs_is_an_error_episode_and_its_session_closes(tiny_policy):
    import asyncio

    from asyncrl.rollout.client import LLMClient
    from asyncrl.engine import TorchEngine
    from asyncrl.rollout.gateway import Gateway, get_format
    from asyncrl.tasks.base import Task
    from asyncrl.types import SamplingParams
    from asyncrl.rollout.workflows import run_episode
    from asyncrl.rollout.workflows.openai_agent import OpenAIAgentWorkflow

    model, tokenizer = tiny_policy
    seen: list[str] = []

    async def raising(task, base_url):
        seen.append(base_url)
        raise ConnectionError("the agent's own service is down")

    async def hanging(task, base_url):
        seen.append(base_url)
        await asyncio.sleep(3600)

    async def main():
        engine = TorchEngine(model, max_batch_size=4)
        gateway = Gateway(tokenizer, get_format("hermes"), model_name="tiny")
        await gateway.start()
        try:
            results = []
            for agent, timeout_s in ((raising, 30), (hanging, 0.3)):
                workflow = OpenAIAgentWorkflow(agent, gateway)
                episode = await run_episode(workflow, Task("t", "1 2 -> 3"),
                                            lambda: LLMClient(engine, tokenizer, SamplingParams(max_tokens=4)),
                                            timeout_s=timeout_s, max_retries=1)
                results.append(episode)
            return results, dict(gateway.sessions)
        finally:
            await gateway.stop()
            await engine.shutdown()

    (raised, hung), open_sessions = asyncio.run(main())
    assert raised.status == "error" and "the agent's own service is down" in raised.error and raised.attempts == 2
    assert hung.status == "error" and "timed out" in hung.error
    assert len(seen) == 4 and len(set(seen)) == 4 and open_sessions == {}  # a fresh session per attempt, all closed
