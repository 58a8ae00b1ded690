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

from conftest import SpyEngine  # noqa: E402
from test_examples import REPO, SMALL, in_repo  # noqa: E402,F401 (a fixture)

from asyncrl.cli import main  # noqa: E402
from asyncrl.tasks import load_tasks  # noqa: E402
from asyncrl.tasks.verifiers_env import prompt_messages, score_reply, verifiers_tasks  # noqa: E402

CONFIG = "examples/verifiers_env/train.yaml"
ENV = "examples/verifiers_env/addition_taskset.py"


def rubric(task_id: str, text: str) -> float:
    vf_task = verifiers_tasks(ENV, {})[int(task_id)]
    return asyncio.run(score_reply(vf_task, prompt_messages(vf_task), text))


def test_the_taskset_is_the_rows_its_tail_held_out(in_repo):
    splits = load_tasks("verifiers", seed=0, num_train=0, num_validation=16, options={"environment": ENV})
    loaded = verifiers_tasks(ENV, {})
    assert (len(splits.train), len(splits.validation)) == (184, 16) == (len(loaded) - 16, 16)
    assert [t.prompt for t in splits.validation] == [t.data.prompt for t in loaded[-16:]]
    a, b = (int(x) for x in splits.train[0].prompt.rstrip("=").split("+"))
    assert rubric(splits.train[0].id, str(a + b)) == 1.0 and rubric(splits.train[0].id, str(a + b + 1)) == 0.0


def test_a_missing_package_or_environment_exits_2_naming_it(in_repo, tmp_path, monkeypatch, capsys):
    args = ["train", CONFIG, f"output_dir={tmp_path / 'run'}", *SMALL]
    assert main([*args, "task.options.environment=no-such-taskset"]) == 2
    assert "no-such-taskset" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if never installed
    assert main(args) == 2
    assert '".[verifiers]"' in capsys.readouterr().err


def test_an_episode_is_the_gateway_call_token_exact_and_the_rubric_score(in_repo, tiny_policy):
    from asyncrl.engine import TorchEngine
    from asyncrl.rollout.client import LLMClient
    from asyncrl.rollout.gateway import Gateway, hermes
    from asyncrl.rollout.workflows import run_episode
    from asyncrl.rollout.workflows.openai_agent import OpenAIAgentWorkflow
    from asyncrl.tasks.verifiers_env import run
    from asyncrl.types import SamplingParams

    model, tokenizer = tiny_policy
    task = load_tasks("verifiers", seed=0, num_train=3, num_validation=16, options={"environment": ENV}).train[2]

    async def main_():
        spy = SpyEngine(TorchEngine(model, max_batch_size=4, seed=0))
        gateway = Gateway(tokenizer, hermes, model_name="tiny")
        await gateway.start()
        try:
            return spy, await run_episode(OpenAIAgentWorkflow(run, gateway), task,
                                          lambda: LLMClient(spy, tokenizer, SamplingParams(max_tokens=4)),
                                          timeout_s=60, max_retries=0)
        finally:
            await gateway.stop()
            await spy.engine.shutdown()

    spy, episode = asyncio.run(main_())
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
def test_the_example_trains_on_the_rubrics_scores(in_repo, tmp_path):
    out = tmp_path / "run"
    assert main(["train", CONFIG, f"output_dir={out}", *SMALL]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 4 and not (out / "errors.jsonl").read_text().strip()
    assert all(s["reward"] == rubric(s["task_id"], s["response"]) for s in samples)
    assert any(s["reward"] == 1.0 for s in samples)  # the shipped addition policy gets some right
