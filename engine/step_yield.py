"""A step in progress gives way to a more urgent request (priority policy, issue 28).

The engine core calls `hook()` for each step's per-layer callback. When the rank
says a request has come that is more urgent than some of the step's work
(`yield_check`, engine/rank/process.py), the callback raises StepYielded out of the
forward; the core then drops the step whole: no token counted, no block cached; the
blocks grown for it stay with their sequences, and the keys and values it wrote are
written again, the same, when it is redone. The next step is then an urgent one
(engine/scheduler.py): the newcomer with the work as urgent as it, the less urgent
left out. An urgent step never gives way, nor, while the bulk is owed time (below), the
plain step after one that did, so less urgent work always advances: then at worst one
dropped part-step for each urgent step.

"Some", not "all": a quiet tenant's request that arrives while a flood's step also
decodes another quiet request (as urgent as it) used to wait for that whole step.
Measured (benchmarks/RESULTS.md, "Fair shares, seventh round"), two runs: the quiet
tenants' TTFT p90 beside a flood 0.091 / 0.072 -> 0.065 / 0.073 s, p99 over their
p99 without the flood 1.28 / 1.19 -> 1.19 / 1.00, at the flood's throughput (a flood
that did not fill the rank: the eighth round's, which does, is not met yet).
DPSERVE_YIELD_PAST_ALL=1 keeps the old rule (more urgent than all of the step), for A/B.

The bulk's guarantee is kept in time, not steps (fourteenth round): urgent work (urgent steps
and the part-steps dropped for them) may run up to GRACE_S seconds ahead of the whole plain
steps' time, so a plain step after one that gave way may give way too while the bulk is owed
nothing; once it is owed time, the rule above (a whole plain step after each that gave way)
holds again, so the bulk's floor is the old one. What is owed is remembered up to GRACE_S either
way. And a step past UNTIL of its layers runs to its end: giving way then saves the newcomer
at most the rest of the step and drops the most of it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

PAST_ALL = os.environ.get("DPSERVE_YIELD_PAST_ALL", "0") == "1"  # the old rule, for benchmarks' A/B
# Seconds urgent work may run ahead of whole plain steps (0: every step that gave way is followed by a whole plain one).
GRACE_S = float(os.environ.get("DPSERVE_YIELD_GRACE_S", "1.0"))
# The share of a step's layers after which it no longer gives way (1: to its last layer).
UNTIL = float(os.environ.get("DPSERVE_YIELD_UNTIL", "0.75"))


class StepYielded(Exception):
    """Raised from inside a step: a more urgent request came; the step is dropped and redone."""


class GivingWay:
    """Whether the next step may give way, and how many did.

    `owed`: seconds of urgent work (urgent steps, dropped part-steps) not yet matched by whole plain
    steps' time, kept within +-grace_s; the bulk is owed time when it is not negative."""

    def __init__(self, num_layers: int, grace_s: float = GRACE_S, until: float = UNTIL) -> None:
        self.num_yielded = 0
        self.grace_s = grace_s
        self.owed = -grace_s
        self.checked_layers = max(1, math.ceil(until * num_layers))  # a step looks after these first layers only
        self._yielded = False  # the last plain step gave way: the next one runs whole unless nothing is owed

    def hook(self, scheduled: list, progress: Callable[[], None] | None, check: Callable[[int], bool] | None,
             scheduler) -> Callable[[], None] | None:
        """The step's per-layer callback: `progress`, and, for a plain step under the priority
        policy's urgent steps, `check(bar)` after each of its first `checked_layers`: whether a request
        more urgent than `bar` came (bar: the least urgent priority of the step's (sequence, tokens)
        pairs; with PAST_ALL, the most)."""
        if (check is None or scheduler.was_isolated or not scheduler.isolate_urgent
                or (self._yielded and self.owed >= 0)):
            return progress
        bar = (min if PAST_ALL else max)(seq.params.priority for seq, _ in scheduled)
        layers = 0

        def on_layer() -> None:
            nonlocal layers
            if progress is not None:
                progress()
            layers += 1
            if layers <= self.checked_layers and check(bar):
                raise StepYielded

        return on_layer

    def gave_way(self, seconds: float) -> None:
        """A plain step was dropped after `seconds`."""
        self.num_yielded += 1
        self._yielded = True
        self.owed = min(self.grace_s, self.owed + seconds)

    def ran(self, isolated: bool, seconds: float) -> None:
        """A step ran whole in `seconds`: an urgent one adds to what the bulk is owed, a plain one pays it
        back and makes the next one free to give way again."""
        if isolated:
            self.owed = min(self.grace_s, self.owed + seconds)
        else:
            self.owed = max(-self.grace_s, self.owed - seconds)
            self._yielded = False
