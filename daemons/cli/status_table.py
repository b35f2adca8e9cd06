"""`dpserve status`: a node's /status JSON as tables a person reads in one glance.

Pure text from the JSON (no I/O), so the rendering is tested alone and the
table can never say something /status does not: the header's verdict is
/status's own `ready`/`reason`, which /readyz and the STATUS= line share.
"""

from __future__ import annotations

import time


def age(seconds: float | None) -> str:
    """12s, 4m05s, 3h12m, 2d04h: short and sortable by eye."""
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _dash(value) -> str:
    return "-" if value is None or value == "" else str(value)


def header(data: dict) -> list[str]:
    role = data.get("role", "serve")
    verdict = "ready" if data["ready"] else "NOT READY: " + data["reason"]
    where = f"node {data.get('node_rank', 0)} ({role})"
    if data.get("node_address"):
        where += f" {data['node_address']}"
    port = f"port {data['port']}" if data.get("port") else "no API server (headless)"
    lines = [
        f"{where}: {data['phase']}, {verdict}",
        f"model {data['model']}, {port}, health port {data.get('supervisor_port')}, pid {data['pid']}, "
        f"lb {data.get('lb_mode', 'internal')}, data-parallel-size {data['data_parallel_size']}",
    ]
    cluster = data.get("cluster")
    if cluster is not None:
        silent = age(time.time() - cluster["head_since"])
        if cluster["head_connected"]:
            head = "head connected"
        elif cluster.get("head_reached", True):  # an older supervisor's /status lacks the field
            head = f"HEAD LOST for {silent}"
        else:
            head = f"head not reached yet ({silent} since this node started)"
        parts = [f"{cluster['ranks_routable']}/{data['data_parallel_size']} ranks routable", f"{cluster['ranks_registered']} registered"]
        if cluster["ranks_lost"]:
            parts.append(f"{cluster['ranks_lost']} LOST")
        if cluster.get("ranks_drained"):
            parts.append(f"{cluster['ranks_drained']} drained")
        if cluster["ranks_absent"]:
            parts.append(f"{cluster['ranks_absent']} not started")
        if cluster.get("min_ready_ranks"):
            parts.append(f"min ready {cluster['min_ready_ranks']}")
        lines.append("cluster: " + ", ".join(parts) + f"; {head}")
    return lines


RANK_COLUMNS = f"{'RANK':>4} {'NODE':>4} {'ADDRESS':<16} {'STATE':<10} {'FOR':>7} {'RUN':>4} {'WAIT':>5} {'TOKENS':>7} {'KV':>6} {'SERVED':>7}  ROUTED BY / WHY"


def rank_rows(ranks: list[dict]) -> list[str]:
    lines = [RANK_COLUMNS]
    for r in ranks:
        active = r["state"] in ("ready", "registered")
        tokens = r["waiting_prefill_tokens"] + r["remaining_decode_tokens"]
        state = r["state"].upper() if r["state"] == "lost" else r["state"]
        mark = "*" if r.get("local") else " "
        note = r["routed_by"] if r["state"] not in ("lost", "drained") else (r.get("reason") or "out of routing")
        kv = f"{100 * r['kv_cache_usage_perc']:.1f}%" if active else "-"
        lines.append(
            f"{r['rank']:>3}{mark} {_dash(r['node']):>4} {_dash(r.get('address') or r['host'])[:16]:<16} {state:<10} {age(r['for_s']):>7} "
            f"{r['running'] if active else '-':>4} {r['waiting'] if active else '-':>5} {tokens if active else '-':>7} "
            f"{kv:>6} {r['requests_finished']:>7}  {note}"
        )
    return lines


CHILD_COLUMNS = f"{'CHILD':<14} {'STATE':<9} {'PID':>8} {'RESTARTS':>8} {'RUNNING':>8} {'WAITING':>8} {'KV USED':>8} {'UPTIME':>9}  LAST EXIT / ROUTES TO"


def child_rows(children: list[dict]) -> list[str]:
    lines = [CHILD_COLUMNS]
    for c in children:
        engine = c["kind"] == "engine"
        running = str(c["running"]) if engine else "-"
        waiting = str(c["waiting"]) if engine else "-"
        kv = f"{100 * c.get('kv_cache_usage_perc', 0.0):.1f}%" if engine else "-"
        note = c.get("drained") or c["last_exit"] or ""  # a drained child: why it stays stopped
        if not note and c["kind"] in ("engine", "placement") and (c.get("detail") or "").startswith(("ray node", "dpserve-")):
            note = c["detail"]  # Ray backend: the rank's Ray node and actor, the placement group's name
        if c.get("routes_to") is not None and not note:
            note = "ranks " + ",".join(str(r) for r in c["routes_to"])
        lines.append(
            f"{c['name']:<14} {c['state']:<9} {c['pid'] or '-':>8} {c['restarts']:>8} {running:>8} {waiting:>8} {kv:>8} "
            f"{c['uptime_s']:>8.1f}s  {note}"
        )
    return lines


TENANT_COLUMNS = f"{'TENANT':<20} {'TOKENS/S':>10} {'REQ/S':>8} {'IN FLIGHT':>9}"
MAX_TENANT_ROWS = 8


def tenant_rows(tenants: list[dict]) -> list[str]:
    """The busiest tenants across the cluster (the coordinator's 10 s window), most tokens first."""
    busiest = sorted(tenants, key=lambda t: (-t["tokens_per_s"], t["name"]))[:MAX_TENANT_ROWS]
    lines = [TENANT_COLUMNS]
    lines += [f"{t['name'][:20]:<20} {t['tokens_per_s']:>10.1f} {t['requests_per_s']:>8.2f} {t['in_flight']:>9}" for t in busiest]
    if len(tenants) > len(busiest):
        lines.append(f"({len(tenants) - len(busiest)} more tenants)")
    return lines


def tenants_from_metrics(text: str) -> list[dict]:
    """Tenants as an API server's /metrics states them (dpserve_tenant_cluster_* gauges)."""
    fields = {"dpserve_tenant_cluster_tokens_per_s": "tokens_per_s", "dpserve_tenant_cluster_requests_per_s": "requests_per_s",
              "dpserve_tenant_cluster_in_flight": "in_flight"}
    out: dict[str, dict] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{tenant=\"")
        if name not in fields or '"} ' not in rest:
            continue
        tenant, _, value = rest.partition('"} ')
        row = out.setdefault(tenant, {"name": tenant, "tokens_per_s": 0.0, "requests_per_s": 0.0, "in_flight": 0})
        row[fields[name]] = int(float(value)) if fields[name] == "in_flight" else float(value)
    return list(out.values())


def render(data: dict) -> str:
    """The whole screen: verdict, the cluster's ranks (* = on this node; ADDRESS: the
    node's address, or the engine's hostname on a single node), this node's children."""
    lines = header(data)
    cluster = data.get("cluster")
    if cluster is not None:
        lines += ["", *rank_rows(cluster["ranks"])]
    lines += ["", *child_rows(data["children"])]
    if data.get("tenants"):  # `dpserve status` adds them from an API server's /metrics
        lines += ["", *tenant_rows(data["tenants"])]
    return "\n".join(lines)
