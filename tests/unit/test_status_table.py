"""The operator's view of the cluster, without a cluster: a real supervisor's
loop is fed the coordinator's load-table entries (TableSeen, as read_table
posts them), and /status, /readyz, /metrics, the STATUS= line and the
`dpserve status` table are read back from its one NodeView. The health port
is a real aiohttp server on loopback; `dpserve status` reads it over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
import structlog
from click.testing import CliRunner
from dpserve.daemons.cli.main import main as cli
from dpserve.daemons.cli.status_table import age, render
from dpserve.daemons.config import ServeConfig
from dpserve.daemons.supervisor import events as ev
from dpserve.daemons.supervisor.children import Child, ChildState
from dpserve.daemons.supervisor.cluster import ClusterState
from dpserve.daemons.supervisor.core import Supervisor
from dpserve.engine.common.protocol import RankLoad


def make_sup(tmp_path, **kw) -> Supervisor:
    (tmp_path / "config.json").write_text("{}")
    base = dict(model=str(tmp_path), served_model_name="demo", data_parallel_size=4, data_parallel_size_local=2, api_server_count=2)
    sup = Supervisor(ServeConfig(**{**base, **kw}), structlog.get_logger())
    sup.phase = "serving"
    sup.port = 8000
    sup.node_address = "10.0.0.1" if kw.get("role") != "worker" else "10.0.0.2"
    start = sup.cfg.data_parallel_start_rank
    kinds = [("engine", r, f"engine-dp{r}") for r in sup.cfg.local_ranks]
    if sup.cfg.runs_api_servers:
        kinds += [("api", i, f"api-{i}") for i in range(sup.cfg.api_server_count)]
    for kind, rank, name in kinds:
        child = Child(name, kind, rank, "x", b"{}")
        child.pid, child.state = 1000 + start + rank, ChildState.READY
        sup.children[name] = child
    return sup


def entry(rank: int, alive: bool, reason: str = "", **load) -> RankLoad:
    node = 0 if rank < 2 else 2
    address = "10.0.0.1" if node == 0 else "10.0.0.2"
    return RankLoad(rank, f"inc{rank}", alive, down_reason=reason, node_rank=node, host="head-host" if node == 0 else "worker-host", address=address, **load)


def table(sup: Supervisor, entries: list[RankLoad], at: float = 100.0) -> None:
    sup.apply(ev.TableSeen(entries, at, 1_700_000_000.0))


def all_four(sup: Supervisor) -> tuple[dict, dict, str, str]:
    """The four things an operator reads, from the one view."""
    view = sup.view
    return view.status_dict(), view.readiness(), view.status_line(), render(view.status_dict())


LOAD = dict(num_running=3, num_waiting=1, num_waiting_prefill_tokens=40, num_remaining_decode_tokens=60, kv_usage=0.25, num_requests_finished=17)


@pytest.fixture
def head(tmp_path):
    sup = make_sup(tmp_path, role="head", min_ready_ranks=3)
    yield sup
    sup.zctx.destroy(linger=0)


def test_every_rank_of_the_cluster_with_a_worker_lost(head):
    table(head, [entry(0, True, **LOAD), entry(1, True), entry(2, False, "no load report for 2 s", num_requests_finished=5), entry(3, False, "no load report for 2 s")])
    status, ready, line, screen = all_four(head)
    ranks = status["cluster"]["ranks"]
    assert [r["state"] for r in ranks] == ["ready", "ready", "lost", "lost"]
    assert [r["node"] for r in ranks] == [0, 0, 2, 2]
    assert ranks[0]["kv_cache_usage_perc"] == 0.25 and ranks[0]["requests_finished"] == 17 and ranks[0]["local"]
    assert ranks[2]["reason"] == "no load report for 2 s" and not ranks[2]["local"]
    assert ranks[2]["requests_finished"] == 5  # what it served before it was lost
    assert all(r["routed_by"] == "head" for r in ranks)
    # below --min-ready-ranks 3: not ready, and all four say so with the same reason
    assert status["ready"] is False and ready["status"] == "not ready"
    reason = "2/4 ranks routable, below --min-ready-ranks 3"
    assert status["reason"] == ready["reason"] == reason
    assert reason in line and "2 lost" in line and "2/4 ranks registered, 2 routable" in line
    assert f"NOT READY: {reason}" in screen.splitlines()[0]
    assert ready["ranks_routable"] == 2 and ready["ranks_lost"] == 2
    # the table: one row per rank; local ranks starred; lost ones say why, load shown only while held
    rows = {line.split()[0].rstrip("*"): line for line in screen.splitlines() if line[:4].strip().rstrip("*").isdigit()}
    assert set(rows) == {"0", "1", "2", "3"}
    assert rows["0"].split()[0] == "0*" and "10.0.0.1" in rows["0"] and "ready" in rows["0"] and "25.0%" in rows["0"] and " 100 " in rows["0"]
    assert "LOST" in rows["2"] and "no load report for 2 s" in rows["2"] and "10.0.0.2" in rows["2"]
    assert ranks[2]["host"] == "worker-host" and ranks[2]["address"] == "10.0.0.2"
    assert "cluster: 2/4 ranks routable, 2 registered, 2 LOST, min ready 3; head connected" in screen

    # the worker comes back: every view agrees it is ready again
    table(head, [entry(2, True), entry(3, True)], at=101.0)
    status, ready, line, screen = all_four(head)
    assert status["ready"] and ready["status"] == "ready" and "NOT READY" not in line
    assert [r["state"] for r in status["cluster"]["ranks"]] == ["ready"] * 4
    assert screen.splitlines()[0].endswith("serving, ready")


def test_ranks_not_started_yet_and_api_servers_name_their_ranks(head):
    table(head, [entry(0, True), entry(1, False, "registering")])
    status, ready, _, screen = all_four(head)
    assert [r["state"] for r in status["cluster"]["ranks"]] == ["ready", "registered", "absent", "absent"]
    assert status["cluster"]["ranks_absent"] == 2 and "2 not started" in screen
    table(head, [entry(1, True), entry(2, False, "registering"), entry(1, False, "gone"), entry(1, True)])
    kept = head.cluster.counts  # kept with each change, read on every wake of the loop
    assert kept == {s: sum(r.state == s for r in head.cluster.ranks) for s in kept} == {"absent": 1, "registered": 1, "ready": 2, "lost": 0, "drained": 0}
    apis = [c for c in status["children"] if c["kind"] == "api"]
    assert [(c["rank"], c["index"], c["routes_to"]) for c in apis] == [(None, 0, [0, 1, 2, 3]), (None, 1, [0, 1, 2, 3])]
    assert "ranks 0,1,2,3" in screen


def test_external_mode_api_server_i_routes_to_its_nodes_rank(tmp_path):
    sup = make_sup(tmp_path, role="worker", lb_mode="external", data_parallel_start_rank=2)
    try:
        table(sup, [entry(r, True) for r in range(4)])
        status = sup.view.status_dict()
        apis = [c for c in status["children"] if c["kind"] == "api"]
        assert [(c["name"], c["rank"], c["routes_to"]) for c in apis] == [("api-0", None, [2]), ("api-1", None, [3])]
        assert [r["routed_by"] for r in status["cluster"]["ranks"]] == ["node 0 api-0", "node 0 api-1", "node 2 api-0", "node 2 api-1"]
    finally:
        sup.zctx.destroy(linger=0)


def test_headless_worker_claims_no_port_and_is_not_ready_once_it_lost_the_head(tmp_path):
    sup = make_sup(tmp_path, role="worker", headless=True, data_parallel_start_rank=2)
    try:
        table(sup, [entry(r, True) for r in range(4)], at=100.0)
        status, ready, line, screen = all_four(sup)
        assert status["port"] is None and status["api_server_count"] == 0 and not any(c["kind"] == "api" for c in status["children"])
        assert status["ready"] and ready["status"] == "ready" and ready["min_ready_ranks"] == 0
        assert "no API server (headless)" in screen
        silence = sup.cluster.head_silence_s
        assert not sup.cluster.check_head(100.0 + silence - 0.1, 0.0)
        assert sup.cluster.check_head(100.0 + silence + 0.1, 0.0)  # the loop's tick verb
        status, ready, line, screen = all_four(sup)
        assert not status["ready"] and ready["status"] == "not ready" and not ready["head_connected"]
        assert status["reason"].startswith("lost the head") and "HEAD LOST" in line and "HEAD LOST" in screen
        assert ready["ranks_routable"] == 0
        table(sup, [entry(r, True) for r in range(4)], at=200.0)
        assert sup.view.readiness()["status"] == "ready"
    finally:
        sup.zctx.destroy(linger=0)


def test_metrics_and_dpserve_status_over_the_real_health_port(head):
    table(head, [entry(0, True, **LOAD), entry(1, True), entry(2, False, "no load report for 2 s"), entry(3, False, "no load report for 2 s")])

    async def scrape() -> tuple[int, str, int, dict, str]:
        port = await head.health.start("127.0.0.1", 0)
        try:
            base = f"http://127.0.0.1:{port}"

            def get(path):
                try:
                    with urllib.request.urlopen(base + path, timeout=5) as resp:
                        return resp.status, resp.read().decode()
                except urllib.error.HTTPError as exc:
                    return exc.code, exc.read().decode()

            ready_code, ready_body = await asyncio.to_thread(get, "/readyz")
            _, metrics = await asyncio.to_thread(get, "/metrics")
            result = await asyncio.to_thread(CliRunner().invoke, cli, ["status", base])
            return ready_code, metrics, result.exit_code, json.loads(ready_body), result.output
        finally:
            await head.health.stop()

    code, metrics, cli_rc, ready, output = asyncio.run(scrape())
    assert code == 503 and ready["ranks_routable"] == 2
    for line in (
        'dpserve_cluster_ranks{state="lost"} 2.0',
        'dpserve_cluster_ranks{state="ready"} 2.0',
        "dpserve_cluster_ranks_routable 2.0",
        'dpserve_cluster_rank_state{node="2",rank="3",state="lost"} 1.0',
        'vllm:num_requests_running{node="0",rank="0"} 3.0',
        'vllm:kv_cache_usage_perc{rank="0"} 0.0',  # the local engine's own heartbeat wins (none yet)
        "dpserve_node_ready 0.0",
    ):
        assert line in metrics, line
    assert cli_rc == 0, output
    assert "NOT READY: 2/4 ranks routable, below --min-ready-ranks 3" in output and "LOST" in output


def test_status_watch_redraws_in_place_until_interrupted(head):
    import signal
    import sys

    table(head, [entry(r, True) for r in range(4)])

    async def watch() -> tuple[int, str]:
        port = await head.health.start("127.0.0.1", 0)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dpserve.daemons.cli.main", "status", "--watch", "--interval-s", "0.2", f"http://127.0.0.1:{port}",
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            out = b""
            while out.count(b"Ctrl-C to stop") < 3:  # three screens drawn
                chunk = await asyncio.wait_for(proc.stdout.read(65536), 30)
                assert chunk, out.decode(errors="replace")
                out += chunk
            proc.send_signal(signal.SIGINT)
            rest, _ = await asyncio.wait_for(proc.communicate(), 30)
            return proc.returncode, (out + rest).decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await head.health.stop()

    rc, out = asyncio.run(watch())
    assert rc == 0
    # through a pipe click drops the cursor controls: one whole screen after another
    assert "\x1b[" not in out
    screens = out.split("Ctrl-C to stop)")[1:]
    assert len(screens) >= 3 and all("4/4 ranks routable" in sc for sc in screens[:3]), out[-2000:]


def test_the_monitoring_examples_use_only_metrics_the_health_port_exports(head):
    from prometheus_client import generate_latest

    table(head, [entry(0, True, **LOAD), entry(1, True), entry(2, False, "gone"), entry(3, False, "registering")])
    exported = set(re.findall(r"^(?:# TYPE )?([a-zA-Z_:][a-zA-Z0-9_:]*)", generate_latest(head.health.registry).decode(), re.M))
    examples = Path(__file__).resolve().parents[2] / "units" / "monitoring"
    dashboard = json.loads((examples / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += re.findall(r"expr: (.+)", (examples / "prometheus-alerts.yml").read_text())
    used = {name for e in exprs for name in re.findall(r"\b(dpserve_[a-z_]+|vllm:[a-z_]+)", e)}
    assert "dpserve_cluster_rank_state" in used and len(used) >= 8
    assert used <= exported, sorted(used - exported)


def test_the_coordinator_names_each_ranks_node_and_address():
    from dpserve.daemons.coordinator.server import RankTable
    from dpserve.engine.common.protocol import EngineRegister

    t = RankTable(4, "fp", 3.0)
    assert t.register(EngineRegister(2, "a", "fp", 1, "worker-host", node_rank=2), 0.0) == ""
    t.tables(full=False)
    t.node_address(2, "10.0.0.2")  # the node's supervisor says where it is: its held ranks change
    (sent,) = t.tables(full=False)
    assert [(e.rank, e.node_rank, e.host, e.address) for e in sent.ranks] == [(2, 2, "worker-host", "10.0.0.2")]
    t.node_address(2, "10.0.0.2")
    assert t.tables(full=False) == []  # the same again: nothing to publish
    assert t.register(EngineRegister(3, "b", "fp", 1, "worker-host", node_rank=2), 0.0) == ""
    assert t.ranks[3].address == "10.0.0.2"  # a rank registering later gets it at once
    # since: the coordinator's clock at each change of state, which every node then shows
    registered_at = t.ranks[2].since
    assert registered_at > 0
    t.down(2, "gone")
    assert t.ranks[2].since >= registered_at
    sup_entry = RankLoad(2, "a", False, down_reason="gone", node_rank=2, since=1_600_000_000.0)
    state = ClusterState(4, 1.5, 1_700_000_000.0)
    state.apply([sup_entry], 1.0, 1_700_000_100.0)
    assert state.ranks[2].since == 1_600_000_000.0 and state.ranks[3].since == 1_700_000_000.0


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (-3, "0s"), (59.9, "59s"), (65, "1m05s"), (7322, "2h02m"), (200000, "2d07h")])
def test_age(seconds, text):
    assert age(seconds) == text


def test_ray_ranks_show_their_ray_node_and_actor():
    from dpserve.daemons.cli.status_table import child_rows

    base = {"state": "ready", "pid": 7, "restarts": 0, "running": 0, "waiting": 0, "kv_cache_usage_perc": 0.0, "uptime_s": 1.0, "last_exit": None}
    rows = child_rows([
        {**base, "name": "engine-dp1", "kind": "engine", "detail": "ray node 58ddc6bd9530 (10.0.0.2), actor 28e5, pid 16491"},
        {**base, "name": "ray-placement", "kind": "placement", "detail": "dpserve-c7d15037-vm-16420"},
        {**base, "name": "engine-dp0", "kind": "engine", "detail": "rank 0"},
    ])
    assert rows[1].endswith("ray node 58ddc6bd9530 (10.0.0.2), actor 28e5, pid 16491")
    assert rows[2].endswith("dpserve-c7d15037-vm-16420")
    assert rows[3].endswith("s  "), "a local rank's own ready detail says nothing new"


def test_status_interval_old_spelling_still_works_with_a_note():
    """--interval (seconds without -s) is a hidden alias of --interval-s for one release."""
    help_text = CliRunner().invoke(cli, ["status", "--help"]).output
    assert "--interval-s" in help_text and "--interval " not in help_text
    result = CliRunner().invoke(cli, ["status", "--interval", "0.5", "http://127.0.0.1:9/"])
    assert result.exit_code == 1 and "--interval is deprecated" in result.output and "use --interval-s" in result.output
