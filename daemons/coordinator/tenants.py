"""The coordinator's tenant accounting: every API server's TenantUsage, summed.

Owns each tenant's cluster-wide figures (delivered tokens and requests per
second over the last WINDOW_S, requests in flight by API server), published to
every API server as TenantTotals once a second (their `cluster_usage`, for fair
shares, and /metrics). The limits themselves are held by the API servers, which
charge each other's usage as the coordinator forwards it; nothing here is on a
request's path, and a message costs a few dict updates.
"""

from __future__ import annotations

from dpserve.engine.common.protocol import TenantTotals, TenantUsage

WINDOW_S = 10.0  # rates are averaged over this long (an exponential window)
PUBLISH_EVERY_S = 1.0
ORIGIN_TTL_S = 3.0  # an API server unheard this long has nothing in flight
MAX_TENANTS = 4096  # names come from key files; a bound all the same


class TenantAccounts:
    def __init__(self) -> None:
        self.tokens: dict[str, float] = {}  # tenant -> decayed delivered tokens (a rate x WINDOW_S)
        self.requests: dict[str, float] = {}
        self.in_flight: dict[str, dict[str, tuple[int, float]]] = {}  # tenant -> origin -> (count, when)
        self.totals: dict[str, list[int]] = {}  # tenant -> [requests, delivered tokens] since the coordinator started
        self.t_decay = 0.0
        self.last_publish = 0.0

    def take(self, msg: TenantUsage, now: float) -> None:
        tokens, requests, in_flight, totals = self.tokens, self.requests, self.in_flight, self.totals
        for name, n_requests, _charged, delivered, flying in msg.usage:
            if name not in totals:
                if len(totals) >= MAX_TENANTS:
                    continue
                totals[name] = [0, 0]
                tokens[name] = requests[name] = 0.0
                in_flight[name] = {}
            t = totals[name]
            t[0] += n_requests
            t[1] += delivered
            tokens[name] += delivered
            requests[name] += n_requests
            in_flight[name][msg.origin] = (flying, now)

    def due(self, now: float) -> bool:
        return bool(self.totals) and now - self.last_publish >= PUBLISH_EVERY_S

    def publish(self, now: float) -> TenantTotals:
        """Each tenant's rates now; decays the windows (call once per PUBLISH_EVERY_S)."""
        self.last_publish = now
        elapsed = now - self.t_decay if self.t_decay else PUBLISH_EVERY_S
        self.t_decay = now
        keep = max(0.0, 1.0 - elapsed / WINDOW_S)
        out = []
        for name in self.totals:
            flying = 0
            for origin, (count, heard) in list(self.in_flight[name].items()):
                if now - heard > ORIGIN_TTL_S:
                    del self.in_flight[name][origin]
                else:
                    flying += count
            out.append((name, self.tokens[name] / WINDOW_S, self.requests[name] / WINDOW_S, flying))
            self.tokens[name] *= keep
            self.requests[name] *= keep
        return TenantTotals(out)

    def busiest(self, n: int = 5) -> list[tuple[str, float, float, int]]:
        """The tenants delivering most tokens now (for status)."""
        rows = [(name, self.tokens[name] / WINDOW_S, self.requests[name] / WINDOW_S,
                 sum(c for c, _ in self.in_flight[name].values())) for name in self.totals]
        return sorted(rows, key=lambda r: -r[1])[:n]
