"""Admission held at the frontend: per-tenant queues while every rank is full, released
in weighted fair order by tokens, priority classes first.

Owns the requests this API server holds back (nothing else queues them) and each
tenant's fair-share account. It never picks a rank itself: a held request carries
the send that routes it, and a release calls it until the router says no rank has
room (QueueFull). It must never poll: releases run when the router reports room
(Router.on_room) or a request is held while others wait. Nothing here knows HTTP.

Fair order is start-time fair queuing (SFQ) per priority class: each (class, tenant)
account has a virtual finish tag; a released request of estimated cost c (prompt
tokens + max_tokens) starts at S = the tenant's tag and moves it to S + c / weight;
the class's virtual time becomes S. The backlogged tenant with the lowest tag goes
next (ties: the request held first). A tenant that becomes backlogged starts at the
class's virtual time, so idleness banks no credit. When a released request finishes,
the tokens it did not use (max_tokens is an upper bound) are credited back to its
tenant's tag. Lower `priority` classes go strictly first. With reservations (reserve.py),
an account (class, tenant) at its cap of places is passed over even while a rank has
room, and one under its own reservation is not held at all. Under the engines' priority
scheduling a request more urgent than a held one is not held at all (serving.py): it goes
to the rank where it starts soonest (soonest_rank), whose engine preempts for it; and the
fair order's next goes so too, room or not, while its tenant holds fewer places than a
backlogged one of its class (_under: a quiet tenant's burst at a flood's onset). An account past
its reservation that asked for fewer places than its share on average (reserve.check's BURST: a
quiet tenant's Poisson burst) is not held either, nor passed over: it goes as a burst, which the
engine runs before over-share work (urgency). A tenant without a window's history (a flood's onset)
is lent no quiet tenant's reserved place, and its own go less urgently than theirs (FRESH).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from dpserve.daemons.api.held import HELD_SECONDS_BUCKETS, Account, Held, HoldRefused, PriorityClass, TenantStats
from dpserve.daemons.api.reserve import BURST, FAIR_BURSTS, FRESH, HOLD, NOW, TURN, Reservations
from dpserve.daemons.api.router import NoRankAvailable, QueueFull, Router
from dpserve.daemons.api.tenants import Tenant

if TYPE_CHECKING:
    from dpserve.daemons.config import ApiServerConfig

_RATE_TAU_S = 5.0  # the release rate behind Retry-After: an exponential average over about this long
# Priority policy with reservations: a request under its share goes to the engine as more urgent
# than over-share work of its class (DPSERVE_SHARE_URGENCY=0 turns it off, for benchmarks' A/B).
SHARE_URGENCY = os.environ.get("DPSERVE_SHARE_URGENCY", "1") != "0"
# ... and a held request released in fair order goes as under its share, room or not, while its tenant
# holds fewer places than a backlogged one of its class (Admission._under; 0: as before, for the A/B).
RELEASE_UNDER = os.environ.get("DPSERVE_RELEASE_UNDER", "1") != "0"


class Admission:
    """The held requests of one API server, in per-tenant queues per priority class.

    Invariant: `num_held` is the number of Held entries in the accounts' queues, and
    while it is nonzero every new request is held too (it may not pass those waiting),
    except, with `reserve`, one under its account's reservation; an entry leaves its
    queue exactly once: released, abandoned, or failed.
    """

    def __init__(self, max_held_per_tenant: int, clock: Callable[[], float] = time.monotonic, by_class: bool = False,
                 reserve: Reservations | None = None) -> None:
        self.max_held_per_tenant = max_held_per_tenant
        self.reserve = reserve  # places reserved by recent demand (reserve.py), or None
        self._wake: asyncio.TimerHandle | None = None  # a release when a reservation lapses
        # Under the engines' priority scheduling: requests sent and not ended, by priority (a
        # more urgent one than any of these, or than a held one, is not held: the engine preempts)
        self.in_flight: dict[int, int] | None = {} if by_class else None
        self.clock = clock
        self.num_held = 0
        self._classes: dict[int, PriorityClass] = {}
        self._seq = 0
        self._release_pending = False
        self.free_place: Callable[[], bool] = lambda: True  # a rank has a batch place free (serving.py sets it)
        self.stats: dict[str, TenantStats] = {}
        self._rate = 0.0  # releases per second (decaying), for Retry-After
        self._rate_t = clock()

    @classmethod
    def of_config(cls, cfg: ApiServerConfig, router: Router) -> Admission:
        """Admission for an API server (--admission-hold): a rank is full when every batch place
        is taken and --hold-waiting-per-rank more wait; places are reserved by recent demand
        (reserve.py) with a tenants file or the priority policy; the router's room reports release."""
        by_class = cfg.scheduling_policy == "priority"
        router.count_running = True
        router.max_waiting_per_rank = cfg.max_num_seqs + min(cfg.max_waiting_per_rank, cfg.hold_waiting_per_rank)
        reserve = None
        if cfg.reserve_window_s > 0 and (cfg.tenants_file or by_class):  # (external LB: each API server, one rank)
            # with tenants, the others' counts come in (tenants/sync.py): the cluster's places
            split = 1 if len(cfg.eligible_ranks) == 1 or cfg.tenants_file else cfg.api_server_count
            reserve = Reservations.of_router(router, cfg.reserve_window_s, cfg.max_num_seqs, split, cfg.api_server_count - 1 if cfg.tenants_file else 0)
        admission = cls(cfg.max_held_per_tenant, by_class=by_class, reserve=reserve)
        admission.free_place = lambda: has_place(router, cfg.max_num_seqs)
        router.on_room = admission.on_room
        return admission

    @property
    def num_accounts(self) -> int:
        """(class, tenant) accounts alive: each holds or runs something."""
        return sum(len(c.accounts) for c in self._classes.values())

    def least_urgent_held(self) -> float:
        """The highest (least urgent) priority among held requests; -inf when none is held."""
        return max((p for p, c in self._classes.items() if c.backlogged), default=-math.inf)

    def least_urgent(self) -> float:
        """Under the priority policy, the least urgent priority held or in flight from here
        (-inf otherwise): a request more urgent than it need not wait for a free place."""
        if self.in_flight is None:
            return -math.inf
        return max(self.least_urgent_held(), max(self.in_flight, default=-math.inf))

    def started(self, state, priority: int, rank: int) -> int:
        """`state` was sent to `rank` (returned); counted by class under the priority policy,
        and by account with reservations."""
        if self.in_flight is not None:
            self.in_flight[priority] = self.in_flight.get(priority, 0) + 1
            state.urgency = priority
        if self.reserve is not None:
            if state.held is None:  # (a held one was counted as release sent it: release() sends many)
                self.reserve.started(priority, state.tenant.name, state.tenant.weight)
            state.urgency = priority
        return rank

    def ended(self, state) -> None:
        """A request sent through admission ended: its class count drops, and if it was held,
        its tenant gets back the tokens it did not use (finished)."""
        if state.urgency is not None:
            if self.in_flight is not None:
                n = self.in_flight[state.urgency] - 1
                if n:
                    self.in_flight[state.urgency] = n
                else:
                    del self.in_flight[state.urgency]
            if self.reserve is not None:
                self.reserve.ended(state.urgency, state.tenant.name)
                self.on_room()  # a place of its account freed: a held request at its cap may go
            state.urgency = None
        if state.held is not None:
            self.finished(state.held, state.prompt_tokens + state.num_output_tokens)
            state.held = None

    def urgency(self, add, go: int):
        """The AddRequest to send: under the priority policy with reservations, its engine priority
        is 4 x its class + 0 when it goes under its share (NOW: under its reservation, or released
        by _under), + 1 as a burst of a tenant below its share on average (BURST), + 2 under its
        reservation without a window's history (FRESH: a flood's onset, or a newcomer), + 3 otherwise
        (held, a free place in fair order, or alone: past its share once another comes). Classes
        keep their order; within one, the engine runs (and preempts for) a quiet or new tenant's
        request before a flood's, and a reserved one of a tenant with a record before a burst."""
        if not self._by_share() or abs(add.params.priority) >= 2**60:
            return add  # (a priority near int64's bounds, which vLLM's engine takes, is sent as it came)
        level = 0 if go == NOW else 1 if go == BURST else 2 if go == FRESH else 3
        params = msgspec.structs.replace(add.params, priority=4 * add.params.priority + level)
        return msgspec.structs.replace(add, params=params)

    def may_pass(self, tenant: Tenant, priority: int) -> int:
        """With reservations: whether a new request may try a rank now rather than wait in its queue:
        reserve.check's answer, HOLD (0) for wait. With nothing held here (no flood backlogged) and no
        more urgent class active, one at its cap still takes a free place where the engines order by
        share, as over-share work, the first to give way (held, a quiet tenant's burst waited 1-1.8 s
        for its own answers to end while the rank had places free: benchmarks/RESULTS.md, ninth round)."""
        # (behind its own held requests, it waits for them (no BURST): released as bursts too, if owed)
        go = self.reserve.check(priority, tenant.name, tenant.weight, self._by_share() and not self._holds(priority, tenant.name))
        if go >= NOW or not self.num_held:
            if go == HOLD and FAIR_BURSTS and self._by_share() and not self.reserve.more_urgent_active(priority) and self.free_place():
                return TURN  # (a more urgent class's reserved places stay free: its requests need not preempt)
            return go
        return HOLD

    def _holds(self, priority: int, name: str) -> bool:
        cls = self._classes.get(priority)
        return cls is not None and name in cls.backlogged

    def _by_share(self) -> bool:
        """The engines order by share: under-share work first, preempting (urgency)."""
        return SHARE_URGENCY and self.in_flight is not None and self.reserve is not None

    def remote(self, origin: str, tenant: Tenant, in_flight: int, delivered: int) -> None:
        """Another API server's report of `tenant` (tenants/sync.py): its requests in flight
        there count in the reservations here, and the tokens delivered there move the
        tenant's finish tags here, so that N API servers give the shares together."""
        if self.reserve is not None:
            self.reserve.remote(origin, tenant.priority, tenant.name, tenant.weight, in_flight)
        if delivered:
            for cls in self._classes.values():
                acct = cls.accounts.get(tenant.name)
                if acct is not None and acct.queue:  # (an idle tenant banks nothing: not charged either)
                    acct.finish += delivered / max(tenant.weight, 1e-9)

    # ---------------------------------------------------------------- holding

    def enqueue(self, tenant: Tenant, priority: int, cost: int, send: Callable[[], int]) -> Held:
        """Hold a request of `cost` tokens in `tenant`'s queue of class `priority`; raises
        HoldRefused when the tenant already has max_held_per_tenant held here."""
        stats = self._stats(tenant.name)
        if stats.num_held >= self.max_held_per_tenant:
            stats.num_refused += 1
            raise HoldRefused(tenant.name, self.max_held_per_tenant, self.retry_after_s(stats.num_held))
        cls = self._classes.get(priority)
        if cls is None:
            cls = self._classes[priority] = PriorityClass()
        acct = cls.accounts.get(tenant.name)
        if acct is None:
            acct = cls.accounts[tenant.name] = Account(cls.vtime)
        if not acct.queue:
            acct.finish = max(acct.finish, cls.vtime)  # no credit banked while idle
            cls.backlogged.add(tenant.name)
        self._seq += 1
        held = Held(tenant, priority, cost, self._seq, send, self.clock())
        acct.queue.append(held)
        if self.reserve is not None:
            self.reserve.set_held(priority, tenant.name, tenant.weight, len(acct.queue))
        self.num_held += 1
        stats.num_held += 1
        stats.num_held_total += 1
        return held

    async def wait(self, held: Held) -> int:
        """Wait until `held` is released; returns the rank its send chose, or raises what
        that send raised. A caller cancelled meanwhile (aiohttp cancels the handler of a
        client that went away) leaves the queue at once."""
        self.release()  # there may be room already (a release not yet run)
        try:
            return await held.future
        except asyncio.CancelledError:
            if self.leave(held):
                self.stats[held.tenant.name].num_abandoned += 1
            elif held.sent:  # released, but its caller is gone (its send is aborted: serving.py): uncounted
                if self.reserve is not None:
                    self.reserve.ended(held.priority, held.tenant.name)
                self.finished(held, 0)
            raise

    def leave(self, held: Held) -> bool:
        """Take a held request out of its queue (its client left); False if it was not there."""
        cls = self._classes.get(held.priority)
        acct = cls.accounts.get(held.tenant.name) if cls is not None else None
        if acct is None or held not in acct.queue:
            return False
        acct.queue.remove(held)
        self._dequeued(cls, held, acct)
        return True

    # ---------------------------------------------------------------- releasing

    def on_room(self) -> None:
        """The router found room on a rank: release soon (coalesced; never inside the
        router's own update, which may be iterating its table)."""
        if self.num_held and not self._release_pending:
            self._release_pending = True
            asyncio.get_running_loop().call_soon(self._release_soon)

    def _release_soon(self) -> None:
        self._release_pending = False
        self.release()

    def release(self) -> int:
        """Send held requests in fair order until the router has no room; returns how many left."""
        released = 0
        while self.num_held:
            pick = self._next()
            if pick is None:  # every held request's account is at its cap
                self._wake_at_expiry()
                break
            cls, name, acct, owed = pick
            held = acct.queue[0]
            if held.future.done():  # cancelled: its client left, and its handler has not run yet
                acct.queue.popleft()
                self._dequeued(cls, held, acct)
                self.stats[held.tenant.name].num_abandoned += 1
                continue
            held.go = NOW if self._under(cls, name, held) else BURST if owed else TURN
            try:
                rank = held.send()
            except QueueFull:
                break
            except Exception as exc:  # noqa: BLE001 - a routing error is the request's answer
                acct.queue.popleft()
                self._dequeued(cls, held, acct)
                held.future.set_exception(exc)
                continue
            acct.queue.popleft()
            start = acct.finish
            cls.vtime = start
            acct.finish = start + held.cost / max(held.tenant.weight, 1e-9)
            acct.num_released += 1
            if self.reserve is not None:  # counted now: the next pick's cap sees it
                self.reserve.started(held.priority, name, held.tenant.weight)
            self._dequeued(cls, held, acct)
            self._observe(held)
            held.future.set_result(rank)
            released += 1
        return released

    def finished(self, held: Held, used: int) -> None:
        """A released request ended having used `used` of its estimated cost in tokens:
        the rest goes back to its tenant (max_tokens is only an upper bound)."""
        cls = self._classes.get(held.priority)
        acct = cls.accounts.get(held.tenant.name) if cls is not None else None
        if acct is None:
            return
        acct.num_released -= 1
        if used < held.cost:
            acct.finish -= (held.cost - used) / max(held.tenant.weight, 1e-9)
        self._forget_idle(cls, held.priority, held.tenant.name, acct)

    def _next(self) -> tuple[PriorityClass, str, Account, bool] | None:
        """The most urgent class with a held request; in it, the lowest finish tag, and whether its
        account is owed places (reserve.check's BURST, where _by_share). With reservations, accounts at
        their cap are passed over, unless owed places (None: all are)."""
        reserve = self.reserve
        for priority in sorted(p for p, c in self._classes.items() if c.backlogged):
            cls = self._classes[priority]
            best = None
            for name in cls.backlogged:
                acct = cls.accounts[name]
                key = (acct.finish, acct.queue[0].seq)
                if best is not None and key >= best[0]:
                    continue
                go = TURN if reserve is None else reserve.check(priority, name, acct.queue[0].tenant.weight, self._by_share())
                if go == HOLD:
                    continue
                best = (key, name, acct, go == BURST)
            if best is not None:
                return cls, best[1], best[2], best[3]
        return None

    def _under(self, cls: PriorityClass, name: str, held: Held) -> bool:
        """Where the engines order by share: whether `held`, the fair order's next, goes as under its
        share (NOW: engine priority 4 x class, to where it starts soonest, full or not: the engine
        preempts over-share work for it). So it does while its tenant, this request counted, holds
        fewer places by weight than another backlogged tenant of its class: a quiet tenant's burst
        behind a flood's onset then passes the flood's preempted requests instead of queueing behind
        them for seconds (benchmarks/RESULTS.md, ninth to eleventh rounds). Strictly fewer: tenants
        level within a place do not preempt each other, and the release order stays the fair one."""
        if not (RELEASE_UNDER and self._by_share()) or len(cls.backlogged) < 2:
            return False
        reserve, priority = self.reserve, held.priority
        mine = (reserve.in_flight(priority, name) + 1) / max(held.tenant.weight, 1e-9)
        for other in cls.backlogged:
            if other != name and reserve.in_flight(priority, other) / max(cls.accounts[other].queue[0].tenant.weight, 1e-9) > mine:
                return not reserve.more_urgent_active(priority)
        return False

    def _wake_at_expiry(self) -> None:
        """Held requests wait on caps alone: release again when the next idle account's
        reservation lapses (work conservation: nothing else would wake them then)."""
        when = self.reserve.next_expiry() if self.reserve is not None else None
        if when is None or self._wake is not None:
            return
        self._wake = asyncio.get_running_loop().call_later(max(0.0, when - self.clock()) + 0.01, self._woken)

    def _woken(self) -> None:
        self._wake = None
        self.release()

    def _dequeued(self, cls: PriorityClass, held: Held, acct: Account) -> None:
        held.send = None  # (it holds the request's state: no cycle outlives the hold)
        name = held.tenant.name
        self.num_held -= 1
        self.stats[name].num_held -= 1
        if self.reserve is not None:
            self.reserve.set_held(held.priority, name, held.tenant.weight, len(acct.queue))
        if not acct.queue:
            cls.backlogged.discard(name)
            self._forget_idle(cls, held.priority, name, acct)

    def _forget_idle(self, cls: PriorityClass, priority: int, name: str, acct: Account) -> None:
        """Accounts and classes live while they hold or run something (a client may send
        any number of distinct priorities: none may leave state behind)."""
        if acct.queue or acct.num_released > 0:
            return
        del cls.accounts[name]
        if not cls.accounts:
            del self._classes[priority]

    # ---------------------------------------------------------------- figures

    def _stats(self, name: str) -> TenantStats:
        stats = self.stats.get(name)
        if stats is None:
            stats = self.stats[name] = TenantStats()
        return stats

    def _observe(self, held: Held) -> None:
        now = self.clock()
        waited = now - held.t_held
        stats = self.stats[held.tenant.name]
        stats.held_seconds += waited
        i = 0
        while i < len(HELD_SECONDS_BUCKETS) and waited > HELD_SECONDS_BUCKETS[i]:
            i += 1
        stats.buckets[i] += 1
        self._rate = self._rate * math.exp((self._rate_t - now) / _RATE_TAU_S) + 1.0 / _RATE_TAU_S
        self._rate_t = now

    def retry_after_s(self, num_ahead: int) -> int:
        """Seconds until `num_ahead` held requests are likely released, at the recent
        release rate (1 to 60)."""
        rate = self._rate * math.exp((self._rate_t - self.clock()) / _RATE_TAU_S)
        if rate <= 0:
            return 60
        return max(1, min(60, math.ceil(num_ahead / rate)))


def soonest_rank(router: Router) -> int:
    """Router.soonest's rank, full or not: where a request that preempts starts soonest. A scan:
    only such requests pay for it. Raises NoRankAvailable."""
    best, count = router.soonest()
    if count is None:
        raise NoRankAvailable()
    return best


def has_place(router: Router, places: int) -> bool:
    """Whether a routable rank has a batch place free (fewer than `places` running and waiting)."""
    count = router.soonest()[1]
    return count is not None and count < places
