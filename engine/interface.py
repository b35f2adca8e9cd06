"""RankEngine: what the rank process asks of an engine, and nothing more.

The native EngineCore, vLLM's VllmCore and the simulated SimCore implement it;
engine/rank/ drives any of them the same way. An engine must never do socket
IO: requests come in and outputs go out through these verbs only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sized
from typing import Protocol, runtime_checkable

from dpserve.engine.common.protocol import AddRequest, RequestOutput


@runtime_checkable
class RankEngine(Protocol):
    """One rank's engine. Owns a request from add_request until the RequestOutput
    that finishes it leaves step() (or until abort_requests names it).

    Every verb returns promptly except step(), which may take a long time and
    must then call `on_progress` (when set) every so often, so that a busy
    rank is not mistaken for a hung one.
    """

    on_progress: Callable[[], None] | None
    # An engine that can drop a step in progress (the native one) calls this from inside it with
    # the step's most urgent priority; True: a more urgent request came, the step gives way.
    # Engines that cannot (vLLM's, the simulator) never call it.
    yield_check: Callable[[int], bool] | None

    def describe(self) -> dict:
        """What the rank logs once the model is loaded (engine name, sizes)."""
        ...

    def add_request(self, req: AddRequest) -> RequestOutput | None:
        """Queue `req`, or return its finishing error output; never raises for a bad request."""
        ...

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Forget these requests now; unknown ids are ignored."""
        ...

    def pause_requests(self, request_ids: Iterable[str]) -> None:
        """Produce nothing more for these requests until resumed (their clients stopped
        reading); they keep their place. Unknown or finished ids are ignored."""
        ...

    def resume_requests(self, request_ids: Iterable[str]) -> None:
        """Produce for these paused requests again; unknown ids are ignored."""
        ...

    def has_unfinished(self) -> bool:
        """Whether step() has anything to do (paused requests alone are nothing)."""
        ...

    def step(self) -> list[RequestOutput]:
        """One iteration: at most one output per request that got tokens (or failed)."""
        ...

    # The load, as the rank reports it to the coordinator.
    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_waiting_prefill_tokens(self) -> int: ...

    @property
    def num_remaining_decode_tokens(self) -> int: ...

    @property
    def slot_usage(self) -> float: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def num_prefix_queries(self) -> int: ...

    @property
    def num_prefix_hits(self) -> int: ...

    @property
    def last_step_ms(self) -> float: ...


def missing_verbs(engine_class: type) -> list[str]:
    """RankEngine members that `engine_class` does not define (checked on the class,
    so no model needs loading). Every implementation declares `on_progress` at class
    level for this."""
    wanted = [name for name in vars(RankEngine) if not name.startswith("_")]
    wanted += list(RankEngine.__annotations__)
    return sorted({name for name in wanted if not hasattr(engine_class, name)})


class QueueCounts:
    """num_running and num_waiting, written once, for an engine (or its scheduler)
    that keeps its sequences in `running` (past their prompt or prefilling) and
    `waiting` (not yet admitted) collections."""

    __slots__ = ()
    running: Sized
    waiting: Sized

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
