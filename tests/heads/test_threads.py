"""One spec called from several threads (issue 36 item 7): the calls run one at a time, each output
is the backbone's own greedy ``generate``, and ``last_stats`` is the calling thread's."""

from __future__ import annotations

import threading

import pytest
import torch

import heads
from tests.conftest import build_model, greedy_reference, random_prompt

THREADS = 4
CALLS = 3

KINDS = {
    "medusa": lambda model: heads.attach_heads(model, kind="medusa", num_heads=3),
    "eagle": lambda model: heads.attach_heads(model, kind="eagle", depth=4, top_k=2, total_tokens=8),
    "lookup": lambda model: heads.attach_heads(model, kind="lookup", budget=6),
    "medusa+lookup": lambda model: heads.attach_heads(model, kind="medusa", num_heads=3, lookup={"budget": 4}),
    "draft": lambda model: heads.attach_heads(model, kind="draft", draft_model=build_model("llama", seed=9),
                                              depth=3, total_tokens=3),
}


def _prompt(number: int) -> torch.Tensor:
    """A prompt that repeats itself, so lookup drafts from it."""
    piece = random_prompt(5 + number % 4, seed=100 + number)
    return torch.cat([piece, piece, piece[:, :3]], dim=1)


def _run_threads(work) -> list[BaseException]:
    """``work(thread)`` in ``THREADS`` threads started together; the exceptions they raised."""
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def run(thread: int) -> None:
        try:
            barrier.wait()
            work(thread)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(thread,)) for thread in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.parametrize("kind", list(KINDS))
def test_threads_share_a_spec(kind):
    model = build_model("llama", seed=5)
    spec = KINDS[kind](model)
    cases = {(thread, call): _prompt(thread * CALLS + call) for thread in range(THREADS) for call in range(CALLS)}
    expected = {key: greedy_reference(model, prompt, 12 + key[1]) for key, prompt in cases.items()}
    outputs, stats = {}, {}

    def work(thread: int) -> None:
        for call in range(CALLS):
            outputs[thread, call] = spec.generate(cases[thread, call], max_new_tokens=12 + call)
            stats[thread, call] = spec.last_stats

    errors = _run_threads(work)
    assert not errors, errors
    for key, output in outputs.items():
        assert torch.equal(output, expected[key]), key
        assert stats[key].new_tokens == 12 + key[1], key  # no eos: every call makes all its tokens


def test_last_stats_belong_to_the_calling_thread():
    model = build_model("llama", seed=5)
    spec = heads.attach_heads(model, kind="lookup", budget=4)
    seen = {}

    def work(thread: int) -> None:
        spec.generate(_prompt(thread), max_new_tokens=4 + thread)
        threading.Event().wait(0.01)  # let other threads finish their calls in between
        seen[thread] = spec.last_stats.new_tokens

    assert not _run_threads(work)
    assert seen == {thread: 4 + thread for thread in range(THREADS)}
    # a thread that never generated reads the latest call's stats
    assert spec.last_stats.new_tokens in seen.values()
