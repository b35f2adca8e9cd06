"""The HTTP face of a request refused before it reaches a rank: a bad rank pin, a routing
failure (the router knows nothing of HTTP), a tenant's held queue full (admission.py).
Pure functions from the typed failures to OpenAI-style ApiErrors; nothing else."""

from __future__ import annotations

from dpserve.daemons.api.held import HoldRefused
from dpserve.daemons.api.openai_types import ApiError
from dpserve.daemons.api.router import NoRankAvailable, QueueFull, RankLost, RankNotEligible, RoutingError


def parse_rank_header(value: str | None, size: int) -> int | None:
    """X-data-parallel-rank: None when absent, else an int in [0, size) or a 400."""
    if value is None:
        return None
    # ASCII digits only: int() would also take " 1 ", "+1", "0_1" and non-ASCII digits.
    if not (value.isascii() and value.isdigit()):
        raise ApiError(
            400,
            f"X-data-parallel-rank must be an integer in [0, {size}); got {value[:40]!r}.",
            param="X-data-parallel-rank",
            code="invalid_rank",
        )
    # (a long run of digits is out of range without int(), which refuses past 4,300 digits)
    rank = int(value) if len(value) <= 9 else size
    if not 0 <= rank < size:
        raise ApiError(
            400,
            f"X-data-parallel-rank {value[:20]} is out of range: this deployment has ranks 0..{size - 1}.",
            param="X-data-parallel-rank",
            code="invalid_rank",
        )
    return rank


def routing_error(exc: RoutingError) -> ApiError:
    """The HTTP face of a routing failure (the router itself knows nothing of HTTP)."""
    retry = {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, RankNotEligible):
        ranks = ", ".join(map(str, exc.eligible))
        return ApiError(
            400,
            f"X-data-parallel-rank {exc.rank} is not served through this API server; it routes to rank(s) {ranks}.",
            param="X-data-parallel-rank",
            code="invalid_rank",
        )
    if isinstance(exc, QueueFull):
        return ApiError(429, "Every rank is at its waiting-queue limit; retry shortly.", type="rate_limit_error", code="overloaded", headers=retry)
    if isinstance(exc, NoRankAvailable) and exc.unreachable:
        return ApiError(503, "No engine rank is reachable right now.", type="service_unavailable", code="rank_unavailable", headers=retry)
    if isinstance(exc, RankLost):
        return ApiError(503, f"Rank {exc.rank} is lost ({exc.reason}); not waiting for it.", type="service_unavailable", code="rank_unavailable", headers=retry)
    if isinstance(exc, NoRankAvailable) and exc.rank is not None:
        return ApiError(503, f"Rank {exc.rank} is not serving right now.", type="service_unavailable", code="rank_unavailable", headers=retry)
    return ApiError(503, "No engine rank is serving right now.", type="service_unavailable", code="no_rank_available", headers=retry)


def hold_refused_error(exc: HoldRefused) -> ApiError:
    """The 429 of a tenant whose held queue is full (admission.py), naming the limit."""
    return ApiError(
        429,
        f"Every rank is busy and tenant {exc.tenant!r} already has {exc.limit} requests waiting at this API "
        f"server (--max-held-per-tenant); retry after {exc.retry_after_s} s.",
        type="rate_limit_error", code="max_held_per_tenant", headers={"Retry-After": str(exc.retry_after_s)},
    )
