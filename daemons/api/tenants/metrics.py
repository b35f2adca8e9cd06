"""Per-tenant figures on /metrics: limits and usage (TenantCollector), held-queue depth and time (AdmissionCollector, of
admission.py's figures). The label set is bounded: the tenant names of the key file (reloads add and remove them), never
anything a client sends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpserve.daemons.api.held import HELD_SECONDS_BUCKETS
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from dpserve.daemons.api.admission import Admission


class TenantCollector:
    def __init__(self, gate, sync, index: int) -> None:
        self.gate, self.sync, self.index = gate, sync, str(index)

    def collect(self):
        idx = self.index
        labels = ["api_server", "tenant"]
        requests = CounterMetricFamily("dpserve_tenant_requests", "Requests admitted per tenant by this API server.", labels=labels)
        tokens = CounterMetricFamily("dpserve_tenant_tokens", "Tokens per tenant served through this API server (prompt, completion).",
                                     labels=[*labels, "kind"])
        limited = CounterMetricFamily("dpserve_tenant_rate_limited", "Requests refused with 429 per tenant and limit by this API server.",
                                      labels=[*labels, "limit"])
        in_flight = GaugeMetricFamily("dpserve_tenant_in_flight", "Requests of each tenant in flight on this API server.", labels=labels)
        cluster = GaugeMetricFamily("dpserve_tenant_cluster_tokens_per_s",
                                    "Each tenant's delivered tokens per second across the cluster (the coordinator's 10 s window).", labels=["tenant"])
        cluster_rps = GaugeMetricFamily("dpserve_tenant_cluster_requests_per_s", "Each tenant's admitted requests per second across the cluster.", labels=["tenant"])
        cluster_flying = GaugeMetricFamily("dpserve_tenant_cluster_in_flight", "Each tenant's requests in flight across the cluster.", labels=["tenant"])
        for name, st in self.gate.limits.states.items():
            lab = [idx, name]
            requests.add_metric(lab, st.num_requests)
            tokens.add_metric([*lab, "prompt"], st.num_prompt_tokens)
            tokens.add_metric([*lab, "completion"], st.num_completion_tokens)
            for limit, n in st.num_limited.items():
                limited.add_metric([*lab, limit], n)
            in_flight.add_metric(lab, st.in_flight)
            tps, rps, flying = self.sync.cluster.get(name, (0.0, 0.0, 0))
            cluster.add_metric([name], tps)
            cluster_rps.add_metric([name], rps)
            cluster_flying.add_metric([name], flying)
        yield from (requests, tokens, limited, in_flight, cluster, cluster_rps, cluster_flying)


class AdmissionCollector:
    """Admission's figures on /metrics, per tenant (the key file's names: a bounded set)."""

    def __init__(self, admission: Admission, index: int) -> None:
        self.admission, self.index = admission, str(index)

    def collect(self):
        labels = ["api_server", "tenant"]
        depth = GaugeMetricFamily("dpserve_api_admission_held_requests", "Requests held now at this API server (every rank full).", labels=labels)
        held = CounterMetricFamily("dpserve_api_admission_held", "Requests that were held before a rank had room.", labels=labels)
        refused = CounterMetricFamily("dpserve_api_admission_refused", "Requests refused (429): their tenant's held queue was full.", labels=labels)
        gone = CounterMetricFamily("dpserve_api_admission_abandoned", "Held requests whose clients went away.", labels=labels)
        wait = HistogramMetricFamily("dpserve_api_admission_held_seconds", "Time held before release, of released requests.", labels=labels)
        for name, s in self.admission.stats.items():
            label = [self.index, name]
            depth.add_metric(label, s.num_held)
            held.add_metric(label, s.num_held_total)
            refused.add_metric(label, s.num_refused)
            gone.add_metric(label, s.num_abandoned)
            cumulative, total = [], 0
            for bound, n in zip((*map(str, HELD_SECONDS_BUCKETS), "+Inf"), s.buckets):
                total += n
                cumulative.append((bound, total))
            wait.add_metric(label, cumulative, s.held_seconds)
        yield from (depth, held, refused, gone, wait)
