"""Per-tenant figures on /metrics. The label set is bounded: the tenant names of
the key file (reloads add and remove them), never anything a client sends."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


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
        held = GaugeMetricFamily("dpserve_tenant_held", "Requests of each tenant held at this API server's frontend queue.", labels=labels)
        queue = CounterMetricFamily("dpserve_tenant_queue_seconds", "Time requests of each tenant were held before being sent.", labels=labels)
        cluster = GaugeMetricFamily("dpserve_tenant_cluster_tokens_per_s",
                                    "Each tenant's delivered tokens per second across the cluster (the coordinator's 10 s window).", labels=["tenant"])
        for name, st in self.gate.limits.states.items():
            lab = [idx, name]
            requests.add_metric(lab, st.num_requests)
            tokens.add_metric([*lab, "prompt"], st.num_prompt_tokens)
            tokens.add_metric([*lab, "completion"], st.num_completion_tokens)
            for limit, n in st.num_limited.items():
                limited.add_metric([*lab, limit], n)
            in_flight.add_metric(lab, st.in_flight)
            held.add_metric(lab, st.held)
            queue.add_metric(lab, st.queue_s_sum)
            cluster.add_metric([name], self.sync.cluster_usage(name))
        yield from (requests, tokens, limited, in_flight, held, queue, cluster)
