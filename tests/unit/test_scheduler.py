"""Admission and prefill grouping (pure bookkeeping: no model, no tensors)."""

from __future__ import annotations

import pytest
from dpserve.engine.protocol import SamplingParams
from dpserve.engine.scheduler import PAD_SLACK, Scheduler, group_for_prefill
from dpserve.engine.sequence import Sequence


def seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, [7] * n, SamplingParams(max_tokens=4), 0.0, "cpu")


def lengths(groups) -> list[list[int]]:
    return [[s.num_prompt_tokens for s in g] for g in groups]


@pytest.mark.parametrize(
    "prompt_lengths, expected",
    [
        ([20, 1800, 22, 25], [[20, 22, 25], [1800]]),  # the long one is not padded onto the short ones
        ([1800, 1790, 1700], [[1700, 1790, 1800]]),  # similar long ones share one forward
        ([3, 64, 10, 40], [[3, 10, 40, 64]]),  # short prompts always share (padding is cheap)
        ([100, 200, 400, 800], [[100], [200], [400], [800]]),
        ([], []),
    ],
)
def test_groups_bound_padding(prompt_lengths, expected):
    groups = group_for_prefill([seq(f"s{i}", n) for i, n in enumerate(prompt_lengths)])
    assert lengths(groups) == expected
    for g in groups:
        width = max(s.num_prompt_tokens for s in g)
        real = sum(s.num_prompt_tokens for s in g)
        assert width <= 64 or width * len(g) <= PAD_SLACK * real


def test_admit_is_fifo_within_the_token_budget_and_running_follows_the_groups():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=1880)
    for i, n in enumerate([20, 1800, 22, 25, 30]):
        sched.add(seq(f"r{i}", n))
    groups = sched.admit()
    # 20 + 1800 + 22 + 25 = 1867 fits; + 30 would not; never skips ahead
    assert lengths(groups) == [[20, 22, 25], [1800]]
    assert [s.request_id for s in sched.running] == ["r0", "r2", "r3", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r4"] and sched.num_waiting_prefill_tokens == 30
    assert lengths(sched.admit()) == [[30]]


def test_a_prompt_over_the_budget_runs_alone():
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(seq("big", 500))
    sched.add(seq("small", 5))
    assert lengths(sched.admit()) == [[500]]
    assert lengths(sched.admit()) == [[5]]
