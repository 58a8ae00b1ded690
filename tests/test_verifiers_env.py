"""``task.name: verifiers``: a `verifiers` taskset (examples/verifiers_env, written in the
package's own format) trains unchanged. Its rubric's scores are the trained rewards, its
model calls go through the gateway and train token-exact, and a missing package or an
environment that cannot be loaded exits 2 naming it. Skipped without ``.[verifiers]``."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

vf = pytest.importorskip("verifiers.v1")

from conftest import SpyEngine
from test_examples import SMALL, in_repo  # noqa: F401 (a fixture: the examples' paths are the repository's)

from asyncrl.cli import main
from asyncrl.tasks import load_tasks
from asyncrl.tasks.verifiers_tasks import prompt_messages, score_reply, verifiers_tasks

pytestmark = pytest.mark.usefixtures("in_repo")
CONFIG = "examples/verifiers_env/train.yaml"
ENV = "examples/verifiers_env/addition_taskset.py"


def rubric(task_id: str, text: str) -> float:
    vf_task = verifiers_tasks(ENV, {})[int(task_id)]
    return asyncio.run(score_reply(vf_task, prompt_messages(vf_task), text))


def run_one_episode(engine, tokenizer, task, max_tokens):
    """``task``'s episode under the openai_agent workflow with the adapter's agent, on a
    real gateway over ``engine`` (closed after)."""
    from asyncrl.rollout.client import LLMClient
    from asyncrl.rollout.gateway import Gateway, get_format
    from asyncrl.rollout.workflows import run_episode
    from asyncrl.rollout.workflows.openai_agent import OpenAIAgentWorkflow
    from asyncrl.rollout.workflows.verifiers_agent import run
    from asyncrl.types import SamplingParams

    async def main_():
        gateway = Gateway(tokenizer, get_format("hermes"), model_name="tiny")
        await gateway.start()
        try:
            return await run_episode(OpenAIAgentWorkflow(run, gateway), task,
                                     lambda: LLMClient(engine, tokenizer, SamplingParams(max_tokens=max_tokens)),
                                     timeout_s=60, max_retries=0)
        finally:
            await gateway.stop()
            await engine.engine.shutdown()

    return asyncio.run(main_())


def test_the_taskset_is_the_rows_its_tail_held_out():
    splits = load_tasks("verifiers", seed=0, num_train=0, num_validation=16, options={"environment": ENV})
    loaded = verifiers_tasks(ENV, {})
    assert (len(splits.train), len(splits.validation)) == (184, 16) == (len(loaded) - 16, 16)
    assert [t.prompt for t in splits.validation] == [t.data.prompt for t in loaded[-16:]]
    a, b = (int(x) for x in splits.train[0].prompt.rstrip("=").split("+"))
    assert rubric(splits.train[0].id, str(a + b)) == 1.0 and rubric(splits.train[0].id, str(a + b + 1)) == 0.0


def test_a_missing_package_environment_or_agent_exits_2_naming_it(tmp_path, monkeypatch, capsys):
    args = ["train", CONFIG, f"output_dir={tmp_path / 'run'}", *SMALL]
    assert main([*args, "task.options.environment=no-such-taskset"]) == 2
    assert "no-such-taskset" in capsys.readouterr().err
    assert main([*args, "workflow.name=single_turn", "workflow.agent=null"]) == 2  # the rubric scores, not a reward_fn
    assert "workflow.agent=asyncrl.rollout.workflows.verifiers_agent:run" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if never installed
    assert main(args) == 2
    assert '".[verifiers]"' in capsys.readouterr().err


def test_an_episode_is_the_gateway_call_token_exact_and_the_rubric_score(tiny_policy):
    from asyncrl.engine import TorchEngine

    model, tokenizer = tiny_policy
    task = load_tasks("verifiers", seed=0, num_train=3, num_validation=16, options={"environment": ENV}).train[2]
    spy = SpyEngine(TorchEngine(model, max_batch_size=4, seed=0))
    episode = run_one_episode(spy, tokenizer, task, max_tokens=4)
    assert episode.status == "ok", episode.error
    [trajectory] = episode.trajectories
    [(prompt_ids, completion)] = spy.calls  # one model call, the one the gateway served
    chat = tokenizer.apply_chat_template([{"role": "user", "content": task.prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
    assert trajectory.prompt_ids == prompt_ids == list(chat)  # the taskset's prompt, rendered by the chat template
    assert trajectory.response_ids == list(completion.token_ids) and set(trajectory.loss_mask) == {1}
    reply = trajectory.steps[-1].messages[-1]["content"]
    assert episode.reward == trajectory.reward == rubric(task.id, reply)


@pytest.mark.slow
def test_the_example_trains_on_the_rubrics_scores(tmp_path):
    out = tmp_path / "run"
    assert main(["train", CONFIG, f"output_dir={out}", *SMALL]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 4 and not (out / "errors.jsonl").read_text().strip()
    assert all(s["reward"] == rubric(s["task_id"], s["response"]) for s in samples)
    assert any(s["reward"] == 1.0 for s in samples)  # the shipped addition policy gets some right


def test_a_multi_turn_episode_answers_tool_calls_from_the_toolset_token_exact(tiny_policy):
    """examples/verifiers_env/calculator_taskset.py: the model calls the toolset's
    ``calc_add`` (written here: a random tiny model writes no call), the tool's result goes
    back as a tool message, the model answers; one trajectory holds both calls, the tool's
    tokens masked out, and the rubric scores the final reply."""
    from test_gateway_requests import Scripted

    from asyncrl.engine import TorchEngine

    model, tokenizer = tiny_policy
    env = "examples/verifiers_env/calculator_taskset.py"
    task = load_tasks("verifiers", seed=0, num_train=1, num_validation=8, options={"environment": env}).train[0]
    a, b = (int(x) for x in task.prompt.rstrip("=").split("+"))
    call = f'<tool_call>\n{{"name": "calc_add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'

    engine = Scripted(TorchEngine(model, max_batch_size=4, seed=0), tokenizer, call, str(a + b))
    episode = run_one_episode(engine, tokenizer, task, max_tokens=64)
    assert episode.status == "ok", episode.error
    assert episode.reward == 1.0 and episode.metadata["calls"] == 2
    [trajectory] = episode.trajectories
    first, second = engine.prompts
    assert trajectory.prompt_ids == first
    assert first + trajectory.response_ids[:len(second) - len(first)] == second  # the second call extends the first
    assert 0 in trajectory.loss_mask and trajectory.loss_mask[-1] == 1  # the tool's tokens are not trained on
    tool = [m for m in trajectory.steps[-1].messages if m["role"] == "tool"]
    assert [m["content"] for m in tool] == [str(a + b)]  # calc_add answered in-process


def test_a_tasks_toolsets_are_a_tool_box_as_mcp_servers_tools_are():
    """The one tool-box contract (asyncrl/tools/toolbox.py): the calculator taskset's tools
    listed as OpenAI tools and answered in-process; the model's mistakes answered, not raised."""
    from asyncrl.rollout.workflows.verifiers_agent import TasksetTools
    from asyncrl.tools.toolbox import ToolBox

    vf_task = verifiers_tasks("examples/verifiers_env/calculator_taskset.py", {})[0]
    tools = TasksetTools(vf_task)
    assert isinstance(tools, ToolBox) and [t["function"]["name"] for t in tools.openai_tools] == ["calc_add"]

    async def calls():
        await tools.setup()
        return [await tools.call({"function": {"name": name, "arguments": arguments}}) for name, arguments in
                [("calc_add", '{"a": 2, "b": 3}'), ("calc_mul", "{}"), ("calc_add", '{"a": "x"}')]]

    answer, unknown, invalid = asyncio.run(calls())
    assert answer == "5" and unknown.startswith("error: no tool 'calc_mul'") and invalid.startswith("error: ")
