"""A step in progress gives way to a more urgent request (priority policy, issue 28).

The engine core calls `hook()` for each step's per-layer callback. When the rank
says a request has come that is more urgent than some of the step's work
(`yield_check`, engine/rank/process.py), the callback raises StepYielded out of the
forward; the core then drops the step whole: no token counted, no block cached; the
blocks grown for it stay with their sequences, and the keys and values it wrote are
written again, the same, when it is redone. The next step is then an urgent one
(engine/scheduler.py): the newcomer with the work as urgent as it, the less urgent
left out. An urgent step never gives way, nor the plain step after one that did, so
less urgent work always advances: at worst one dropped part-step for each urgent step.

"Some", not "all": a quiet tenant's request that arrives while a flood's step also
decodes another quiet request (as urgent as it) used to wait for that whole step.
Measured (benchmarks/RESULTS.md, "Fair shares, seventh round"), two runs: the quiet
tenants' TTFT p90 beside a flood 0.091 / 0.072 -> 0.065 / 0.073 s, p99 over their
p99 without the flood 1.28 / 1.19 -> 1.19 / 1.00, at the flood's throughput (a flood
that did not fill the rank: the eighth round's, which does, is not met yet).
DPSERVE_YIELD_PAST_ALL=1 keeps the old rule (more urgent than all of the step), for A/B.
"""

from __future__ import annotations

import os
from collections.abc import Callable

PAST_ALL = os.environ.get("DPSERVE_YIELD_PAST_ALL", "0") == "1"  # the old rule, for benchmarks' A/B


class StepYielded(Exception):
    """Raised from inside a step: a more urgent request came; the step is dropped and redone."""


class GivingWay:
    """Whether the next step may give way, and how many did."""

    def __init__(self) -> None:
        self.num_yielded = 0
        self._yielded = False  # the last plain step gave way: the next one runs whole, whatever arrives

    def hook(self, scheduled: list, progress: Callable[[], None] | None, check: Callable[[int], bool] | None,
             scheduler) -> Callable[[], None] | None:
        """The step's per-layer callback: `progress`, and, for a plain step under the priority
        policy's urgent steps, `check(bar)`: whether a request more urgent than `bar` came (bar:
        the least urgent priority of the step's (sequence, tokens) pairs; with PAST_ALL, the most)."""
        if check is None or self._yielded or scheduler.was_isolated or not scheduler.isolate_urgent:
            return progress
        bar = (min if PAST_ALL else max)(seq.params.priority for seq, _ in scheduled)

        def on_layer() -> None:
            if progress is not None:
                progress()
            if check(bar):
                raise StepYielded

        return on_layer

    def gave_way(self) -> None:
        self.num_yielded += 1
        self._yielded = True

    def ran(self, isolated: bool) -> None:
        """A step ran whole; a plain one makes the next one free to give way again."""
        if not isolated:
            self._yielded = False
