"""The built-in engine's scheduler alone: admission, prefill before decode, stop and length,
pauses and cancels, on plain records — no model, no tensors."""

from __future__ import annotations

import ast
import inspect

from asyncrl.engine import scheduler as scheduler_module
from asyncrl.engine.scheduler import Scheduler, Sequence
from asyncrl.types import SamplingParams


def seq(i: int, max_tokens: int = 8, prompt_len: int = 3, **sampling) -> Sequence:
    return Sequence(i, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **sampling))


def queued(n: int, max_batch_size: int = 4, max_positions: int = 1 << 30,
           **sampling) -> tuple[Scheduler, list[Sequence]]:
    s = Scheduler(max_batch_size, max_positions)
    seqs = [seq(i, **sampling) for i in range(n)]
    for x in seqs:
        s.add(x)
    return s, seqs


def sample(s: Scheduler, token: int = 50, version: int = 0) -> list[Sequence]:
    """One step where every scheduled row samples ``token``; returns the finished ones."""
    step = s.schedule()
    finished = s.postprocess(step.sequences, [token] * len(step.sequences), [-1.0] * len(step.sequences), version)
    s.remove_finished()
    return finished


def test_the_scheduler_imports_no_torch():
    tree = ast.parse(inspect.getsource(scheduler_module))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(name.split(".")[0] in ("torch", "transformers") for name in imported)


def test_admits_up_to_the_batch_size_in_one_prefill_then_decodes():
    s, seqs = queued(6, max_batch_size=4)
    step = s.schedule()
    assert step.is_prefill and step.sequences == seqs[:4]
    assert s.running == seqs[:4] and list(s.waiting) == seqs[4:]
    s.postprocess(step.sequences, [50] * 4, [-1.0] * 4, 0)
    step = s.schedule()  # no room: the waiting two wait, the running four decode
    assert not step.is_prefill and step.sequences == seqs[:4]


def test_newcomers_are_prefilled_before_the_running_rows_decode_and_join_at_the_end():
    s, seqs = queued(2, max_batch_size=4)
    sample(s)
    late = seq(9)
    s.add(late)
    step = s.schedule()
    assert step.is_prefill and step.sequences == [late]  # the running rows sample nothing this step
    assert s.running == [*seqs, late]  # the KV batch's row order: merged rows come last
    assert [len(x.token_ids) for x in s.running] == [1, 1, 0]


def test_a_freed_row_admits_the_next_waiting_sequence():
    s, seqs = queued(3, max_batch_size=2, max_tokens=2)
    seqs[0].sampling = SamplingParams(max_tokens=1)
    assert sample(s) == [seqs[0]]  # the prefill's first token is its last
    assert s.running == [seqs[1]]
    step = s.schedule()
    assert step.is_prefill and step.sequences == [seqs[2]]


def test_stop_token_finishes_and_is_kept():
    s, (a, b) = queued(2, stop_token_ids=(7,))
    step = s.schedule()
    finished = s.postprocess(step.sequences, [7, 8], [-0.5, -0.25], version=3)
    assert finished == [a] and a.finish_reason == "stop" and not b.finished
    assert (a.token_ids, a.logprobs, a.versions) == ([7], [-0.5], [3])
    assert s.remove_finished() == [1] and s.running == [b]


def test_length_finishes_at_max_tokens_or_when_the_context_is_full():
    s = Scheduler(max_batch_size=4, max_positions=6)
    short, long_prompt = seq(0, max_tokens=2, prompt_len=1), seq(1, max_tokens=100, prompt_len=4)
    s.add(short)
    s.add(long_prompt)
    assert sample(s) == []
    assert sample(s) == [short, long_prompt]  # 2 tokens: its max; 4 + 2: the context is full
    assert [x.finish_reason for x in (short, long_prompt)] == ["length", "length"]
    assert s.running == [] and not s.has_work()


def test_a_stop_token_wins_over_length():
    s, (a,) = queued(1, max_tokens=1, stop_token_ids=(50,))
    sample(s, token=50)
    assert a.finish_reason == "stop"


def test_tokens_carry_the_version_that_sampled_them():
    s, (a,) = queued(1)
    sample(s, version=0)
    sample(s, version=0)
    sample(s, version=5)
    assert a.versions == [0, 0, 5]


def test_remove_finished_returns_the_rows_that_stay():
    s, seqs = queued(5, max_batch_size=5)
    step = s.schedule()
    s.postprocess(step.sequences, [50] * 5, [-1.0] * 5, 0)
    seqs[1].finish_reason = seqs[3].finish_reason = "stop"
    assert s.remove_finished() == [0, 2, 4]
    assert s.running == [seqs[0], seqs[2], seqs[4]]
    assert s.remove_finished() == [0, 1, 2]  # nothing left to drop: every row stays


def test_a_step_keeps_its_rows_while_the_running_list_changes():
    s, seqs = queued(2, max_batch_size=4, max_tokens=2)
    sample(s)
    step = s.schedule()
    s.add(seq(9))
    finished = s.postprocess(step.sequences, [50, 50], [-1.0, -1.0], 0)
    s.remove_finished()
    assert step.sequences == seqs and finished == seqs and s.running == []


def test_abort_at_a_pause_ends_running_sequences_with_their_partial_tokens():
    s, seqs = queued(3, max_batch_size=2)
    sample(s)
    sample(s)
    s.pause()
    assert not s.has_work()
    aborted = s.abort_running()
    assert aborted == seqs[:2] and s.running == []
    assert all(x.finish_reason == "abort" and x.token_ids == [50, 50] for x in aborted)
    assert list(s.waiting) == [seqs[2]] and not seqs[2].finished  # sampled nothing: it stays queued
    s.resume()
    assert s.has_work() and s.schedule().sequences == [seqs[2]]


def test_pause_keep_holds_the_running_rows():
    s, seqs = queued(2)
    sample(s)
    s.pause()
    assert not s.has_work() and s.running == seqs
    s.resume()
    step = s.schedule()
    assert not step.is_prefill and step.sequences == seqs


def test_pause_wait_lets_the_running_rows_finish_and_admits_nothing():
    s, (running,) = queued(1, max_tokens=2)
    sample(s)
    s.stop_admitting()
    late = seq(9)
    s.add(late)
    assert s.has_work()
    step = s.schedule()
    assert not step.is_prefill and step.sequences == [running]  # room, but no admission
    s.postprocess(step.sequences, [50], [-1.0], 0)
    s.remove_finished()
    assert s.running == [] and not s.has_work()  # drained: the late one waits
    s.pause()  # the pause proper lands; admission opens again for after resume
    s.resume()
    assert s.schedule().sequences == [late]


def test_cancel_forgets_a_waiting_sequence_and_frees_a_running_row():
    s, seqs = queued(3, max_batch_size=2)
    sample(s)
    assert s.cancel(seqs[2]) is False and list(s.waiting) == []
    assert s.cancel(seqs[0]) is True and seqs[0].finish_reason == "abort"
    assert s.remove_finished() == [1] and s.running == [seqs[1]]
    assert s.cancel(seqs[0]) is False  # already gone
    assert s.cancel(seq(42)) is False  # never seen


def test_clear_forgets_everything():
    s, _ = queued(6, max_batch_size=4)
    s.schedule()
    s.clear()
    assert s.running == [] and not s.waiting and not s.has_work()
