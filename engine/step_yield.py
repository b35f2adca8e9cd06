"""A step in progress gives way to a more urgent request (priority policy, issue 28).

The engine core calls `hook()` for each step's per-layer callback. When the rank
says a request more urgent than all of the step's work has come (`yield_check`,
engine/rank/process.py), the callback raises StepYielded out of the forward; the
core then drops the step whole: no token counted, no block cached; the blocks grown
for it stay with their sequences, and the keys and values it wrote are written
again, the same, when it is redone. An urgent step never gives way, nor the plain
step after one that did, so less urgent work always advances: at worst one dropped
part-step for each urgent step.
"""

from __future__ import annotations

from collections.abc import Callable


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
        policy's urgent steps, `check(floor)` (floor: the most urgent priority of the step's
        (sequence, tokens) pairs)."""
        if check is None or self._yielded or scheduler.was_isolated or not scheduler.isolate_urgent:
            return progress
        floor = min(seq.params.priority for seq, _ in scheduled)

        def on_layer() -> None:
            if progress is not None:
                progress()
            if check(floor):
                raise StepYielded

        return on_layer

    def gave_way(self) -> None:
        self.num_yielded += 1
        self._yielded = True

    def ran(self, isolated: bool) -> None:
        """A step ran whole; a plain one makes the next one free to give way again."""
        if not isolated:
            self._yielded = False
