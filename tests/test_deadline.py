"""An episode's deadline counts the time it makes no progress: not its wait in the engine's
queue while the engine works, nor a reply whose tokens keep coming.

Run on the virtual clock (``asyncrl/plan/virtual_clock.py``): the fake engine's steps are
``asyncio.sleep``s, so every time below is simulated and exact, however loaded the machine.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncrl.engine.scheduler import QueueState
from asyncrl.plan.virtual_clock import run_virtual
from asyncrl.rollout.client import LLMClient
from asyncrl.rollout.deadline import EpisodeDeadline
from asyncrl.rollout.workflows import run_episode
from asyncrl.tasks import Task
from asyncrl.types import AttemptError, Completion, Episode, SamplingParams

TIMEOUT_S = 10.0
TOKEN = 5


class OneRowEngine:
    """A streaming engine with one row: requests are served one at a time in the order they
    came, each ``tokens`` tokens ``step_s`` apart; the rest wait in its queue. ``hang_after``:
    the n-th request admitted (from 1) samples one token, and from then on the engine does
    nothing, ever (a stuck engine: its busy seconds stop growing)."""
    max_context = 1 << 30  # the engine contract's context: no bound that matters here

    def __init__(self, tokens: int = 4, step_s: float = 1.0, hang_after: int | None = None) -> None:
        self.tokens, self.step_s, self.hang_after = tokens, step_s, hang_after
        self.stats = SimpleNamespace(busy_s=0.0)
        self.row = asyncio.Lock()
        self.waiting = self.admitted = 0
        self.stopped = False

    async def generate(self, prompt_ids, sampling, on_tokens=None) -> Completion:
        self.waiting += 1
        async with self.row:
            if self.stopped:  # it admits nobody any more
                await asyncio.Event().wait()
            self.waiting -= 1
            self.admitted += 1
            ids = []
            for _ in range(self.tokens):
                await asyncio.sleep(self.step_s)
                self.stats.busy_s += self.step_s
                ids.append(TOKEN)
                if on_tokens is not None:
                    on_tokens([TOKEN])
                if self.admitted == self.hang_after:
                    self.stopped = True
                    await asyncio.Event().wait()
            return Completion(ids, [0.0] * len(ids), [0] * len(ids), "length")

    def queue_state(self) -> QueueState:
        return QueueState(self.waiting, 1, 0.0, False)


class Generate:
    """One completion, then ``then_s`` of its own work (a reward function, say); records the
    seconds its deadline did not count."""

    def __init__(self, then_s: float = 0.0) -> None:
        self.then_s, self.waited_s = then_s, []

    async def run(self, task: Task, llm: LLMClient) -> Episode:
        await llm.generate([1, 2, 3])
        await asyncio.sleep(self.then_s)
        self.waited_s.append(llm.deadline.waited_s)
        return Episode(task_id=task.id, trajectories=llm.trajectories, reward=1.0)


def episodes(engine, workflow, tokenizer, n: int) -> tuple[list[Episode], float]:
    sampling = SamplingParams(max_tokens=engine.tokens)

    async def main() -> list[Episode]:
        return list(await asyncio.gather(*[
            run_episode(workflow, Task(id=f"t{i}", prompt=""), lambda: LLMClient(engine, tokenizer, sampling),
                        timeout_s=TIMEOUT_S, max_retries=0) for i in range(n)]))

    return run_virtual(main())


def test_an_episode_queued_behind_others_does_not_time_out(char_tokenizer):
    workflow = Generate()
    # 20 episodes, each served for 4 s: the last waits 76 s in the queue, past its 10 s
    done, elapsed = episodes(OneRowEngine(), workflow, char_tokenizer, 20)
    assert [e.status for e in done] == ["ok"] * 20, [e.error for e in done if e.error]
    assert elapsed == 80.0
    assert max(workflow.waited_s) == 80.0  # not counted: 76 s in the queue, 4 s receiving its tokens


def test_an_episode_the_engine_stops_serving_times_out_and_says_what_it_waited_for(char_tokenizer):
    done, elapsed = episodes(OneRowEngine(hang_after=1), Generate(), char_tokenizer, 1)
    (episode,) = done
    assert episode.status == "error" and episode.errors[0].timed_out
    assert "EpisodeTimeout" in episode.errors[0].exception
    assert "waiting for the engine's reply to a request of 3 context tokens" in episode.error
    assert "admitted 19.0 s ago, 1 tokens sampled, the last 19.0 s ago, none since" in episode.error
    # its first token came at 1 s; the check at 10 s saw it, the one at 20 s saw nothing since: 10 s counted
    assert elapsed == 2 * TIMEOUT_S


def test_an_episode_queued_at_an_engine_that_does_nothing_times_out(char_tokenizer):
    """The first episode holds the only row and the engine stops; the second waits in the
    queue, where it would wait forever: it times out within two deadlines."""
    done, elapsed = episodes(OneRowEngine(hang_after=1), Generate(), char_tokenizer, 2)
    first, second = done
    assert first.errors[0].timed_out and second.errors[0].timed_out
    assert "waiting for the engine to admit a request of 3 context tokens" in second.error
    assert "while the engine did no work" in second.error
    assert "the engine's queue: 1 requests waiting for a row" in second.error
    assert elapsed == 2 * TIMEOUT_S  # the engine worked in the first interval (1 s), not in the second


def test_time_outside_the_engine_counts(char_tokenizer):
    """11 s of its own code after its reply: past a 10 s deadline, whatever it waited for
    the engine before."""
    workflow = Generate(then_s=11.0)
    done, _ = episodes(OneRowEngine(), workflow, char_tokenizer, 3)
    assert all(e.status == "error" and e.errors[0].timed_out for e in done)
    assert all("waiting for its own code, not an engine call" in e.error for e in done)


def test_the_clock_stops_for_an_engine_call_that_moves_and_runs_outside_it():
    """The deadline's accounting alone."""

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        async with EpisodeDeadline(TIMEOUT_S) as deadline:
            await asyncio.sleep(1.0)  # its own code: counted
            wait = deadline.engine_call(3, progress=loop.time)  # an engine at work: the queue moves
            await asyncio.sleep(25.0)  # queued: not counted, though over two deadlines long
            wait.on_tokens([TOKEN])
            await asyncio.sleep(2.0)  # served: not counted
            wait.close()
            await asyncio.sleep(3.0)  # its own code again
            deadline._settle(loop.time())
            return deadline.used_s, deadline.waited_s

    (used, waited), _ = run_virtual(main())
    assert (used, waited) == (4.0, 27.0)


def test_the_watchdog_says_episodes_failed_by_deadline_and_what_the_queue_held(char_tokenizer):
    from asyncrl.config import WatchdogConfig
    from asyncrl.orchestrator.watchdog import Watchdog

    done, _ = episodes(OneRowEngine(hang_after=1), Generate(), char_tokenizer, 2)
    failing = Episode("t9", status="error", errors=[AttemptError(1, "ValueError: bad reward", "Traceback ...")])
    dog = Watchdog(WatchdogConfig(window=3, max_error_rate=0.5))
    for episode in [failing, *done]:
        dog.episode(episode, "train")
    reason = dog.verdict()
    assert reason.startswith("3 of the last 3 episodes failed")
    assert "2 of them ran past their deadline, workflow.timeout_s" in reason
    report = dog.report(reason)
    assert "waiting for the engine to admit a request" in report  # the most recent one's own error
    assert "the engine's queue: 1 requests waiting for a row" in report


def test_the_built_in_engine_reports_its_queue(tiny_policy):
    """What a deadline error quotes: requests waiting for a row, running, paused."""
    from asyncrl.engine import TorchEngine

    model, _ = tiny_policy

    async def main():
        engine = TorchEngine(model, max_batch_size=2)
        try:
            await engine.pause("keep")
            calls = [asyncio.create_task(engine.generate([5, 6], SamplingParams(max_tokens=2))) for _ in range(3)]
            await asyncio.sleep(0)  # each has posted its request
            await engine.call_between_steps(lambda: None)  # and the engine's thread has queued them
            state = engine.queue_state()
            await engine.resume()
            await asyncio.gather(*calls)
            await engine.call_between_steps(lambda: None)  # the engine's thread has retired the finished rows
            return state, engine.queue_state()
        finally:
            await engine.shutdown()

    state, after = asyncio.run(main())
    assert (state.waiting, state.running, state.paused) == (3, 0, True) and state.oldest_wait_s >= 0
    assert str(state).startswith("3 requests waiting for a row (the oldest for ")
    assert str(state).endswith(", 0 running, paused for a weight sync")
    assert (after.waiting, after.running, after.oldest_wait_s, after.paused) == (0, 0, 0.0, False)
