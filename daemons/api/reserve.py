"""Batch places reserved by recent demand (issue 28): a quiet tenant, or a more urgent
priority class, finds a place free when its request comes, even while a flood of
another holds every place it is allowed.

The unit is an account: one (priority class, tenant) at this API server. Each account
counts its requests sent and not ended (`num_in_flight`) and its peak over the last
`window_s` (an older peak decays by e every window_s). An
account is active while it has a request in flight or had one within `window_s`, or,
while a less urgent class is active, within LINGER_WINDOWS x window_s: an interactive
class's next request after a quiet spell must find a place that a bulk flood did not
take (without preemption at fcfs ranks, nothing else gives it one: that request
waited 2-6x its unloaded TTFT in half the runs of benchmarks/fairness_bench.py).

With P places (this API server's part of the routable ranks' batch places), the quiet
accounts of a class c (active, no requests held) reserve together, with one headroom:

    R_c = min(sum of their shares s_j, sum of min(s_j, peak_j) + max(MIN_HEADROOM, HEADROOM x their number)),
    s_j = P * weight_j / (active weights)

and an account i may hold at most its cap in flight:

    cap_i = P - sum of R_c over the classes c <= i's class, i's own demand left out

(more urgent classes' reservations come first; a more urgent class does not leave
room for less urgent ones; backlogged accounts reserve nothing: the fair order by
tokens serves them). cap_i >= its own weighted share, so nobody starves, and
an account alone (the others idle past the window) has no cap at all: work-conserving.
Quiet accounts lend each other their free reserved places: one whose class's quiet
accounts use fewer places than R_c goes at once, even past its own share (1 place of
headroom an account, pooled, and 2 at least: 2 an account, not lent, idled 6 places for 3
quiet tenants and cost the flood 18-23% of its tokens/s; 2 a class left too few while
their demand ramped up, and a tenant's next request waited for a place).
A request of an account under its own reservation goes at once, past held ones. (Past it,
one whose account held no more places than a backlogged one's also went at once, for a
quiet tenant's burst; max-min by places fought the fair order by tokens: the simulated
Jain's first window fell from 0.998 to 0.926. Withdrawn: benchmarks/RESULTS.md, ninth round.)
The cost is O(active accounts) per request, paid only with a tenants file or the
priority policy (serving.py): the one-tenant plain path never gets here.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

HEADROOM = 1.0  # places reserved beyond the recent peaks of a class's quiet accounts, per account (lent within the class)
MIN_HEADROOM = 2.0  # and at least this many a class
REPORT_S = 0.3  # the others' reports come this often at most (tenants/sync.py FLUSH_S, and their way)
REMOTE_TTL_S = 3.0  # another API server's count, unheard this long, is dropped (tenants/limits.py's)
PEER_TTL_S = 300.0  # another API server heard from within this long is counted a peer (it may burst too)
LINGER_WINDOWS = 12  # an idle account of a class more urgent than an active one stays active this many windows
# While other accounts are active, an account's cap is at most this many times its weighted share
# (0: no such cap; the cap is then what the others' reservations leave). Fewer places for a flood
# make each step shorter, so a quiet request waits less for the step in flight, at the cost of
# the flood's tokens/s (benchmarks/fairness_bench.py measures both; DPSERVE_CAP_SHARE_X sets it).
CAP_SHARE_X = float(os.environ.get("DPSERVE_CAP_SHARE_X", "0"))
# A burst of a tenant at its cap, with nothing held and no more urgent class active, takes a free
# batch place as over-share work where the engines order by share (admission.may_pass).
# DPSERVE_FAIR_BURSTS=0: held instead, as before (benchmarks' A/B).
FAIR_BURSTS = os.environ.get("DPSERVE_FAIR_BURSTS", "1") != "0"
# A request past its reservation whose tenant asked for fewer places than its share on average over
# the window (Reservations._owed: a quiet tenant's burst) goes at once as a burst, between under- and
# over-share work, where the engines order by share (admission._bursts). DPSERVE_SHARE_BURSTS=0: off.
SHARE_BURSTS = os.environ.get("DPSERVE_SHARE_BURSTS", "1") != "0"
# Quiet accounts lend each other their free reserved places only once active for window_s: a flood's
# onset (an account (re)started after HISTORY_GAP_WINDOWS idle) takes its own reservation, not the
# quiet ones' places, and that at less urgency than theirs and their bursts (FRESH; benchmarks/RESULTS.md,
# twelfth round). 0: lent to all, NOW to all (A/B).
LEND_HISTORY = os.environ.get("DPSERVE_LEND_HISTORY", "1") != "0"
HISTORY_GAP_WINDOWS = 2  # idle this many windows, an account starts afresh: no average, no lending

# at its cap / may take a free place in fair order / under its reservation: at once, to where it
# starts soonest (a rank with a free batch place, not a full one's waiting place) / alone: no cap /
# past its reservation but owed places (below its share on average): at once, where it starts soonest /
# under its reservation without a window's history (a flood's onset, or a newcomer): as NOW, less urgent
HOLD, TURN, NOW, ALONE, BURST, FRESH = 0, 1, 2, 3, 4, 5
SOONEST = (NOW, BURST, FRESH)  # sent to where they start soonest, full or not: the engine preempts for them


class Demand:
    """One (class, tenant) account's recent demand at this API server."""

    __slots__ = ("priority", "weight", "num_in_flight", "num_remote", "remote", "num_unreported", "unreported_t", "matched", "peak", "peak_t", "last_t", "is_held", "num_held", "mean", "mean_t", "active_t")

    def __init__(self, priority: int, weight: float, now: float) -> None:
        self.priority, self.weight = priority, max(weight, 1e-9)
        self.num_in_flight = 0  # sent from here and not ended
        self.num_remote = 0  # in flight from the other API servers (tenants/sync.py), their last word
        self.remote: dict[str, tuple[int, float]] = {}  # origin -> (count, when heard)
        self.num_unreported = 0  # started here within REPORT_S of unreported_t: each peer is taken to have started as many
        self.unreported_t = now
        self.matched: dict[str, int] = {}  # origin -> how many of those its reports since showed (or made moot)
        self.peak = 0.0  # the count's peak as of peak_t; it decays toward the count since
        self.peak_t = now
        self.last_t = now  # the last start or end
        self.is_held = False  # it has requests held at the frontend: the fair order serves it, no reservation
        self.num_held = 0  # how many (admission.py says)
        self.mean = 0.0  # its demand's (in flight + held) time average over about window_s, as of mean_t
        self.mean_t = now
        self.active_t = now  # since when it is active without a break (a request at least every window_s)

    def mean_at(self, now: float, tau: float) -> float:
        """Its demand's average over about the last `tau` seconds (exponentially weighted)."""
        keep = math.exp(min(0.0, self.mean_t - now) / tau)
        return self.mean * keep + (self.num_in_flight + self.num_remote + self.num_held) * (1.0 - keep)

    def demand_changes(self, now: float, tau: float) -> None:
        """Called before its demand changes: the average so far is kept as of now. One idle for
        HISTORY_GAP_WINDOWS x `tau` starts afresh (no history: trusted after `tau` of activity)."""
        if not self.num_in_flight + self.num_remote + self.num_held and now - self.last_t >= HISTORY_GAP_WINDOWS * tau:
            self.mean, self.active_t = 0.0, now
        else:
            self.mean = self.mean_at(now, tau)
        self.mean_t = now

    def peak_at(self, now: float, tau: float) -> float:
        """The highest count of the last `tau` seconds; older peaks decay by e every tau."""
        age = now - self.peak_t
        peak = self.peak if age <= tau else self.peak * math.exp((tau - age) / tau)
        n = self.num_in_flight + self.num_remote
        return peak if peak > n else float(n)


class Reservations:
    """Every active account's demand; `check` says whether a request may take a place.

    Invariant: an account is in `accounts` while it has a request in flight or its last
    one ended less than window_s ago (pruned lazily by `_active`)."""

    def __init__(self, window_s: float, places: Callable[[], float], clock: Callable[[], float], headroom: float = HEADROOM,
                 min_headroom: float = MIN_HEADROOM) -> None:
        self.window_s = window_s
        self.headroom, self.min_headroom = headroom, min_headroom
        # Other API servers counting their own in flight into these shares (tenants/sync.py): until
        # their next report, each is taken to have started as many as this one (a flood's first
        # burst, sent by every server at once, would otherwise fill the reserved places N times over).
        # At least the configured number (this node's others); more once more have been heard from
        # (other nodes' API servers: the node's count alone let 2 servers send a flood twice over)
        self.num_peers = 0
        self.peers_heard: dict[str, float] = {}  # origin -> when last heard
        self.places = places  # this API server's batch places (+ the waiting each rank may hold)
        self.clock = clock
        self.accounts: dict[tuple[int, str], Demand] = {}

    @classmethod
    def of_router(cls, router, window_s: float, max_num_seqs: int, num_api_servers: int, num_peers: int = 0) -> Reservations:
        """Places: this API server's part of the routable ranks' batch places (the router
        counts the routable ones as the table changes). Not the waiting places a rank may
        also hold: a place reserved there would still wait for a running answer to end."""
        res = cls(window_s, lambda: router.num_routable * max_num_seqs / num_api_servers, time.monotonic)
        res.num_peers = num_peers
        return res

    def started(self, priority: int, name: str, weight: float) -> None:
        now = self.clock()
        key = (priority, name)
        d = self.accounts.get(key)
        if d is None:
            d = self.accounts[key] = Demand(priority, weight, now)
        d.demand_changes(now, self.window_s)
        d.num_in_flight += 1
        if now - d.unreported_t > REPORT_S:  # (older sends are in the peers' view by now)
            d.num_unreported, d.unreported_t = 0, now
            d.matched.clear()
        d.num_unreported += 1
        self._peak(d, now)
        d.last_t = now

    def _peak(self, d: Demand, now: float) -> None:
        n = d.num_in_flight + d.num_remote
        if n >= d.peak_at(now, self.window_s):
            d.peak, d.peak_t = float(n), now

    def remote(self, origin: str, priority: int, name: str, weight: float, count: int) -> None:
        """Another API server has `count` requests of tenant `name` in flight (its report,
        forwarded by the coordinator every FLUSH_S while they change): counted in the
        account of the tenant's default class, so that every API server reserves and caps
        by the cluster's counts (with P the cluster's places), not its own part of them.
        A report of 0 makes the account active here too: an interactive tenant served by
        another API server keeps its reservation against a flood arriving here (without it,
        a flood at a server that never saw the tenant was alone, and took every place)."""
        now = self.clock()
        d = self.accounts.get((priority, name))
        if d is None:  # (even at 0 in flight: it was active there just now, and its reservation holds here too)
            d = self.accounts[(priority, name)] = Demand(priority, weight, now)
        d.demand_changes(now, self.window_s)
        old = d.remote.get(origin)
        grown = count - (old[0] if old is not None else 0)
        if now - d.unreported_t <= REPORT_S:  # a peer's report matches its likely sends by its growth
            matched = d.matched.get(origin, 0)  # (not growing: it was not bursting, and none are likely)
            d.matched[origin] = matched + grown if grown > 0 else max(matched, d.num_unreported)
        d.remote[origin] = (count, now)
        self.peers_heard[origin] = now
        self._fresh_remote(d, now)
        self._peak(d, now)
        d.last_t = now

    def _unseen(self, d: Demand, now: float) -> int:
        """The peers' likely sends of account `d` not yet in their reports: as many as this
        server's within REPORT_S, less what each one's reports have shown since. A report
        made during a burst is stale on arrival (a peer that reported 8 went on to 14 while
        this server, busy with its own burst, had not read it): it counts for what it shows."""
        u = d.num_unreported
        if not u or now - d.unreported_t > REPORT_S:
            return 0
        return u * self._num_peers(now) - sum(min(u, m) for m in d.matched.values())

    def _num_peers(self, now: float) -> int:
        """The other API servers likely to send too: configured, or heard within PEER_TTL_S."""
        heard = self.peers_heard
        if len(heard) > self.num_peers:
            for origin in [o for o, t in heard.items() if now - t > PEER_TTL_S]:
                del heard[origin]
        return max(self.num_peers, len(heard))

    def _fresh_remote(self, d: Demand, now: float) -> None:
        """Drop the counts of API servers unheard for REMOTE_TTL_S (gone: nothing in flight)."""
        for origin in [o for o, (_, heard) in d.remote.items() if now - heard > REMOTE_TTL_S]:
            del d.remote[origin]
        d.num_remote = sum(c for c, _ in d.remote.values())

    def set_held(self, priority: int, name: str, weight: float, num_held: int) -> None:
        """The account has `num_held` requests held (admission.py): backlogged while nonzero."""
        now = self.clock()
        d = self.accounts.get((priority, name))
        if d is None:
            d = self.accounts[(priority, name)] = Demand(priority, weight, now)
        d.demand_changes(now, self.window_s)
        d.num_held, d.is_held = int(num_held), num_held > 0
        d.last_t = now

    def ended(self, priority: int, name: str) -> None:
        d = self.accounts.get((priority, name))
        if d is None:
            return
        now = self.clock()
        d.demand_changes(now, self.window_s)
        d.num_in_flight -= 1
        d.last_t = now

    def in_flight(self, priority: int, name: str) -> int:
        """The account's requests in flight, here and (their last word) at the other API servers."""
        d = self.accounts.get((priority, name))
        return 0 if d is None else d.num_in_flight + d.num_remote

    def _active(self, now: float, priority: float = -math.inf) -> dict[tuple[int, str], Demand]:
        """The accounts active now, seen by a request of class `priority` (it makes its class
        active: an idle more urgent one lingers from its first request). An account is
        forgotten once idle past the longest linger."""
        accounts = self.accounts
        for d in accounts.values():
            if d.remote:
                self._fresh_remote(d, now)
        longest = self.window_s * LINGER_WINDOWS
        gone = [k for k, d in accounts.items() if not d.num_in_flight + d.num_remote and not d.is_held and now >= d.last_t + longest]
        for key in gone:
            del accounts[key]
        floor = max(self._floor(now), priority)
        return {k: d for k, d in accounts.items() if d.num_in_flight + d.num_remote or d.is_held or now < self._expiry(d, floor)}

    def _floor(self, now: float) -> float:
        """The least urgent class with an account busy or idle for less than window_s."""
        window = self.window_s
        return max((d.priority for d in self.accounts.values() if d.num_in_flight + d.num_remote or d.is_held or now - d.last_t < window),
                   default=-math.inf)

    def _expiry(self, d: Demand, floor: float) -> float:
        """When idle account `d` stops being active: window_s after its last request, or
        LINGER_WINDOWS x that while a less urgent class is active (its reservation stays, so
        its next request after a quiet spell still finds a place the flood did not take)."""
        return d.last_t + self.window_s * (LINGER_WINDOWS if d.priority < floor else 1)

    def check(self, priority: int, name: str, weight: float, by_share: bool = False) -> int:
        """HOLD: the account is at its cap; NOW: a place reserved for it, or lent by its class's
        other quiet accounts, is free (it goes at once); TURN: between the two (it may take a free
        place in fair order); ALONE: no other account is active (no cap). Where the engines order
        by share (`by_share`), also FRESH: NOW for one without a window's history (_has_history)
        past its first request in flight,
        and BURST instead of HOLD or TURN while it is owed places (_owed: below its share on average)."""
        now = self.clock()
        active = self._active(now, priority)
        me = active.get((priority, name))
        if me is None:
            if not active:
                return ALONE
            total_weight, mine, num, unseen = max(weight, 1e-9), 0, 0.0, 0
        else:
            if len(active) == 1:
                return ALONE
            total_weight, mine, num = 0.0, me.num_in_flight + me.num_remote, me.peak_at(now, self.window_s)
            unseen = self._unseen(me, now)
        for d in active.values():
            total_weight += d.weight
        places = self.places()
        tau = self.window_s
        # Per class, the other quiet accounts' shares, reserved demand and use (lending is within a class)
        groups: dict[int, list[float]] = {}
        for d in active.values():
            if d is not me and d.priority <= priority and not d.is_held:
                share = places * d.weight / total_weight
                g = groups.get(d.priority)
                if g is None:
                    g = groups[d.priority] = [0.0, 0.0, 0.0, 0]
                g[0] += share
                g[1] += min(share, d.peak_at(now, tau))
                g[2] += d.num_in_flight + d.num_remote
                g[3] += 1
        h, h_min = self.headroom, self.min_headroom
        others = sum(min(g[0], g[1] + max(h_min, h * g[3])) for g in groups.values())
        share = places * max(weight, 1e-9) / total_weight
        cap = places - others if not CAP_SHARE_X else min(places - others, max(1.0, CAP_SHARE_X * share))
        past = (by_share, me, now, mine + unseen, cap, share)  # (_past is looked at only there: most go NOW)
        if mine + unseen >= cap:
            return HOLD if self._past(*past) == TURN else BURST
        if me is not None and me.is_held:
            return self._past(*past)  # behind its own held requests
        g = groups.get(priority, (0.0, 0.0, 0.0, 0))
        trusted = not LEND_HISTORY or self._has_history(me, now)
        if mine < min(share, num + max(h_min, h)):
            return NOW if trusted or not by_share or not mine + unseen else FRESH  # (one request is no flood)
        if not trusted:
            return self._past(*past)  # (a flood's onset: not yet lent the quiet accounts' places)
        pool = min(g[0] + share, g[1] + min(share, num) + max(h_min, h * (g[3] + 1)))  # its class's quiet accounts' reservation
        return NOW if g[2] + mine < pool else self._past(*past)

    def _has_history(self, me: Demand | None, now: float) -> bool:
        """Active for window_s at least without a break: its average (and lending) can be trusted."""
        return me is not None and now - me.active_t >= self.window_s

    def _past(self, by_share: bool, me: Demand | None, now: float, mine: float, cap: float, share: float) -> int:
        """Past its reservation: BURST where the engines order by share and it is owed places, else TURN."""
        return BURST if by_share and SHARE_BURSTS and self._owed(me, now, mine, cap, share) else TURN

    def _owed(self, me: Demand | None, now: float, mine: float, cap: float, share: float) -> bool:
        """Past its reservation: whether the account, active for window_s at least, asked for fewer
        places (in flight + held) than its weighted `share` on average over about window_s (a quiet
        tenant, even mid-burst: it is owed the places a flood over its share holds), and holds fewer
        than one share past its cap (a burst is bounded). Not one just (re)started: a flood's onset."""
        if not self._has_history(me, now) or mine >= cap + share:
            return False
        return me.mean_at(now, self.window_s) < share

    def more_urgent_active(self, priority: int) -> bool:
        """An account of a class more urgent than `priority` is active (its reservation holds)."""
        return any(d.priority < priority for d in self._active(self.clock(), priority).values())

    def next_expiry(self) -> float | None:
        """When the next idle account stops being active (its reservation lapses), or None."""
        now = self.clock()
        floor = self._floor(now)
        return min((self._expiry(d, floor) for d in self._active(now).values() if not d.num_in_flight + d.num_remote and not d.is_held), default=None)
