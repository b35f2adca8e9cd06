#!/usr/bin/env python3
"""Cluster size: the real coordinator and API servers on simulated ranks (issue 19).

    python benchmarks/cluster_bench.py [--ranks 256] [--api-servers 32] [--ranks-per-process 32]
                                       [--coordinator-ranks 1024] [--quick] [--json]

Part 1, a cluster: RANKS simulated ranks (dpserve.engine.testing.sim, many ranks per
process, no model) x API-SERVERS real API servers on one port, the real
coordinator. Measured: seconds from start until every API server sees every
rank alive (registered) and routable; CPU of the coordinator and of the API
servers at rest and under a closed-loop load (benchmarks/load.py); API-server
CPU per request; and the time until every API server has stopped routing to
a lost rank, for a SIGKILLed rank (only silence tells: the coordinator's
stale limit) and a SIGTERMed one (it announces its death).

Part 2, the coordinator alone at COORDINATOR-RANKS ranks reporting every
100 ms to 32 table subscribers: CPU, messages and bytes published per second,
with reports that repeat the load (a quiet cluster) and with every report a
change (a busy one).

Part 3, membership: 4 simulated ranks join a running 4-rank cluster (8 slots, as
--data-parallel-size-max 8) under a streamed load; the time until every API
server routes to them after they were ready; then they retire under the load
(announced death, then the retired RankDown a supervisor sends), and the load's
errors across both.

Figures are printed, never asserted. Everything runs on loopback / ipc and
every process is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from pathlib import Path

import zmq

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.daemons.config import NODE_LINKS_FROM_RANKS, RANK_LINKS  # noqa: E402
from dpserve.engine.common.codec import Codec  # noqa: E402
from dpserve.engine.common.protocol import LoadTable, PrefixRouted, TableChannel  # noqa: E402

from benchmarks.cluster_membership import part_membership  # noqa: E402
from benchmarks.load import LoadConfig, run_load  # noqa: E402
from benchmarks.simcluster import SimCluster, probe_json  # noqa: E402


def cpu_window(cluster: SimCluster, seconds: float, during=None) -> dict:
    """CPU share of one core per component over a window (during() runs in it, if given)."""
    names = ("coordinator", "api-", "sim-", "relay")
    before = {n: cluster.cpu(n) for n in names}
    per_api_before = [cluster.cpu(f"api-{i}") for i in range(cluster.num_api_servers)]
    t0 = time.monotonic()
    result = during() if during is not None else time.sleep(seconds)
    wall = time.monotonic() - t0
    after = {n: cluster.cpu(n) for n in names}
    per_api = [cluster.cpu(f"api-{i}") - b for i, b in enumerate(per_api_before)]
    return {
        "wall_s": wall,
        "coordinator_pct": 100 * (after["coordinator"] - before["coordinator"]) / wall,
        "api_total_pct": 100 * (after["api-"] - before["api-"]) / wall,
        "api_max_pct": 100 * max(per_api, default=0.0) / wall,
        "api_cpu_s": after["api-"] - before["api-"],
        "sims_pct": 100 * (after["sim-"] - before["sim-"]) / wall,
        "relay_pct": 100 * (after["relay"] - before["relay"]) / wall,
        "loadavg": Path("/proc/loadavg").read_text().split()[0],
        "result": result,
    }


PROBE_EVERY_S = 0.25  # wait_all's round of /readyz probes: the start's figures are this coarse


def wait_all(cluster: SimCluster, expected: int, timeout: float) -> tuple[float, float, float]:
    """Seconds from start until every API server has reported ready (its imports
    and startup), sees every rank alive, and routes to every rank. An API server is
    probed only until it routes every rank (each probe is a JSON of every rank: probing
    32 servers every 50 ms was a good part of the start's CPU on a loaded machine),
    and all are probed once more at the end, which must still find them all routable."""
    deadline = time.monotonic() + timeout
    t_ready = None
    names = {f"api-{i}" for i in range(cluster.num_api_servers)}
    alive_at: dict[int, float] = {}
    routable_at: dict[int, float] = {}
    counts: dict[int, int] = {}
    while time.monotonic() < deadline:
        cluster.check_alive()
        if t_ready is None and names <= cluster.collect_ready():
            t_ready = time.monotonic() - cluster.started_at
        for i in range(cluster.num_api_servers):
            if i in routable_at:
                continue
            try:
                body = probe_json(cluster.probe_path(i))
            except Exception:
                counts[i] = -1
                continue
            now = time.monotonic() - cluster.started_at
            counts[i] = len(body["routable_ranks"])
            if len(body["alive_ranks"]) == expected:
                alive_at.setdefault(i, now)
            if counts[i] == expected:
                routable_at[i] = now
        if len(routable_at) == cluster.num_api_servers:
            done = max(routable_at.values())
            print(f"all {len(routable_at)} API servers routed every rank by {done:.1f} s; confirming", file=sys.stderr, flush=True)
            lost = [i for i in routable_at if _routable(cluster, i) not in (expected, None)]
            if not lost:
                return t_ready or done, max(alive_at.values(), default=done), done
            for i in lost:  # one lost a rank again: measure on
                routable_at.pop(i)
        # Each /readyz lists every rank three times: 32 API servers probed every 0.1 s took
        # more of their CPU than the start itself once they were ready early (issue 30, fifth round).
        time.sleep(PROBE_EVERY_S)
    raise TimeoutError(f"not all routable after {timeout} s: {[counts.get(i) for i in range(cluster.num_api_servers)]}")


def _routable(cluster: SimCluster, i: int) -> int | None:
    """How many ranks API server `i` routes to (None: it did not answer within the probe's timeout)."""
    try:
        return len(probe_json(cluster.probe_path(i), timeout=20.0)["routable_ranks"])
    except (OSError, TimeoutError):
        return None


def time_to_drop(cluster: SimCluster, name: str, sig: int, expected: int, timeout: float) -> tuple[float, float]:
    """Seconds from the signal until (1) the coordinator published the rank as down
    (a subscriber of the table, as every API server is: this is the detection) and
    (2) a sweep over every API server's probe found none routing to it (the sweep,
    tens of ms a server on a busy node, adds up to its own length to the second; an
    API server is probed until it is seen without the rank; NaN: not all within `timeout`)."""
    ranks = {int(r) for r in name.split("-")[1:2]}
    codec = Codec(TableChannel)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(cluster.table_address)
    published: list[float] = []

    def watch() -> None:
        while not published and time.monotonic() - t0 < timeout:
            if sub.poll(100):
                table = codec.decode_or_none(sub.recv())
                if type(table) is LoadTable and any(e.rank in ranks and not e.is_alive for e in table.ranks):
                    published.append(time.monotonic() - t0)

    time.sleep(0.3)  # the subscription is up
    t0 = time.monotonic()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cluster.kill(name, sig)
    deadline = t0 + timeout
    left = set(range(cluster.num_api_servers))  # API servers not yet seen without the rank (a dead rank never returns)
    try:
        while left and time.monotonic() < deadline:
            left -= {i for i in list(left) if _routable(cluster, i) == expected}
            time.sleep(0.02)
        swept = time.monotonic() - t0 if not left else float("nan")
        if left:
            print(f"{name}: API servers {sorted(left)} still route to it (or never answered) after {timeout} s", file=sys.stderr)
        watcher.join(max(0.0, deadline - time.monotonic()))
        return (published or [float("nan")])[0], swept
    finally:
        sub.close(0)


def part_cluster(args) -> dict:
    cluster = SimCluster(
        args.ranks, args.api_servers, args.ranks_per_process, num_alone=2,
        report_interval_s=args.report_interval_s, stale_after_s=args.stale_after_s, prefork=args.launch == "prefork",
        ranks_per_node=args.ranks_per_node, node_heartbeat_s=args.node_heartbeat_s, monitors=args.sim_monitors,
        rank_links=rank_links(args, args.ranks),
    )
    out: dict = {"rank_links": rank_links(args, args.ranks), "sim_monitors": args.sim_monitors, "launch": args.launch, "ranks": args.ranks, "api_servers": args.api_servers, "ranks_per_process": args.ranks_per_process,
                 "sim_processes": 0, "report_interval_s": args.report_interval_s, "stale_after_s": args.stale_after_s}
    with cluster:
        out["sim_processes"] = len(cluster.sim_procs)
        out["api_ready_s"], out["registered_s"], out["routable_s"] = wait_all(cluster, args.ranks, timeout=300)
        time.sleep(2.0)  # settle
        out["rest"] = cpu_window(cluster, args.window)
        out["memory"] = memory(cluster, args.ranks)
        cfg = LoadConfig(url=f"http://127.0.0.1:{cluster.port}", model="sim", concurrency=args.concurrency,
                         duration=args.window, warmup=1.0, max_tokens=16)
        table = Subscribers(cluster.table_address, 1, count_entries=True)
        try:
            load = cpu_window(cluster, args.window, lambda: asyncio.run(run_load(cfg)))
        finally:
            table.close()
        res = load.pop("result")
        load.update(tables_per_s=table.messages / load["wall_s"], entries_per_s=table.entries / load["wall_s"],
                    table_kib_per_s=table.bytes / load["wall_s"] / 1024)
        load.update(ok=res.ok, errors=sum(res.errors.values()), req_per_s=res.req_per_s,
                    ranks_used=len(res.per_rank), p50_ms=res.latency_ms.get("p50"), p99_ms=res.latency_ms.get("p99"))
        # API-server CPU per request over the whole window (warm-up included in both)
        load["api_cpu_us_per_request"] = 1e6 * load["api_cpu_s"] / max(1, res.requests + res.warmup_requests)
        out["load"] = load
        out["rest"].pop("result")
        lone_kill, lone_term = cluster.sim_procs[-2], cluster.sim_procs[-1]
        out["lost_sigkill_s"], out["lost_sigkill_swept_s"] = time_to_drop(cluster, lone_kill, signal.SIGKILL, args.ranks - 1, 60)
        out["lost_sigterm_s"], out["lost_sigterm_swept_s"] = time_to_drop(cluster, lone_term, signal.SIGTERM, args.ranks - 2, 60)
    return out


class Subscribers:
    """N SUB sockets on the load table, drained by one thread: messages and bytes seen."""

    def __init__(self, address: str, n: int, count_entries: bool = False) -> None:
        self.count_entries = count_entries
        self.entries = 0
        self.codec = Codec(TableChannel)
        self.ctx = zmq.Context()
        self.socks = []
        for _ in range(n):
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(address)
            self.socks.append(s)
        self.messages = 0
        self.bytes = 0
        self.largest = 0
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        while not self.stop:
            for s, _ in poller.poll(100):
                while True:
                    try:
                        data = s.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.messages += 1
                    self.bytes += len(data)
                    self.largest = max(self.largest, len(data))
                    if self.count_entries and type(msg := self.codec.decode(data)) is not PrefixRouted:
                        self.entries += len(msg.ranks)

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.ctx.destroy(linger=0)


def memory(cluster: SimCluster, ranks: int) -> dict:
    """Resident memory: each API server's (mean, max), the coordinator's, and the simulated ranks' per rank."""
    api = cluster.rss_mib("api-")
    return {"api_server_mean_mib": sum(api) / max(1, len(api)), "api_server_max_mib": max(api, default=0.0),
            "coordinator_mib": sum(cluster.rss_mib("coordinator")), "sim_per_rank_mib": sum(cluster.rss_mib("sim-")) / ranks}


def part_coordinator(args, vary: bool, relay: bool = False) -> dict:
    n = args.coordinator_ranks
    interval = args.coordinator_report_interval_s
    cluster = SimCluster(n, 0, args.coordinator_ranks_per_process, report_interval_s=interval, stale_after_s=3 * interval + 1,
                         vary_load=vary, ranks_per_node=args.ranks_per_node, node_heartbeat_s=args.node_heartbeat_s)
    with cluster:
        # 32 API servers' subscriptions: on the head's table directly, or on one node relay of it
        local = cluster.start_table_relay() if relay else cluster.table_address
        subs = Subscribers(local, 32)
        head = Subscribers(cluster.table_address, 1) if relay else subs  # what the head sends one subscriber
        try:
            start = time.monotonic()
            # registered: every rank in the table the subscribers see (count distinct alive ranks)
            seen: dict[int, bool] = {}
            probe = zmq.Context.instance().socket(zmq.SUB)
            probe.setsockopt(zmq.SUBSCRIBE, b"")
            probe.connect(cluster.table_address)
            codec = Codec(TableChannel)
            deadline = start + 120
            while sum(seen.values()) < n and time.monotonic() < deadline:
                cluster.check_alive()
                if probe.poll(200) and type(table := codec.decode(probe.recv())) is LoadTable:
                    for e in table.ranks:
                        seen[e.rank] = e.is_alive
            registered_s = time.monotonic() - cluster.started_at
            probe.close(0)
            time.sleep(2.0)
            m0, b0, h0 = subs.messages, subs.bytes, head.bytes
            w = cpu_window(cluster, args.window)
            w.pop("result")
            return {
                "ranks": n, "subscribers": 32, "table_relay": relay, "every_report_a_change": vary, "all_alive_s": registered_s,
                "coordinator_pct": w["coordinator_pct"], "relay_pct": w["relay_pct"], "sims_pct": w["sims_pct"],
                "loadavg": w["loadavg"], "nodes": n // max(1, args.ranks_per_node) if args.ranks_per_node else None,
                "published_msgs_per_s": (subs.messages - m0) / w["wall_s"],
                # what the head sends: to the 32 subscribers, or once to the relay (the probe `head` counts it)
                "published_kib_per_s": (head.bytes - h0) / w["wall_s"] / 1024,
                "delivered_kib_per_s": (subs.bytes - b0) / w["wall_s"] / 1024,
                "largest_message_bytes": subs.largest,
                "reports_per_s": n / interval, "report_interval_s": interval, "node_heartbeat_s": cluster.node_heartbeat_s,
                "coordinator_mib": sum(cluster.rss_mib("coordinator")),
            }
        finally:
            subs.close()
            if head is not subs:
                head.close()


def rank_links(args, ranks: int) -> str:
    """--rank-links resolved for a cluster of `ranks`, as dpserve resolves its own (ServeConfig.node_hops)."""
    if args.rank_links == "auto":
        return "node" if ranks >= NODE_LINKS_FROM_RANKS else "direct"
    return args.rank_links


def part_memory(args) -> dict:
    """One API server's RSS with few ranks and with many (each connected and routable):
    the growth is what the per-rank state costs it (the issue's target: < 50 MiB from 8 to 4,096)."""
    out: dict = {}
    for n in (8, args.memory_ranks):
        cluster = SimCluster(n, 1, 256, report_interval_s=0.5, stale_after_s=3.0, ranks_per_node=args.ranks_per_node,
                             rank_links=rank_links(args, n))
        with cluster:
            cluster.wait_routable(n, timeout=300, interval=0.5)
            time.sleep(2.0)
            out[str(n)] = {**memory(cluster, n), "loadavg": Path("/proc/loadavg").read_text().split()[0]}
    small, big = out["8"], out[str(args.memory_ranks)]
    out["api_server_growth_mib"] = big["api_server_max_mib"] - small["api_server_max_mib"]
    out["api_server_per_rank_kib"] = 1024 * out["api_server_growth_mib"] / (args.memory_ranks - 8)
    out["rank_links"] = {n: rank_links(args, int(n)) for n in ("8", str(args.memory_ranks))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--api-servers", type=int, default=32)
    ap.add_argument("--ranks-per-process", type=int, default=32)
    ap.add_argument("--report-interval-s", type=float, default=0.1)
    ap.add_argument("--stale-after-s", type=float, default=1.5, help="the coordinator's silence limit (interval x threshold)")
    ap.add_argument("--launch", choices=["prefork", "exec"], default="prefork",
                    help="API servers forked from dpserve's launcher (serve's default) or each exec'd")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--coordinator-ranks", type=int, default=1024)
    ap.add_argument("--coordinator-ranks-per-process", type=int, default=512)
    ap.add_argument("--ranks-per-node", type=int, default=8, help="simulated nodes: each node's relay sends one NodeLoad an interval")
    ap.add_argument("--node-heartbeat-s", type=float, default=None,
                    help="a node's heartbeat when no load changed (default: stale limit / 4; the report interval: one message a node an interval)")
    ap.add_argument("--table-relay", action="store_true", help="also measure the coordinator with a node relay of the table")
    ap.add_argument("--coordinator-report-interval-s", type=float, default=0.1)
    ap.add_argument("--memory-ranks", type=int, default=4096, help="the memory part: one API server with 8 ranks, then with this many")
    ap.add_argument("--rank-links", choices=RANK_LINKS, default="auto",
                    help="node: each simulated node's ranks reach an API server through one connection (dpserve --rank-links "
                    f"node); auto: as dpserve, node from {NODE_LINKS_FROM_RANKS} ranks")
    ap.add_argument("--sim-monitors", action="store_true",
                    help="simulated ranks keep a connection monitor each (off by default: ~1 inproc pair a connection)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: cluster, coordinator, membership, memory")
    ap.add_argument("--quick", action="store_true", help="64 ranks x 4 API servers, 256-rank coordinator, 3 s windows")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.api_servers, args.coordinator_ranks, args.window = 64, 4, 256, 3.0
    skip = set(filter(None, args.skip.split(",")))
    results: dict = {}
    if "cluster" not in skip:
        results["cluster"] = part_cluster(args)
        print(json.dumps(results["cluster"], indent=1), file=sys.stderr, flush=True)
    if "coordinator" not in skip:
        runs = [(vary, False) for vary in (False, True)] + ([(True, True)] if args.table_relay else [])
        results["coordinator"] = [part_coordinator(args, vary, relay) for vary, relay in runs]
        print(json.dumps(results["coordinator"], indent=1), file=sys.stderr, flush=True)
    if "membership" not in skip:
        results["membership"] = part_membership(args)
        print(json.dumps(results["membership"], indent=1), file=sys.stderr, flush=True)
    if "memory" not in skip:
        results["memory"] = part_memory(args)
        print(json.dumps(results["memory"], indent=1), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_report(results, args)
    return 0


def print_report(results: dict, args) -> None:
    """The results as Markdown tables."""
    if "cluster" in results:
        c = results["cluster"]
        r, ld = c["rest"], c["load"]
        print(f"## {c['ranks']} simulated ranks ({c['sim_processes']} processes) x {c['api_servers']} API servers, "
              f"reports every {c['report_interval_s']} s, stale limit {c['stale_after_s']} s\n")
        print("| measure | value |\n|---|---|")
        print(f"| start -> every API server ready ({c['launch']}) | {c['api_ready_s']:.1f} s |")
        print(f"| start -> every rank alive in every API server's table | {c['registered_s']:.1f} s |")
        print(f"| start -> every rank routable in every API server | {c['routable_s']:.1f} s |")
        print(f"| at rest: coordinator / all API servers / busiest API server | {r['coordinator_pct']:.1f}% / {r['api_total_pct']:.1f}% / {r['api_max_pct']:.1f}% of a core |")
        print(f"| at rest: simulated ranks (all processes) | {r['sims_pct']:.1f}% of a core (load average {r['loadavg']}) |")
        mem = c["memory"]
        print(f"| RSS: API server mean / max, coordinator, simulated rank | {mem['api_server_mean_mib']:.0f} / {mem['api_server_max_mib']:.0f} MiB, "
              f"{mem['coordinator_mib']:.0f} MiB, {mem['sim_per_rank_mib']:.2f} MiB |")
        print(f"| load: {ld['req_per_s']:.0f} req/s ({ld['ok']} ok, {ld['errors']} errors, {ld['ranks_used']} ranks used), p50 {ld['p50_ms']:.0f} ms, p99 {ld['p99_ms']:.0f} ms | |")
        print(f"| under load: coordinator / all API servers / busiest API server | {ld['coordinator_pct']:.1f}% / {ld['api_total_pct']:.1f}% / {ld['api_max_pct']:.1f}% of a core |")
        print(f"| API-server CPU per request (everything, not only routing) | {ld['api_cpu_us_per_request']:.0f} us |")
        print(f"| under load: tables to each API server | {ld['tables_per_s']:,.0f} msg/s, {ld['entries_per_s']:,.0f} rank entries/s, {ld['table_kib_per_s']:,.0f} KiB/s |")
        print(f"| under load: simulated ranks' processes | {ld['sims_pct']:.1f}% of a core |")
        for how, key in (("SIGKILL, silent", "sigkill"), ("SIGTERM, announced", "sigterm")):
            print(f"| lost rank ({how}): published as down to every API server / a probe sweep finds it out of all | "
                  f"{c[f'lost_{key}_s']:.2f} s / {c[f'lost_{key}_swept_s']:.2f} s |")
    if "membership" in results:
        m = results["membership"]
        print(f"\n## {m['ranks_joining']} simulated ranks join a running {m['ranks_before']}-rank cluster under load, then retire\n")
        print("| measure | value |\n|---|---|")
        print(f"| joined: routable in all {m['api_servers']} API servers after the ranks were ready / after their process started | "
              f"{m['join_routable_after_ready_s']:.2f} s / {m['join_routable_after_start_s']:.2f} s |")
        print(f"| retired (SIGTERM + RankDown 'retired'): out of every API server's routing | {m['retire_out_of_routing_s']:.2f} s |")
        print(f"| streamed requests across both (32 clients, 64 tokens) | {m['ok']} ok, {m['errors']} errors {m['error_kinds'] or ''} |")
    if "memory" in results:
        m = results["memory"]
        print(f"\n## memory: one API server with 8 ranks, then {args.memory_ranks}\n")
        print(f"API server RSS grew {m['api_server_growth_mib']:.1f} MiB ({m['api_server_per_rank_kib']:.1f} KiB a rank)")
    for row in results.get("coordinator", []):
        kind = "every report a change" if row["every_report_a_change"] else "reports repeat the load"
        via = " through one node table relay" if row["table_relay"] else ""
        print(f"\n## coordinator: {row['ranks']} ranks ({row['nodes']} nodes) reporting every {row['report_interval_s'] * 1000:.0f} ms "
              f"({kind}), 32 table subscribers{via} (load average {row['loadavg']})\n")
        print("| measure | value |\n|---|---|")
        print(f"| reports in | {row['reports_per_s']:,.0f}/s |")
        print(f"| coordinator CPU | {row['coordinator_pct']:.1f}% of a core (relay {row['relay_pct']:.1f}%) |")
        print(f"| tables out of the coordinator | {row['published_kib_per_s']:,.0f} KiB/s |")
        print(f"| tables into the 32 subscribers | {row['published_msgs_per_s']:,.0f} msg/s, {row['delivered_kib_per_s']:,.0f} KiB/s |")
        print(f"| coordinator RSS | {row['coordinator_mib']:.0f} MiB |")
        print(f"| largest table message | {row['largest_message_bytes']:,} B |")
        print(f"| start -> all ranks alive in the table | {row['all_alive_s']:.1f} s |")


if __name__ == "__main__":
    sys.exit(main())
