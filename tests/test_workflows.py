"""Workflows and the runner that contains their failures."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from asyncrl.rollout.client import LLMClient, Message, Response
from asyncrl.engine import TorchEngine
from asyncrl.rollout.eval_scoring import evaluate, pass_at_k
from asyncrl.tasks import Task, arithmetic_reward, generate_arithmetic
from asyncrl.types import Episode, SamplingParams
from asyncrl.rollout.workflows import MultiTurnWorkflow, SingleTurnWorkflow, run_episode

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0)
TASK = Task(id="t0", prompt="2+3=", data={"answer": 5})


def run(tiny_policy, coro_fn, sampling=SAMPLING):
    model, tokenizer = tiny_policy

    async def main():
        engine = TorchEngine(model, max_batch_size=8)
        try:
            return await coro_fn(lambda: LLMClient(engine, tokenizer, sampling), engine, tokenizer)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_single_turn_scores_and_stamps_reward(tiny_policy):
    calls = []

    def reward(task, text):
        calls.append((task.id, text))
        return 0.75

    async def go(make_client, *_):
        return await run_episode(SingleTurnWorkflow(reward), TASK, make_client, timeout_s=30, max_retries=0)

    episode = run(tiny_policy, go)
    assert episode.status == "ok" and episode.reward == 0.75 and episode.attempts == 1
    assert calls == [("t0", episode.metadata["response"])]
    assert [t.reward for t in episode.trajectories] == [0.75]
    assert Episode.from_json(episode.to_json()) == episode  # JSON lines round-trip


class Raising:
    def __init__(self):
        self.attempts = 0

    async def run(self, task, llm):
        self.attempts += 1
        raise ZeroDivisionError("workflow bug")


class Hanging:
    async def run(self, task, llm):
        await asyncio.sleep(3600)


class Flaky:
    def __init__(self):
        self.attempts = 0

    async def run(self, task, llm):
        self.attempts += 1
        if self.attempts == 1:
            raise ConnectionError("transient")
        return Episode(task_id=task.id, reward=1.0)


def test_raising_workflow_becomes_error_episode_after_retries(tiny_policy):
    workflow = Raising()

    async def go(make_client, *_):
        return await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=2)

    episode = run(tiny_policy, go)
    assert episode.status == "error" and episode.finish_reason == "error"
    assert workflow.attempts == 3 and episode.attempts == 3
    assert "ZeroDivisionError: workflow bug" in episode.error and "Traceback" in episode.error
    assert episode.reward == 0.0


def test_hanging_workflow_times_out(tiny_policy):
    async def go(make_client, *_):
        start = time.perf_counter()
        episode = await run_episode(Hanging(), TASK, make_client, timeout_s=0.2, max_retries=1)
        return episode, time.perf_counter() - start

    episode, elapsed = run(tiny_policy, go)
    assert episode.status == "error" and "timed out" in episode.error and episode.attempts == 2
    assert elapsed < 30  # two 0.2 s timeouts (~0.4 s); generous for a loaded machine, far under the hour it hangs


def test_flaky_workflow_succeeds_on_retry(tiny_policy):
    workflow = Flaky()

    async def go(make_client, *_):
        return await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=1)

    episode = run(tiny_policy, go)
    assert episode.status == "ok" and episode.attempts == 2 and episode.reward == 1.0


def test_hanging_reward_function_does_not_block_the_loop(tiny_policy):
    def stuck_reward(task, text):
        time.sleep(60)  # abandoned on its thread; long enough that the bound below tells it was not awaited
        return 1.0

    async def go(make_client, *_):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        start = time.perf_counter()
        workflow = SingleTurnWorkflow(stuck_reward, reward_timeout_s=0.3)
        episode = await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=0)
        tick.cancel()
        return episode, time.perf_counter() - start, ticks

    episode, elapsed, ticks = run(tiny_policy, go)
    assert episode.status == "error" and "TimeoutError" in episode.error
    # 0.3 s of timeout; the bound is generous for a loaded machine and still far under the 60 s sleep
    assert elapsed < 30 and ticks > 5  # the event loop kept running while the reward hung


@pytest.mark.parametrize("bad", [None, "1.0", True])
def test_reward_function_must_return_a_number(tiny_policy, bad):
    async def go(make_client, *_):
        workflow = SingleTurnWorkflow(lambda task, text: bad)
        return await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=0)

    episode = run(tiny_policy, go)
    assert episode.status == "error" and "expected a float" in episode.error


def test_a_nan_reward_is_passed_on_for_the_orchestrator_to_stop_the_run(tiny_policy):
    """Not an episode error to retry: the same input gives NaN again (tests/test_finite.py)."""
    async def go(make_client, *_):
        workflow = SingleTurnWorkflow(lambda task, text: float("nan"))
        return await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=0)

    episode = run(tiny_policy, go)
    assert episode.status == "ok" and math.isnan(episode.reward)


class CalculatorWorkflow(MultiTurnWorkflow):
    """The model talks; a 'calculator' tool answers each turn with a fixed result."""

    tools = [{"name": "calc"}]

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.prompt}]

    async def env_step(self, task, messages, response: Response):
        return [{"role": "tool", "content": "5"}], False

    async def reward(self, task, messages):
        return float(sum(m["role"] == "assistant" for m in messages))


def test_multi_turn_workflow_respects_turn_limit_and_masks_tools(tiny_policy):
    async def go(make_client, *_):
        return await run_episode(CalculatorWorkflow(max_turns=3), TASK, make_client, timeout_s=30, max_retries=0)

    # Every id is a stop id: each reply is one token that ends the turn ("stop").
    one_token_replies = SamplingParams(max_tokens=6, stop_token_ids=tuple(range(261)))
    episode = run(tiny_policy, go, one_token_replies)
    assert episode.status == "ok" and episode.reward == 3.0
    (traj,) = episode.trajectories
    assert len(traj.steps) == 3 and episode.metadata["turns"] == 3
    assert 0 in traj.loss_mask and 1 in traj.loss_mask
    roles = [m["role"] for m in episode.metadata["messages"]]
    # the environment also answers the last turn (its result may decide the reward)
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool"]

    truncated = run(tiny_policy, go)  # a reply cut at max_tokens ends the episode
    assert truncated.metadata["turns"] == 1 and truncated.finish_reason == "length"


def test_evaluate_counts_errors_and_scores(tiny_policy):
    tasks = generate_arithmetic(3, seed=0)

    def reward(task, text):
        if task.id == tasks[0].id:
            raise ValueError("bad row")
        return arithmetic_reward(task, text)

    async def go(make_client, engine, tokenizer):
        workflow = SingleTurnWorkflow(reward)
        return await evaluate(lambda task: run_episode(workflow, task, make_client, timeout_s=30, max_retries=0),
                              tasks, samples_per_task=2, max_concurrent=4)

    result = run(tiny_policy, go)
    assert result.num_errors == 2 and len(result.episodes) == 6
    assert set(result.pass_at) == {1, 2}


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)


# ------------------------------------------------------- user workflow classes: the constructor contract

WORKFLOW_FILE = '''
from asyncrl.types import Episode
from asyncrl.rollout.workflows import MultiTurnWorkflow


class WithContext:
    def __init__(self, ctx, *, max_turns=4, label="none"):
        self.ctx, self.max_turns, self.label = ctx, max_turns, label

    async def run(self, task, llm):
        return Episode(task_id=task.id)


class NoArguments:
    async def run(self, task, llm):
        return Episode(task_id=task.id)


class Inherited(MultiTurnWorkflow):  # MultiTurnWorkflow.__init__(self, *, max_turns=4)
    def initial_messages(self, task):
        return [{"role": "user", "content": task.prompt}]

    async def env_step(self, task, messages, response):
        return [], True

    async def reward(self, task, messages):
        return 0.0


class Refusing:
    def __init__(self, ctx, *, level=1):
        if level > 3:
            raise ValueError(f"level must be at most 3, got {level}")
'''


@pytest.fixture
def workflow_file(tmp_path):
    path = tmp_path / "my_workflows.py"
    path.write_text(WORKFLOW_FILE)
    return path


def workflow_config(spec, **options):
    from asyncrl.config import load_config

    return load_config(None, ["task.name=arithmetic", "task.reward_fn=asyncrl.tasks.arithmetic:arithmetic_reward",
                              "workflow.timeout_s=7.5", f"workflow.name={spec}",
                              *(f"workflow.options.{k}={v}" for k, v in options.items())])


def test_a_workflow_class_gets_the_context_and_its_options(workflow_file):
    from asyncrl.rollout.workflows.registry import build_workflow

    workflow = build_workflow(workflow_config(f"{workflow_file}:WithContext", max_turns=3, label="retry"))
    assert (workflow.max_turns, workflow.label) == (3, "retry")
    assert workflow.ctx.reward_fn is arithmetic_reward  # resolved from task.reward_fn
    assert (workflow.ctx.reward_timeout_s, workflow.ctx.use_chat_template) == (7.5, True)
    assert build_workflow(workflow_config(f"{workflow_file}:WithContext")).max_turns == 4  # its own default


def test_classes_without_a_context_still_build(workflow_file):
    from asyncrl.rollout.workflows.registry import build_workflow

    assert type(build_workflow(workflow_config(f"{workflow_file}:NoArguments"))).__name__ == "NoArguments"
    assert build_workflow(workflow_config(f"{workflow_file}:Inherited", max_turns=2)).max_turns == 2


@pytest.mark.parametrize("cls, options, fragments", [
    ("WithContext", {"max_turn": 3}, ["unexpected keyword argument 'max_turn'", "did you mean 'max_turns'?",
                                     "Class(ctx, **options)"]),
    ("NoArguments", {"max_turns": 3}, ["unexpected keyword argument 'max_turns'"]),
    ("Inherited", {"turns": 3}, ["unexpected keyword argument 'turns'"]),
    ("Refusing", {"level": 5}, ["level must be at most 3, got 5"]),  # the class's own ValueError
])
def test_a_constructor_that_does_not_fit_exits_2_naming_workflow_name(
        tmp_path, policy_dir, workflow_file, capsys, cls, options, fragments):
    from asyncrl.cli import main

    args = ["train", "examples/countdown/async.yaml", f"model.path={policy_dir}", f"output_dir={tmp_path / 'run'}",
            "task.num_train=8", "task.num_validation=4", f"workflow.name={workflow_file}:{cls}",
            *(f"workflow.options.{k}={v}" for k, v in options.items())]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"workflow.name '{workflow_file}:{cls}'" in err
    assert all(fragment in err for fragment in fragments), err


def test_single_turn_takes_no_options():
    from asyncrl.config import ConfigError
    from asyncrl.rollout.workflows.registry import build_workflow

    with pytest.raises(ConfigError, match=r"workflow.options \{'max_turns': 2\}: workflow 'single_turn'"):
        build_workflow(workflow_config("single_turn", max_turns=2))


# ------------------------------------------------------- the retry example and what samples.jsonl shows of it

def load_retry_workflow():
    from asyncrl.plugins import load_named

    return load_named("examples/retry/workflow.py:RetryWorkflow", key="workflow.name")


def test_retry_workflow_gives_feedback_and_discounts_a_later_solve(tiny_policy):
    from asyncrl.orchestrator.buffer import ReadyGroup
    from asyncrl.orchestrator.metrics import sample_rows
    from asyncrl.types import Group
    from asyncrl.rollout.workflows import WorkflowContext

    scores = iter([0.0, 1.0, 1.0])  # turn 1 wrong, turn 2 right, then reward() scores turn 2 again
    ctx = WorkflowContext(reward_fn=lambda task, text: next(scores), reward_timeout_s=10, use_chat_template=True)
    workflow = load_retry_workflow()(ctx, max_turns=3, discount=0.5)

    async def go(make_client, *_):
        return await run_episode(workflow, TASK, make_client, timeout_s=30, max_retries=0)

    one_token_replies = SamplingParams(max_tokens=6, stop_token_ids=tuple(range(261)))
    episode = run(tiny_policy, go, one_token_replies)
    assert episode.status == "ok" and episode.reward == 0.5  # solved on turn 2: 0.5 ** 1
    messages = episode.metadata["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == "wrong, try again: 2+3="
    assert episode.metadata["turns"] == 2

    (trajectory,) = episode.trajectories
    _, tokenizer = tiny_policy
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # what the trainer passes
    (row,) = sample_rows(1, 0, [ReadyGroup(Group(TASK.id, [episode], advantages=[0.0]), 0)], decode)
    segments = row["response_segments"]
    assert [s["role"] for s in segments] == ["model", "environment", "model"]
    assert "".join(s["text"] for s in segments) == row["response"] == decode(trajectory.response_ids)
    # the environment's part is exactly the feedback turn the template renders, special tokens dropped
    assert segments[1]["text"] == "\nuser\nwrong, try again: 2+3=\nassistant\n"
    assert [s["tokens"] for s in segments] == [1, trajectory.loss_mask.count(0), 1]
    assert segments[0]["text"] == decode(trajectory.response_ids[:1])


def test_retry_workflow_refuses_a_bad_configuration():
    from asyncrl.rollout.workflows import WorkflowContext

    retry = load_retry_workflow()
    with pytest.raises(ValueError, match="set task.reward_fn"):
        retry(WorkflowContext(reward_fn=None, reward_timeout_s=1, use_chat_template=True))
    ctx = WorkflowContext(reward_fn=arithmetic_reward, reward_timeout_s=1, use_chat_template=True)
    with pytest.raises(ValueError, match="discount"):
        retry(ctx, discount=0)
    with pytest.raises(ValueError, match="not a template"):
        retry(ctx, feedback="try {again}")


def test_segments_follow_the_loss_mask_and_join_to_the_response():
    from asyncrl.orchestrator.buffer import ReadyGroup
    from asyncrl.orchestrator.metrics import sample_rows
    from asyncrl.types import Group, Trajectory

    # A SentencePiece-like decode: pieces carry their leading space, which is dropped at
    # the start of a string; decoding each run alone would lose the space before "wrong".
    vocab = {1: "▁6*3", 2: "+4", 3: "▁wrong", 4: ",▁again", 5: "▁22"}
    decode = lambda ids: "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")
    trajectory = Trajectory(prompt_ids=[9], response_ids=[1, 2, 3, 4, 5], loss_mask=[1, 1, 0, 0, 1],
                            logprobs=[-1.0, -1.0, 0.0, 0.0, -1.0], versions=[0, 0, -1, -1, 0])
    group = Group("t", [Episode(task_id="t", trajectories=[trajectory])], advantages=[0.0])
    (row,) = sample_rows(1, 0, [ReadyGroup(group, 0)], decode)
    assert row["response"] == "6*3+4 wrong, again 22"
    assert row["response_segments"] == [
        {"role": "model", "text": "6*3+4", "tokens": 2},
        {"role": "environment", "text": " wrong, again", "tokens": 2},
        {"role": "model", "text": " 22", "tokens": 1},
    ]
    assert row["response_tokens"] == 3
    empty = Group("t", [Episode(task_id="t", trajectories=[Trajectory(prompt_ids=[9])])], advantages=[0.0])
    (row,) = sample_rows(1, 0, [ReadyGroup(empty, 0)], decode)
    assert (row["response"], row["response_segments"]) == ("", [])
