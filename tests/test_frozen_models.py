"""Frozen models by URL: the client's bound, deadline, retries and named failures; the judge's
prompt and grade; vLLM's prompt_logprobs read back; a local reward model batched."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from asyncrl.frozen.client import FrozenModel, FrozenModelError
from asyncrl.frozen.judge import JudgeParseError, JudgeReward, RewardModel, parse_grade, render_prompt
from asyncrl.tasks.base import Task

TASK = Task(id="t1", prompt="What is 2+3?", data={"answer": "5"})


@asynccontextmanager
async def fake_server(handler):
    """An OpenAI-compatible stub on a free loopback port, stopped on the way out."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def chat_reply(text: str) -> web.Response:
    return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})


def replying(text: str):
    async def handler(request: web.Request) -> web.Response:
        return chat_reply(text)
    return handler


def test_render_prompt_fills_the_task_and_names_a_missing_field():
    text = render_prompt("Q: {prompt} A: {response} expected {answer}", TASK, "5")
    assert text == "Q: What is 2+3? A: 5 expected 5"
    with pytest.raises(KeyError, match="'rubric'.*lacks"):
        render_prompt("{rubric}", TASK, "5")


def test_parse_grade_takes_the_last_match_and_scales():
    assert parse_grade("GRADE: 3 ... no wait, GRADE: 7", r"GRADE:\s*(\d+)", 10) == 0.7
    with pytest.raises(ValueError, match="no grade"):
        parse_grade("looks fine to me", r"GRADE:\s*(\d+)", 10)


def test_a_judge_grades_within_its_concurrency_bound():
    in_flight, most, seen = [0], [0], []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.05)
        in_flight[0] -= 1
        grade = 10 if "A: 5" in body["messages"][0]["content"] else 2
        return chat_reply(f"GRADE: {grade}")

    async def main():
        async with fake_server(handler) as url:
            judge = JudgeReward(FrozenModel("judge", url, model="m", max_concurrency=2),
                                prompt="Q: {prompt} A: {response}")
            grades = await asyncio.gather(*(judge(TASK, r) for r in ["5", "6", "5", "7", "5", "5"]))
            await judge.model.close()
            return grades, judge.model.stats

    grades, stats = asyncio.run(main())
    assert grades == [1.0, 0.2, 1.0, 0.2, 1.0, 1.0]
    assert most[0] == 2
    assert stats.calls == 6 and stats.failures == 0 and stats.seconds > 0
    assert seen[0]["model"] == "m" and seen[0]["temperature"] == 0.0


def test_a_judge_that_is_down_is_named_after_its_retries():
    async def main():
        async with fake_server(replying("")) as url:
            pass  # the server is gone: its port refuses
        judge = JudgeReward(FrozenModel("judge", url, model="m", retries=2, backoff_s=0.01, timeout_s=5))
        try:
            with pytest.raises(FrozenModelError, match=rf"the judge at {url}: POST .* failed after 3 tries"):
                await judge(TASK, "5")
        finally:
            await judge.model.close()
        return judge.model.stats

    stats = asyncio.run(main())
    assert stats.failures == 1


def test_a_slow_judge_meets_its_deadline_and_a_4xx_is_not_retried():
    calls = {"slow": 0, "bad": 0}

    async def handler(request: web.Request) -> web.Response:
        if request.path.startswith("/slow"):
            calls["slow"] += 1
            await asyncio.sleep(5)
            return chat_reply("GRADE: 1")
        calls["bad"] += 1
        return web.json_response({"error": {"message": "no such model"}}, status=404)

    async def main():
        async with fake_server(handler) as url:
            slow = FrozenModel("judge", url + "/slow", model="m", timeout_s=0.2, retries=1, backoff_s=0.01)
            with pytest.raises(FrozenModelError, match=r"failed after 2 tries .*no answer within 0.2 s"):
                await slow.chat([{"role": "user", "content": "x"}])
            bad = FrozenModel("judge", url + "/bad", model="m", retries=3)
            with pytest.raises(FrozenModelError, match="HTTP 404.*no such model"):
                await bad.chat([{"role": "user", "content": "x"}])
            await slow.close()
            await bad.close()

    asyncio.run(main())
    # the 4xx was asked once; the slow route's tries are counted by the error above (a try that times
    # out before the loaded server's handler starts never reaches its counter)
    assert calls["bad"] == 1 and calls["slow"] >= 1


def test_an_unreadable_grade_fails_the_episode_naming_the_judge():
    async def main():
        async with fake_server(replying("I think it is good")) as url:
            judge = JudgeReward(FrozenModel("judge", url, model="m"))
            try:
                with pytest.raises(JudgeParseError, match=r"judge at .* for task t1: no grade"):
                    await judge(TASK, "5")
            finally:
                await judge.model.close()

    asyncio.run(main())


def test_the_model_name_comes_from_the_server_when_unset():
    async def handler(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "served-judge"}]})
        body = await request.json()
        return chat_reply(f"GRADE: {10 if body['model'] == 'served-judge' else 0}")

    async def main():
        async with fake_server(handler) as url:
            judge = JudgeReward(FrozenModel("judge", url + "/v1/"))
            try:
                return await judge(TASK, "5")
            finally:
                await judge.model.close()

    assert asyncio.run(main()) == 1.0


def test_token_logprobs_read_vllms_prompt_logprobs():
    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
        choices = []
        for index, ids in enumerate(body["prompt"]):
            rows = [None] + [{str(t): {"logprob": -0.5 * t, "rank": 1, "decoded_token": "x"}} for t in ids[1:]]
            choices.append({"index": index, "text": "", "prompt_logprobs": rows})
        return web.Response(text=json.dumps({"choices": choices[::-1]}), content_type="application/json")

    async def main():
        async with fake_server(handler) as url:
            teacher = FrozenModel("teacher", url, model="m")
            try:
                return await teacher.token_logprobs([[5, 1, 2], [7, 4]])
            finally:
                await teacher.close()

    assert asyncio.run(main()) == [[-0.5, -1.0], [-2.0]]


def test_a_reward_model_scores_a_batch_as_it_scores_one(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    tiny = Path(__file__).resolve().parents[1] / "models" / "addition-tiny"
    config = transformers.AutoConfig.from_pretrained(tiny)
    config.num_labels = 1
    transformers.set_seed(0)
    net = transformers.AutoModelForSequenceClassification.from_config(config)
    net.config.pad_token_id = 0
    net.save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(tiny).save_pretrained(tmp_path)
    model = RewardModel(str(tmp_path), batch_size=4)
    responses = ["5", "12", "7", "19", "3"]

    async def together():
        return await asyncio.gather(*(model(TASK, r) for r in responses))

    batched = asyncio.run(together())
    alone = [model.score_texts([TASK.prompt + r])[0] for r in responses]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len(set(round(x, 6) for x in batched)) > 1  # the responses score differently


def test_distill_advantages_by_hand():
    import torch

    from asyncrl.algorithms.distill import distill_advantages, reverse_kl

    adv = torch.tensor([1.0, 0.0])
    mu = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
    tau = torch.tensor([[-1.5, -1.0, -9.0], [-0.2, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = distill_advantages(adv, mu, tau, mask, coef=0.5)
    # row 0: 1 - 0.5*(-1+1.5)=0.75; 1 - 0.5*(-2+1)=1.5; masked 0.  row 1: 0 - 0 = 0; 0 - 0.5*(-3+1)=1.0; 0
    assert out.tolist() == [[0.75, 1.5, 0.0], [0.0, 1.0, 0.0]]
    # mean of μ−τ over the four model tokens: (0.5 - 1 + 0 - 2) / 4
    assert reverse_kl(mu, tau, mask).item() == pytest.approx(-0.625)
    nan_mu = mu.clone()
    nan_mu[0, 2] = float("nan")  # a masked position's value never leaks in
    assert distill_advantages(adv, nan_mu, tau, mask, coef=0.5).tolist() == out.tolist()


def test_a_teacher_scores_each_response_token_and_refuses_another_tokenizer():
    from asyncrl.frozen.teacher import TokenizerMismatch, check_tokenizer, score_group
    from asyncrl.types import Trajectory

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        if request.path == "/tokenize":
            tokens = [ord(c) for c in body["prompt"]]
            return web.json_response({"tokens": tokens[:3] if "fox" in body["prompt"] else tokens})
        choices = [{"index": i, "prompt_logprobs": [None] + [{str(t): {"logprob": -float(t)}} for t in ids[1:]]}
                   for i, ids in enumerate(body["prompt"])]
        return web.json_response({"choices": choices})

    class CharTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    trajectories = [Trajectory(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 0, 1], logprobs=[0.0] * 3,
                               versions=[0] * 3),
                    Trajectory(prompt_ids=[9], response_ids=[7], loss_mask=[1], logprobs=[0.0], versions=[0])]

    async def main():
        async with fake_server(handler) as url:
            teacher = FrozenModel("teacher", url, model="m")
            try:
                await score_group(teacher, trajectories)
                with pytest.raises(TokenizerMismatch, match=r"teacher 'm' at .* tokenizes 'The quick.*student tiny"):
                    await check_tokenizer(teacher, CharTokenizer(), "tiny")
            finally:
                await teacher.close()

    asyncio.run(main())
    assert trajectories[0].teacher_logprobs == [-3.0, -4.0, -5.0]
    assert trajectories[1].teacher_logprobs == [-7.0]


def test_pack_batch_carries_the_distillation_term_on_model_tokens_only():
    import torch

    from asyncrl.learner.batch import pack_batch
    from asyncrl.orchestrator.metrics import distill_metrics
    from asyncrl.types import Trajectory

    a = Trajectory(prompt_ids=[2], response_ids=[3, 4], loss_mask=[1, 0], logprobs=[-1.0, -5.0], versions=[0, 0],
                   teacher_logprobs=[-0.5, -9.0])
    b = Trajectory(prompt_ids=[1], response_ids=[5, 6, 7], loss_mask=[1, 1, 1], logprobs=[-2.0, -1.0, -1.0],
                   versions=[0, 0, 0], teacher_logprobs=[-2.0, -3.0, -1.0])
    plain = pack_batch([a, b], [1.0, -1.0], pad_id=0)
    assert plain.advantages.tolist() == [1.0, -1.0]
    batch = pack_batch([a, b], [1.0, -1.0], pad_id=0, distill_coef=2.0)
    # target axis (length 4 - 1 = 3): a's response at positions 0, 1 (mask 1, 0), then padding; b's at 0, 1, 2
    assert batch.advantages.tolist() == [[1.0 - 2.0 * (-1.0 + 0.5), 0.0, 0.0],
                                         [-1.0, -1.0 - 2.0 * (-1.0 + 3.0), -1.0]]
    assert batch.slice(0, 1).advantages.shape == (1, 2)  # trimmed with the row's own length
    assert distill_metrics([a, b])["distill/reverse_kl"] == pytest.approx((-0.5 + 0.0 + 2.0 + 0.0) / 4)
    with pytest.raises(ValueError, match="no teacher logprobs"):
        pack_batch([Trajectory(prompt_ids=[1], response_ids=[2], loss_mask=[1], logprobs=[0.0], versions=[0])],
                   [0.0], pad_id=0, distill_coef=1.0)
    assert torch.equal(pack_batch([a], [1.0], 0, 0.0).advantages, torch.tensor([1.0]))


# ------------------------------------------- the teacher's scores against its own sampling
ADDITION_POLICY = Path(__file__).resolve().parents[1] / "models" / "addition-tiny"


class OffByOne:
    """A scoring route with a bug a server can have: each token's score is its successor's (the
    logprobs placed one position off). Its sampling is the engine's own."""

    @staticmethod
    def wrap(server):
        score = server._score

        async def shifted(prompt):
            reply = await score(prompt)
            for choice in reply["choices"]:
                rows = choice["prompt_logprobs"]
                values = [next(iter(r.values())) for r in rows[1:]]
                values = values[1:] + values[:1]
                choice["prompt_logprobs"] = [None, *({t: v} for t, v in zip((next(iter(r)) for r in rows[1:]),
                                                                                values))]
            return reply

        server._score = shifted
        return server


class TeacherOnThread:
    """``asyncrl serve-engine``'s server (``EngineServer`` over a ``TorchEngine``) on the shipped
    addition policy, on a free loopback port, in a thread and loop of its own (the code under
    test may block its caller's thread); ``perturb`` edits the server before it starts."""

    def __init__(self, perturb=None) -> None:
        import threading

        self.perturb, self.ready, self.url = perturb, threading.Event(), None
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncrl.config import EngineServerConfig
        from asyncrl.engine.torch_engine import TorchEngine
        from asyncrl.rollout.engine_server import EngineServer

        self.loop = asyncio.new_event_loop()
        model = AutoModelForCausalLM.from_pretrained(ADDITION_POLICY, torch_dtype=torch.float32).eval()
        self.server = EngineServer(TorchEngine(model, seed=0), model_name="addition-teacher",
                                   settings=EngineServerConfig(port=0),
                                   tokenizer=AutoTokenizer.from_pretrained(ADDITION_POLICY))
        if self.perturb is not None:
            self.perturb(self.server)
        self.url = self.loop.run_until_complete(self.server.start())
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self) -> TeacherOnThread:
        self.thread.start()
        assert self.ready.wait(120), "the teacher server did not start"
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            await self.server.stop()
            await self.server.engine.shutdown()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


def _teacher_check(url: str):
    from transformers import AutoTokenizer

    from asyncrl.frozen.teacher import check_logprobs, probe_prompts

    async def main():
        teacher = FrozenModel("teacher", url)
        try:
            return await check_logprobs(teacher, probe_prompts(AutoTokenizer.from_pretrained(ADDITION_POLICY)))
        finally:
            await teacher.close()

    return asyncio.run(main())


def test_a_served_teachers_scores_match_its_sampling_and_scores_one_position_off_do_not():
    from asyncrl.frozen.teacher import CHECK_TOKENS, PROBE_TEXTS

    with TeacherOnThread() as honest:
        found = _teacher_check(honest.url)
    # one forward pass batched two ways, in float32 (measured here: ~1e-6)
    assert found.tokens == CHECK_TOKENS * len(PROBE_TEXTS) and 0 <= found.max_abs_diff <= 1e-4
    with TeacherOnThread(OffByOne.wrap) as shifted:
        found = _teacher_check(shifted.url)
    assert found.max_abs_diff > 0.5  # beyond the default teacher.check_tolerance


def test_a_teacher_that_answers_without_its_sampled_logprobs_is_named():
    from asyncrl.frozen.teacher import sample_with_logprobs

    async def main():
        async with fake_server(replying("")) as url:  # a chat reply: no logprobs at all
            teacher = FrozenModel("teacher", url, model="m")
            try:
                with pytest.raises(FrozenModelError, match=r"teacher at .* without its sampled tokens' logprobs"):
                    await sample_with_logprobs(teacher, [1, 2], seed=0)
            finally:
                await teacher.close()

    asyncio.run(main())


def test_preflight_says_a_teacher_whose_scores_are_not_its_sampling_and_returns_the_figure(capsys):
    from transformers import AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.orchestrator.preflight import check_teacher

    tokenizer = AutoTokenizer.from_pretrained(ADDITION_POLICY)
    config = str(ADDITION_POLICY.parents[1] / "examples/addition/async.yaml")
    with TeacherOnThread() as honest:
        found = check_teacher(load_config(config, [f"teacher.url={honest.url}"]), tokenizer)
    assert found.max_abs_diff <= 1e-4 and "FAIL" not in capsys.readouterr().err
    assert found.row() == {"teacher/logprob_check_max_abs_diff": found.max_abs_diff,
                           "teacher/logprob_check_tokens": found.tokens}
    with TeacherOnThread(OffByOne.wrap) as shifted:
        found = check_teacher(load_config(config, [f"teacher.url={shifted.url}"]), tokenizer)
    err = capsys.readouterr().err
    assert found.max_abs_diff > 0.5
    assert f"asyncrl: FAIL teacher's scores match its sampling: the teacher at {shifted.url}:" in err
    assert f"differ by up to {found.max_abs_diff:.3g} (teacher.check_tolerance 0.5)" in err
    assert "--generation-config vllm" in err
