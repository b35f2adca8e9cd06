"""One engine request's outputs as they arrive, and what it takes to move it.

The EngineClient (engine_client.py) is the only writer: it pushes outputs, fails
the request, and records where it runs; the request's handler drains `pending`
and waits on `event`. Kept apart so the endpoints' helpers (generation.py,
logprobs.py, backpressure.py) can name it without the ZeroMQ side.
"""

from __future__ import annotations

import asyncio
import time

from dpserve.daemons.api.tenants import DEFAULT_TENANT
from dpserve.engine.common.protocol import FINISH_ERROR, RequestOutput


class RequestState:
    """Outputs of one request as they arrive; the handler drains `pending`."""

    __slots__ = (
        "request_id",
        "rank",
        "prompt_tokens",
        "remaining",
        "pending",
        "finish_reason",
        "stop_token_id",
        "error",
        "error_status",
        "event",
        "num_output_tokens",
        "first_token_timer",
        "num_cached_tokens",
        "prefill_left",
        "owner",
        "pinned",
        "migrations",
        "paused",
        "t_sent",
        "t_first",
        "t_last",
        "queue_s",
        "tenant",
        "held",
        "urgency",
    )

    def __init__(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        self.request_id = request_id
        self.rank = -1
        self.prompt_tokens = prompt_tokens
        # Work not yet done, in tokens: the prompt until its first token comes
        # back, then the answer tokens still allowed. The router's in-flight
        # tokens for this rank are the sum of these.
        self.remaining = prompt_tokens + max_tokens
        self.pending: list[int] = []
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None
        self.error: str | None = None
        self.error_status = 400  # an engine's own rejection is the request's fault
        self.event = asyncio.Event()
        self.num_output_tokens = 0
        self.first_token_timer: asyncio.TimerHandle | None = None
        self.num_cached_tokens = 0  # prompt tokens the engine found in its prefix cache (first output)
        self.prefill_left = prompt_tokens  # tokens the current rank prefills before its first output here
        # What it takes to move the request when its rank is lost (migration.py): the
        # Generation it belongs to (set from send to finish only: no cycle outlives it),
        # whether X-data-parallel-rank pinned it, and how often it moved.
        self.owner = None
        self.pinned = False
        self.migrations = 0
        self.paused = False  # its client stopped reading (backpressure.py): a rank it moves to pauses it too
        # time.monotonic() of the first send, the first output and the last output (metrics)
        self.t_sent = 0.0
        self.t_first = 0.0
        self.t_last = 0.0
        self.queue_s = 0.0  # the engine's wait before the first schedule (first output)
        # whose request it is (the auth middleware's Tenant), and its admission.Held entry if
        # it was held at the frontend (its cost is corrected by what it used when it ends)
        self.tenant = DEFAULT_TENANT
        self.held = None
        self.urgency = None  # its priority, while admission counts it in flight (priority policy)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def take(self) -> list[int]:
        ids = self.pending
        self.pending = []
        self.event.clear()
        return ids

    def push(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if not self.t_first:
            self.t_first = now
            self.num_cached_tokens = out.num_cached_tokens  # (a continuation's first output says nothing of the prompt)
            self.queue_s = out.queue_s
        self.t_last = now
        self.pending.extend(out.new_token_ids)
        self.num_output_tokens += len(out.new_token_ids)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_token_id = out.stop_token_id
            self.error = out.error
            if out.error is not None and self.migrations and self.prefill_left:
                # the rank it moved to refused the continuation: the move failed, not the request
                self.error_status = 503
                self.error = f"the request could not continue after its rank was lost: {out.error}"
        self.event.set()

    def _fail(self, reason: str, status: int = 503) -> None:
        self.owner = None
        self.finish_reason = FINISH_ERROR
        self.error = reason
        self.error_status = status  # 503: the rank failed, not the request; 504: it never answered
        self.event.set()
