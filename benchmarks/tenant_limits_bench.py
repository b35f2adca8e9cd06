"""Tenant limits across API servers, and what the coordinator pays for them (issue 28).

    .venv/bin/python benchmarks/tenant_limits_bench.py [--part overhead|limits|coordinator|all] [--json]

Part 1 (limits): the real coordinator and 4 API servers sharing one port on
simulated ranks (benchmarks/simcluster.py), a tenants file whose tenant "capped"
may use --tokens-per-min T. --clients connections (spread over the 4 API
servers by the kernel) send as fast as they are let, each 429 answered by a
short pause. Measured: the tokens (prompt + completion, from usage) served in
the window after the bucket's starting burst, per minute, against T. The same
limit held by each API server alone would let through about 4 T.

Part 1b (nodes): the same limit over 4 API servers on 2 nodes, as the issue asks it:
a head and a worker in network namespaces (tests/multinode/netns.py; needs root),
one rank (the demo model) and 2 API servers each (`--api-servers-on-every-node`),
one tenants file; --clients connections inside each node's namespace to its own
node's port, started together. The head's coordinator forwards each API server's
use to the other three, the worker's through the network.

Part 0 (overhead, in process): what the plain path (one key, no tenants file)
pays per request for tenants (a dict set in the middleware, two ContextVar
reads in sampling and run), and what a tenants file's path pays (sha256 of the
key, a compare per tenant, buckets, settle), against ~420 us of API CPU a
request (RESULTS.md section 4).

Part 2 (coordinator): the coordinator at --ranks simulated ranks reporting every
0.1 s and 32 table subscribers, with and without 32 API servers' TenantUsage
reports (each every 0.25 s, sync.FLUSH_S, --tenants tenants in each: what busy API servers
send at most). Measured: the coordinator's CPU (share of one core) in
alternating windows; the difference is what tenant accounting adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpserve.daemons.api.tenants.sync import FLUSH_S  # noqa: E402
from dpserve.engine.common.codec import Codec
from dpserve.engine.common.protocol import CoordinatorInput, TenantUsage  # noqa: E402

from benchmarks.cluster_bench import Subscribers  # noqa: E402
from benchmarks.common import begin, parser  # noqa: E402
from benchmarks.simcluster import SimCluster  # noqa: E402

KEY = "sk-bench-capped-0001"


async def _offer(url: str, clients: int, seconds: float, max_tokens: int, model: str = "sim",
                 start_at: float = 0.0) -> list[tuple[float, int, int]]:
    """(time, status, tokens) of every answer while `clients` loops send as fast as allowed
    (from `start_at` on the monotonic clock, which network namespaces share, when given)."""
    import aiohttp

    out: list[tuple[float, int, int]] = []
    body = {"model": model, "prompt": "hello there " * 8, "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {KEY}"}
    if start_at:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    deadline = time.monotonic() + seconds

    async def loop(session) -> None:
        while time.monotonic() < deadline:
            async with session.post(url + "/completions", json=body, headers=headers) as resp:
                data = await resp.json()
                tokens = data["usage"]["total_tokens"] if resp.status == 200 else 0
                out.append((time.monotonic(), resp.status, tokens))
            if resp.status == 429:
                await asyncio.sleep(0.05)

    # one connection per client, kept alive: the port's accept spreads them over the API servers
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(loop(session) for _ in range(clients)))
    return out


def part_overhead(args, run) -> dict:
    import timeit

    from dpserve.daemons.api.tenants import DEFAULT_TENANT, Tenant
    from dpserve.daemons.api.tenants.gate import CALL, TenantGate
    from dpserve.daemons.api.tenants.keyfile import parse_tenants

    request: dict = {}

    def plain() -> None:  # what auth_middleware, sampling() and run() add on the plain path
        request["tenant"] = DEFAULT_TENANT
        CALL.get()
        CALL.get()

    n = 200_000
    out = {"plain_path_us": min(timeit.repeat(plain, number=n, repeat=5)) / n * 1e6}
    for tenants in (1, 100):
        text = "".join(f'[tenants.t{i}]\nkey = "sk-key-{i:06d}"\ntokens_per_min = 100000000\nrequests_per_s = 1000000\n' for i in range(tenants))
        gate = TenantGate("<bench>", parse_tenants(text), None)
        header = f"Bearer sk-key-{tenants - 1:06d}".encode()

        def tenant_path(gate=gate, header=header) -> None:  # authenticate, admit, reserve, settle
            call = gate.admit(gate.authenticate(header))
            token = CALL.set(call)
            call.limits.reserve(call.st, 20, 16)
            call.prompt, call.completion = 20, 16
            CALL.reset(token)
            call.finish()

        m = 20_000
        out[f"tenants_{tenants}_path_us"] = min(timeit.repeat(tenant_path, number=m, repeat=5)) / m * 1e6
    assert Tenant("x").weight == 1.0
    run.log("per request: plain path +{plain_path_us:.3f} us; tenants file, 1 tenant {tenants_1_path_us:.2f} us, "
            "100 tenants {tenants_100_path_us:.2f} us".format(**out))
    return out


def _tenants_file(tokens_per_min: int) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="tenant-bench-"), "tenants.toml")
    Path(path).write_text(f'[tenants.capped]\nkey = "{KEY}"\ntokens_per_min = {tokens_per_min}\n')
    return path


def part_limits(args, run) -> dict:
    path = _tenants_file(args.tokens_per_min)
    cluster = SimCluster(8, 4, 8, api_options={"tenants_file": path}, report_interval_s=0.1)
    with cluster:
        cluster.wait_routable(8, timeout=60)
        time.sleep(1.0)
        t0 = time.monotonic()
        answers = asyncio.run(_offer(cluster.url, args.clients, args.seconds, args.max_tokens))
    return _served(args, run, answers, t0, "4 API servers")


def part_nodes(args, run) -> dict:
    from benchmarks.common import ensure_demo_model
    from tests.multinode.netns import Network, available
    from tests.multinode.test_multinode import API_PORT
    from tests.multinode.test_tenants_multinode import TwoSmallNodes  # a head and a worker, one rank each

    reason = available()
    if reason:
        run.log(f"nodes: skipped ({reason})")
        return {"skipped": reason}
    path = _tenants_file(args.tokens_per_min)
    tmp = Path(tempfile.mkdtemp(prefix="tenant-bench-nodes-"))
    key_file = tmp / "dp.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    key_file.chmod(0o600)
    flags = ["--api-servers-on-every-node", "--api-server-count", "2", "--api-key-file", path, "--max-model-len", "128"]
    net = Network()
    try:
        dep = TwoSmallNodes(net, ensure_demo_model(), str(key_file), tmp, flags, worker_headless=False)
        dep.start_head()
        dep.start_worker()
        dep.wait_ready(dep.head)
        dep.wait_ready(dep.worker)
        time.sleep(1.0)
        t0 = time.monotonic() + 3.0  # both clients start then (their interpreters load first)
        clients = [node.spawn([sys.executable, __file__, "--client-url", f"http://{node.address}:{API_PORT}/v1",
                               "--start-at", str(t0), "--seconds", str(args.seconds), "--clients", str(args.clients),
                               "--max-tokens", str(args.max_tokens)], str(tmp / f"client-{node.name}.json"))
                   for node in (dep.head, dep.worker)]
        for proc in clients:
            proc.wait(args.seconds + 120)
        answers, by_node = [], {}
        for node in (dep.head, dep.worker):
            got = [tuple(a) for a in json.loads((tmp / f"client-{node.name}.json").read_text().splitlines()[-1])]
            by_node[node.name] = sum(tok for _, code, tok in got if code == 200)
            answers += got
    finally:
        net.close()
    out = _served(args, run, answers, t0, "4 API servers on 2 nodes")
    out["tokens_by_node"] = by_node
    run.log(f"tokens served by each node's API servers (whole run): {by_node}")
    return out


def _served(args, run, answers: list, t0: float, where: str) -> dict:
    start, end = t0 + args.warmup_s, t0 + args.seconds
    served = sum(tok for t, code, tok in answers if start <= t < end)
    per_min = served * 60.0 / (end - start)
    codes = {}
    for _, code, _ in answers:
        codes[code] = codes.get(code, 0) + 1
    result = {"tokens_per_min_limit": args.tokens_per_min, "served_tokens_per_min": per_min,
              "error_pct": 100 * (per_min - args.tokens_per_min) / args.tokens_per_min,
              "window_s": end - start, "answers": codes, "api_servers": 4, "clients": args.clients}
    run.log(f"limit {args.tokens_per_min} tokens/min over {where}: served {per_min:.0f}/min "
            f"({result['error_pct']:+.1f}%) over {end - start:.0f} s; answers {codes}")
    return result


class UsageSenders:
    """`n` API servers' TenantUsage reports to the coordinator, every FLUSH_S each (their most)."""

    def __init__(self, address: str, n: int, tenants: int) -> None:
        self.ctx = zmq.Context()
        self.socks = []
        for i in range(n):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, f"api-bench-{i}".encode())
            s.connect(address)
            self.socks.append(s)
        codec = Codec(CoordinatorInput)
        self.msgs = [codec.encode(TenantUsage(f"api-{i}", [(f"tenant-{j}", 3, 900, 850, 12) for j in range(tenants)])) for i in range(n)]
        self.sending = False
        self.sent = 0
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            t = time.monotonic()
            if self.sending:
                for s, m in zip(self.socks, self.msgs):
                    s.send(m, zmq.NOBLOCK)
                    self.sent += 1
            time.sleep(max(0.0, FLUSH_S - (time.monotonic() - t)))

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.ctx.destroy(linger=0)


def part_coordinator(args, run) -> dict:
    cluster = SimCluster(args.ranks, 0, 128, report_interval_s=0.1, stale_after_s=1.5)
    with cluster:
        subs = Subscribers(cluster.table_address, 32)
        senders = UsageSenders(cluster.coordinator_address, 32, args.tenants)
        try:
            time.sleep(5.0)  # ranks registered and reporting
            windows = {"off": [], "on": []}
            for i in range(2 * args.rounds):
                mode = "on" if i % 2 else "off"
                senders.sending = mode == "on"
                time.sleep(0.3)
                before, t0 = cluster.cpu("coordinator"), time.monotonic()
                time.sleep(args.window)
                windows[mode].append(100 * (cluster.cpu("coordinator") - before) / (time.monotonic() - t0))
            senders.sending = False
        finally:
            senders.close()
            subs.close()
    off, on = sum(windows["off"]) / len(windows["off"]), sum(windows["on"]) / len(windows["on"])
    result = {"ranks": args.ranks, "api_servers": 32, "tenants_per_report": args.tenants, "reports_per_s": 32 / FLUSH_S,
              "coordinator_pct_without": off, "coordinator_pct_with": on, "added_pct": on - off, "windows": windows,
              "loadavg": os.getloadavg()}
    run.log(f"coordinator at {args.ranks} ranks: {off:.2f}% of a core without tenant reports, {on:.2f}% with "
            f"32 API servers x {args.tenants} tenants every {FLUSH_S} s: +{on - off:.2f}% (windows {windows})")
    return result


def main(argv=None) -> None:
    p = parser(__doc__, json=True)
    p.add_argument("--part", choices=("overhead", "limits", "nodes", "coordinator", "all"), default="all")
    p.add_argument("--tokens-per-min", type=int, default=60_000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--warmup-s", type=float, default=10.0, help="left out of the window: the bucket's starting burst")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--window", type=float, default=6.0)
    p.add_argument("--client-url", help=argparse.SUPPRESS)  # (part nodes: the load inside a node's namespace)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client_url:
        answers = asyncio.run(_offer(args.client_url, args.clients, args.seconds, args.max_tokens, "demo", args.start_at))
        print(json.dumps(answers))
        return
    args, run = begin(p, argv)
    out = run.info(loadavg=os.getloadavg())
    if args.part in ("overhead", "all"):
        out["overhead"] = part_overhead(args, run)
    if args.part in ("limits", "all"):
        out["limits"] = part_limits(args, run)
    if args.part in ("nodes", "all"):
        out["nodes"] = part_nodes(args, run)
    if args.part in ("coordinator", "all"):
        out["coordinator"] = part_coordinator(args, run)
    if args.json:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
