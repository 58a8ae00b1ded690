"""Agent diagnostics: the record a multi-turn workflow and a gateway session keep per
episode, its per-step means in ``metrics.jsonl``, the conversation in ``samples.jsonl``,
and the report's agent figure."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_gateway import CALL_TEXT, TOOLS, ScriptedFirstReply, sdk, serving

from asyncrl.rollout.client import LLMClient, Response
from asyncrl.orchestrator.buffer import ReadyGroup
from asyncrl.orchestrator.metrics import StepTimes, sample_rows, step_row
from asyncrl.tasks import Task
from asyncrl.types import AgentDiagnostics, Episode, Group, Step, Trajectory, is_tool_error
from asyncrl.rollout.workflows import MultiTurnWorkflow
from asyncrl.rollout.workflows.openai_agent import OpenAIAgentWorkflow

TASK = Task(id="t0", prompt="2+3=", data={"answer": 5})
TIMES = StepTimes(wall_s=2.0, waited_s=0.5, rollout_busy_s=1.0, elapsed_s=10.0)


class ScriptedLLM:
    """An LLMClient stand-in: reply i is ``replies[i]`` tokens long, all in one trajectory."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.trajectories = [Trajectory(prompt_ids=[0])]

    async def chat(self, messages, tools=None):
        t = self.trajectories[0]
        n = self.lengths[len(t.steps)]
        t.response_ids += [1] * n
        t.loss_mask += [1] * n
        t.logprobs += [0.0] * n
        t.versions += [0] * n
        t.steps.append(Step(list(messages), 1, n, "stop"))
        return Response(text=f"reply {len(t.steps)}", token_ids=[1] * n, finish_reason="stop")


class FlakyTool(MultiTurnWorkflow):
    """Answers each turn after 20 ms; the second answer is a failure; done after ``done_at`` turns."""

    def __init__(self, *, max_turns: int, done_at: int) -> None:
        super().__init__(max_turns=max_turns)
        self.done_at, self.answered = done_at, 0

    def initial_messages(self, task):
        return [{"role": "user", "content": task.prompt}]

    async def env_step(self, task, messages, response):
        await asyncio.sleep(0.02)
        self.answered += 1
        content = "search failed: timeout" if self.answered == 2 else "5"
        return [{"role": "tool", "content": content}], self.answered >= self.done_at

    async def reward(self, task, messages):
        return 1.0


def test_tool_error_convention():
    assert is_tool_error("search failed: HTTP 503") and is_tool_error("Error: bad arguments")
    assert is_tool_error("unknown tool or bad arguments: f") and is_tool_error("  error")
    assert not is_tool_error("5") and not is_tool_error("Errors are rare") and not is_tool_error(None)
    assert not is_tool_error("the launch failed: it is history, not a tool failure")


@pytest.mark.parametrize(("max_turns", "done_at", "turns", "tool_calls", "cut"), [
    (3, 99, 3, 3, True),  # the budget ran out while the environment still answered
    (5, 3, 3, 2, False),  # the environment ended it at turn 3: two answers the conversation went on with
])
def test_multi_turn_record(max_turns, done_at, turns, tool_calls, cut):
    llm = ScriptedLLM([4, 6, 8, 10, 12])
    episode = asyncio.run(FlakyTool(max_turns=max_turns, done_at=done_at).run(TASK, llm))
    record = AgentDiagnostics.from_dict(episode.metadata["agent"])
    assert (record.turns, record.tool_calls, record.tool_errors, record.cut_by_turn_limit) == (
        turns, tool_calls, 1, cut)
    assert record.model_tokens == 4 + 6 + 8 and record.tokens_per_turn == 6.0
    assert record.tool_latency_s >= 0.02 * turns  # every env_step timed, the last one too
    assert episode.metadata["agent"]["tokens_per_turn"] == 6.0
    group = Group("t0", [episode], advantages=[0.0])
    assert Group.from_dict(json.loads(json.dumps(group.to_dict()))) == group  # the checkpoint round trip


def _episode(record: AgentDiagnostics | None, reward: float = 0.0) -> Episode:
    t = Trajectory(prompt_ids=[0], response_ids=[5, 6, 7], loss_mask=[1, 0, 1], logprobs=[0.0] * 3,
                   versions=[0, -1, 0], reward=reward,
                   steps=[Step([{"role": "user", "content": "q"}], 1, 1, "stop"),
                          Step([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                {"role": "tool", "content": "x" * 5000, "tool_call_id": "c1"}], 3, 1, "stop")])
    metadata = {} if record is None else {"agent": record.to_dict()}
    return Episode(task_id="t", trajectories=[t], reward=reward, metadata=metadata)


def _step_row(groups: list[ReadyGroup]) -> dict:
    trajectories = [t for g in groups for t in g.trajectories]
    return step_row(1, 1, 0, groups, trajectories, {}, TIMES, [0.0], {}, {})


def test_step_row_means_only_where_episodes_carry_a_record():
    a = AgentDiagnostics(turns=2, tool_calls=1, tool_errors=1, tool_latency_s=0.5, model_tokens=10,
                         cut_by_turn_limit=False)
    b = AgentDiagnostics(turns=4, tool_calls=3, tool_errors=2, tool_latency_s=1.5, model_tokens=80,
                         cut_by_turn_limit=True)
    groups = [ReadyGroup(Group("t", [_episode(a), _episode(b)], [0.0, 0.0]), 0),
              ReadyGroup(Group("u", [_episode(None)], [0.0]), 1)]  # no record: not in the means
    row = _step_row(groups)
    assert row["agent/turns_mean"] == 3.0 and row["agent/tool_calls_mean"] == 2.0
    assert row["agent/tool_errors_total"] == 3 and row["agent/tool_latency_s_mean"] == 1.0
    assert row["agent/tokens_per_turn_mean"] == (5.0 + 20.0) / 2
    assert row["agent/cut_by_turn_limit_fraction"] == 0.5
    json.dumps(row)

    single_turn = _step_row([ReadyGroup(Group("u", [_episode(None)], [0.0]), 0)])
    assert not any(k.startswith("agent/") for k in single_turn)


def test_samples_keep_the_conversation_of_agent_episodes_only():
    record = AgentDiagnostics(2, 1, 0, 0.1, 2, False)
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)
    agent, plain = _episode(record), _episode(None)
    kept = _episode(record)
    kept.metadata["messages"] = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "final"},
                                 {"role": "tool", "content": "5"}]
    rows = sample_rows(1, 0, [ReadyGroup(Group("t", [agent, plain, kept], [0.0] * 3), 0)], decode)
    conversation = rows[0]["conversation"]
    # the last call's messages, then its reply decoded from the last response token
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant"]
    assert conversation[-1]["content"] == decode([7]) and conversation[2]["tool_call_id"] == "c1"
    assert len(conversation[2]["content"]) < 2100 and conversation[2]["content"].endswith("3000 characters cut]")
    assert "conversation" not in rows[1]
    assert rows[2]["conversation"] == kept.metadata["messages"]  # the workflow's own record, env's last answer too


def test_a_gateway_session_measures_the_agents_time_between_calls(tiny_policy):
    model, tokenizer = tiny_policy
    pause = 0.3

    async def agent(task, base_url):
        client = sdk(base_url)
        messages = [{"role": "user", "content": task.prompt}]
        first = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        await asyncio.sleep(pause)  # the agent runs its tool
        messages.append(first.choices[0].message.model_dump())
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "Error: add is down"})
        await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        return 1.0

    async def main():
        async with serving(model, tokenizer) as (gateway, engine, sampling):
            llm = LLMClient(ScriptedFirstReply(engine, tokenizer, CALL_TEXT), tokenizer, sampling)
            episode = await OpenAIAgentWorkflow(agent, gateway).run(TASK, llm)
            return episode, dict(gateway.counts)

    episode, counts = asyncio.run(main())
    record = AgentDiagnostics.from_dict(episode.metadata["agent"])
    assert record.turns == 2 and record.tool_calls >= 1
    assert record.tool_latency_s >= pause
    # the failed tool result, and the second reply's tool call if the random model broke one
    assert record.tool_errors == 1 + counts["tool_parse_errors"]
    assert record.model_tokens == sum(t.num_model_tokens for t in episode.trajectories)
    assert record.cut_by_turn_limit == (record.tool_calls > 1)  # the agent stopped after the second reply
    assert Episode.from_json(episode.to_json()) == episode


def test_report_shows_the_agent_panel_only_when_logged(tmp_path):
    pytest.importorskip("matplotlib")
    from asyncrl.report import load_run, summarize, write_report

    def run_dir(name, extra):
        root = tmp_path / name
        root.mkdir()
        (root / "config.yaml").write_text("mode: async\nmax_staleness: 1\n")
        rows = [{"step": s, "version": s, "reward/mean": 0.1 * s, "time/elapsed": float(s), **extra(s)}
                for s in (1, 2, 3)]
        (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for log in ("samples.jsonl", "timeline.jsonl"):
            (root / log).write_text("")
        return root

    agent = run_dir("agent", lambda s: {
        "agent/turns_mean": 2.0 + s, "agent/tool_calls_mean": 1.0 + s, "agent/tool_errors_total": s,
        "agent/tool_latency_s_mean": 0.1 * s, "agent/tokens_per_turn_mean": 20.0,
        "agent/cut_by_turn_limit_fraction": 0.25})
    page = write_report(agent).read_text()
    assert (agent / "report_agent.png").is_file() and "report_agent.png" in page
    summary = summarize(load_run(agent))
    assert summary["agent: mean turns per episode"] == 4.0 and summary["agent: tool errors (trained steps)"] == 6

    plain = run_dir("plain", lambda s: {})
    page = write_report(plain).read_text()
    assert not (plain / "report_agent.png").exists() and "report_agent" not in page
    assert not any(k.startswith("agent") for k in summarize(load_run(plain)))
