"""The systemd units: installed by `dpserve install-units`, checked by systemd-analyze, run under a real systemd.

The tests without a node (rendering, idempotence, the env example) run
anywhere; the rest are marked `system`. The node tests share one node and
one unit, dpserve-head@demo (one rank, one API server): each starts it if it
is not running, so each also passes alone. Requests go to the node only
from inside it or from the switch namespace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from dpserve.daemons.cli.install import CANONICAL_BIN, UNIT_FILES
from dpserve.daemons.cli.main import main

from tests.system.conftest import (
    API_PORT,
    HEAD_UNIT,
    HEALTH_PORT,
    NODE_MODEL_DIR,
    REPO,
    TEST_START_TIMEOUT_S,
    TEST_WATCHDOG_S,
    dpserve_bin,
    dpserve_processes,
    dropin_text,
    ensure_serving,
    is_ready,
    journal_cursor,
    node_popen,
    project_paths,
    unit_journal,
    wait_until,
)

UNITS_DIR = REPO / "units"
COMPLETION = json.dumps({"model": "demo", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
MAX_EXPOSURE = 2.0  # issue 26: MemoryDenyWriteExecute=no must not take the units past it


def install(prefix: Path, *args: str) -> str:
    result = CliRunner().invoke(main, ["install-units", "--prefix", str(prefix), "--no-create-user", "--no-reload", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def unit_settings(path: Path) -> dict[str, list[str]]:
    """'Section.Key' -> every value assigned, in order (systemd allows repeated keys)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key}", []).append(value)
    return settings


# ==================================================================== no node needed


def test_install_units_renders_exec_start_and_is_idempotent(tmp_path):
    out = install(tmp_path, "--dpserve-bin", "/opt/dp%1/bin/dpserve")
    unit_dir = tmp_path / "etc/systemd/system"
    for name in UNIT_FILES:
        text = (unit_dir / name).read_text()
        assert "ExecStart=/opt/dp%%1/bin/dpserve " in text, text  # % escaped for systemd
        assert CANONICAL_BIN not in text.split("ExecStart=", 1)[1].splitlines()[0]
    assert (tmp_path / "etc/dpserve/example.env").read_text() == (UNITS_DIR / "dpserve.env.example").read_text()
    assert (tmp_path / "etc/dpserve/gpu-access.conf").is_file()
    assert not (unit_dir / "dpserve-head@.service.d").exists(), "the GPU drop-in is opt-in"
    assert out.count("installed ") == 4
    snapshot = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    again = install(tmp_path, "--dpserve-bin", "/opt/dp%1/bin/dpserve")
    assert "installed " not in again and again.count("unchanged ") == 4, again
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == snapshot
    gpu = install(tmp_path, "--dpserve-bin", "/opt/dp%1/bin/dpserve", "--gpu")
    assert gpu.count("installed ") == 2
    for name in UNIT_FILES:
        assert (unit_dir / f"{name}.d/gpu-access.conf").read_text() == (UNITS_DIR / "gpu-access.conf").read_text()


def test_install_units_default_bin_is_this_environments_dpserve(tmp_path):
    install(tmp_path)
    text = (tmp_path / "etc/systemd/system/dpserve-head@.service").read_text()
    assert f"ExecStart={dpserve_bin()} head\n" in text


def test_install_units_rejects_a_relative_bin(tmp_path):
    result = CliRunner().invoke(main, ["install-units", "--prefix", str(tmp_path), "--dpserve-bin", "bin/dpserve", "--no-create-user"])
    assert result.exit_code != 0 and "absolute" in result.output


def test_env_example_documents_every_option():
    text = (UNITS_DIR / "dpserve.env.example").read_text()
    documented = set(re.findall(r"^#?(DPSERVE_[A-Z0-9_]+)=", text, re.M))
    expected = set()
    for name in ("serve", "head", "worker"):
        command = main.commands.get(name)
        for param in command.params if command else ():
            if getattr(param, "hidden", False):
                continue
            envvars = param.envvar if isinstance(param.envvar, (list, tuple)) else [param.envvar]
            expected |= {e for e in envvars if e}
    assert expected, "no DPSERVE_* options found"
    assert not expected - documented, f"undocumented in units/dpserve.env.example: {sorted(expected - documented)}"


def test_units_state_the_service_contract():
    for name in UNIT_FILES:
        s = unit_settings(UNITS_DIR / name)
        one = {k: v[-1] for k, v in s.items()}
        assert one["Service.Type"] == "notify" and one["Service.NotifyAccess"] == "main"
        assert one["Service.EnvironmentFile"] == "/etc/dpserve/%i.env"
        assert one["Service.KillMode"] == "mixed" and one["Service.Restart"] == "on-failure"
        assert "Unit.StartLimitIntervalSec" in one and "Unit.StartLimitBurst" in one
        assert one["Service.User"] == "dpserve" and one["Service.ExecReload"] == "/bin/kill -HUP $MAINPID"
        assert one["Service.ExecStart"].startswith(CANONICAL_BIN + " ")
        # stop budget: drain (--shutdown-timeout, 30 s) + engine grace (--kill-grace-s, 5 s)
        assert int(one["Service.TimeoutStopSec"]) > 30 + 5
        runtime = one["Service.RuntimeDirectory"]
        assert f"DPSERVE_RUN_DIR=%t/{runtime}" in s["Service.Environment"]
        assert f"DPSERVE_CACHE_DIR=%C/{one['Service.CacheDirectory']}" in s["Service.Environment"]


# ==================================================================== systemd-analyze (root, no node)


def _analyze_root(tmp_path: Path, *install_args: str) -> Path:
    """A scratch root for `systemd-analyze --root`: the distribution's units, ours, stub executables."""
    root = tmp_path / "root"
    shutil.copytree(os.path.realpath("/lib/systemd/system"), root / "lib/systemd/system", symlinks=True)
    install(root, "--dpserve-bin", dpserve_bin(), *install_args)
    for unit in (root / "etc/systemd/system").glob("*.service"):
        for line in unit.read_text().splitlines():
            if line.startswith("Exec") and "=" in line:
                program = line.split("=", 1)[1].lstrip("-@+!:").split()[0]
                stub = root / program.lstrip("/")
                stub.parent.mkdir(parents=True, exist_ok=True)
                stub.write_text("#!/bin/sh\n")
                stub.chmod(0o755)
    return root


def _analyze(*args: str) -> subprocess.CompletedProcess:
    # systemd-analyze touches /run/systemd on the host even with --root: give it a private /run.
    script = 'mount -t tmpfs tmpfs /run && exec systemd-analyze "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.system
@pytest.mark.parametrize("gpu", [False, True], ids=["plain", "gpu-drop-in"])
def test_systemd_analyze_verify_prints_nothing(root_support, tmp_path, gpu):
    root = _analyze_root(tmp_path, *(["--gpu"] if gpu else []))
    for name in UNIT_FILES:
        instance = name.replace("@.", "@ci.")
        proc = _analyze("verify", f"--root={root}", instance)
        assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", f"{instance}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.system
def test_systemd_analyze_security_exposure(root_support, tmp_path, record_property):
    for variant, args in (("", ()), (" with the GPU drop-in", ("--gpu",))):
        root = _analyze_root(tmp_path / (variant.strip() or "plain"), *args)
        for name in UNIT_FILES:
            instance = name.replace("@.", "@ci.")
            proc = _analyze("security", "--offline=yes", f"--root={root}", instance)
            found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
            assert found, proc.stdout + proc.stderr
            record_property(f"measured: systemd-analyze security exposure, {name}{variant}", found.group(1))
            if not variant:
                assert float(found.group(1)) <= MAX_EXPOSURE, proc.stdout


# ==================================================================== under systemd in a node


@pytest.mark.system
def test_start_returns_only_once_ready_and_serves(head_node, testbed, record_property):
    node = head_node
    node.systemctl("stop", HEAD_UNIT, check=False)
    node.systemctl("reset-failed", HEAD_UNIT, check=False)
    started = time.monotonic()
    node.systemctl("start", HEAD_UNIT, timeout=300)
    took = time.monotonic() - started
    record_property("measured: systemctl start -> ready (s)", f"{took:.1f}")
    if took > TEST_START_TIMEOUT_S:
        record_property("measured: start outlived TimeoutStartSec thanks to EXTEND_TIMEOUT_USEC", f"{TEST_START_TIMEOUT_S} s floor")
    # READY=1 came only when the node served: no waiting here
    assert node.show(HEAD_UNIT, "ActiveState")["ActiveState"] == "active"
    code, body = node.http(f"http://127.0.0.1:{HEALTH_PORT}/readyz")
    assert code == 200, body
    status = node.show(HEAD_UNIT, "StatusText")["StatusText"]
    assert status.startswith(f"serving on port {API_PORT}: 1/1 ranks ready, 1/1 API servers ready"), status
    for origin, run in (("node", node.run), ("switch", testbed.in_switch)):
        proc = run("curl", "-sS", "--max-time", "60", "-H", "Content-Type: application/json", "-d", COMPLETION,
                   f"http://{node.address}:{API_PORT}/v1/completions", check=False, timeout=90)
        assert proc.returncode == 0, f"from the {origin}: {proc.stderr}"
        answer = json.loads(proc.stdout)
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 8, answer


def _message(entry: dict) -> str:
    msg = entry.get("MESSAGE", "")
    return msg if isinstance(msg, str) else bytes(msg).decode(errors="replace")


@pytest.mark.system
def test_journal_priorities_and_components(head_node):
    node = head_node
    ensure_serving(node)
    warnings = unit_journal(node, "", "-p", "warning")
    everything = unit_journal(node)
    ours = [e for e in everything if e.get("_SYSTEMD_UNIT") == HEAD_UNIT and e.get("_PID") != "1"]
    assert ours, "no log line from the daemon in the journal"
    # journald parsed every <N> prefix: none is left in a message
    assert not [m for m in map(_message, ours) if re.match(r"<\d>", m)]
    # every daemon line names its component
    unnamed = [m for m in map(_message, ours) if not re.match(r"[a-z][a-z0-9-]*: ", m)]
    assert not unnamed, unnamed[:5]
    # the filter keeps warnings and worse only, and drops info
    assert warnings, "expected the deliberate warning (DPSERVE_FAULT_API_STARTUP_DELAY_S)"
    assert all(int(e["PRIORITY"]) <= 4 for e in warnings), [(e["PRIORITY"], _message(e)) for e in warnings]
    assert any(_message(e).startswith("api-0: delaying readiness on purpose") for e in warnings)
    ready = [e for e in ours if _message(e).startswith("supervisor: node ready")]
    assert ready and all(e["PRIORITY"] == "6" for e in ready)
    assert not any(_message(e).startswith("supervisor: node ready") for e in warnings)


@pytest.mark.system
def test_unit_serves_in_the_dtype_dpserve_serve_picks_on_this_cpu(head_node, demo_model_dir, record_property):
    """Issue 26: under the unit's sandbox the rank serves in the dtype `dpserve serve` resolves here
    (bfloat16 on an avx512_bf16/AMX CPU, float32 elsewhere), not a float32 fallback forced by a W^X policy."""
    import torch
    from dpserve.engine.loader import resolve_dtype

    want = str(resolve_dtype("auto", torch.device("cpu"), demo_model_dir)).removeprefix("torch.")
    ensure_serving(head_node)
    loaded = [m for m in map(_message, unit_journal(head_node)) if re.match(r"engine-dp0: model loaded ", m)]
    assert loaded, "no 'model loaded' line from engine-dp0 in the journal"
    served = re.search(r" dtype=(\w+)", loaded[-1])
    assert served, loaded[-1]
    record_property("measured: dtype served under the unit / by dpserve serve here", f"{served.group(1)} / {want}")
    assert served.group(1) == want, loaded[-1]
    fallback = [m for m in map(_message, unit_journal(head_node, "", "-p", "warning")) if "serving in float32" in m]
    assert not fallback, fallback


LOOP = r"""
import json, os, sys, time, urllib.request, urllib.error
url, stop, progress = sys.argv[1], sys.argv[2], sys.argv[3]
body = json.dumps({"model": "demo", "prompt": "Hi", "max_tokens": 4}).encode()
ok, failures = 0, []
deadline = time.monotonic() + 240
while not os.path.exists(stop) and time.monotonic() < deadline:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            ok += 1
    except (urllib.error.URLError, OSError) as exc:
        failures.append(repr(exc))
    with open(progress + ".tmp", "w") as f:
        f.write(str(ok))
    os.replace(progress + ".tmp", progress)
print(json.dumps({"ok": ok, "failures": failures}))
"""


@pytest.mark.system
def test_reload_restarts_api_servers_without_a_failed_request(head_node):
    node = head_node
    ensure_serving(node)

    def api_pid() -> int:
        status = json.loads(node.http(f"http://127.0.0.1:{HEALTH_PORT}/status")[1])
        child = next(c for c in status["children"] if c["name"] == "api-0")
        return child["pid"] if child["state"] == "ready" else 0

    def done() -> int:
        out = node.run("cat", "/run/dpserve-test-loop.progress", check=False).stdout.strip()
        return int(out) if out.isdigit() else 0

    old_api = api_pid()
    node.run("rm", "-f", "/run/dpserve-test-loop.stop", "/run/dpserve-test-loop.progress")
    loop = node.popen(sys.executable, "-c", LOOP, f"http://127.0.0.1:{API_PORT}/v1/completions",
                      "/run/dpserve-test-loop.stop", "/run/dpserve-test-loop.progress", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: done() >= 5, 60, "the request loop to get going")
        cursor = journal_cursor(node)
        node.systemctl("reload", HEAD_UNIT)
        wait_until(lambda: api_pid() not in (0, old_api), 60, "a new, ready api-0")
        wait_until(lambda: any(_message(e).startswith("supervisor: rolling restart done") for e in unit_journal(node, cursor)), 30,
                   "the rolling restart to finish")
        after = done()
        wait_until(lambda: done() >= after + 5, 60, "requests after the reload")
    finally:
        node.run("touch", "/run/dpserve-test-loop.stop", check=False)
        try:
            out, err = loop.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            loop.kill()
            out, err = loop.communicate()
    result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"ok": 0, "failures": [err]}
    assert result["failures"] == [] and result["ok"] >= 10, result
    assert node.show(HEAD_UNIT, "ActiveState")["ActiveState"] == "active"


def _children(node) -> list[int]:
    status = json.loads(node.http(f"http://127.0.0.1:{HEALTH_PORT}/status")[1])
    return [c["pid"] for c in status["children"] if c["pid"]]


def _alive(node, pids: list[int]) -> list[int]:
    return [p for p in pids if node.run("test", "-d", f"/proc/{p}", check=False).returncode == 0]


def _wait_replaced(node, old_pid: int, what: str) -> int:
    def replaced() -> int:
        props = node.show(HEAD_UNIT, "MainPID", "ActiveState")
        pid = int(props["MainPID"] or 0)
        return pid if pid not in (0, old_pid) and props["ActiveState"] == "active" else 0

    new_pid = wait_until(replaced, 180, what, interval=0.5)
    assert is_ready(node)
    return new_pid


@pytest.mark.system
def test_kill_9_of_the_supervisor_restarts_the_unit(head_node, record_property):
    node = head_node
    pid = ensure_serving(node)
    children = _children(node)
    restarts = int(node.show(HEAD_UNIT, "NRestarts")["NRestarts"])
    cursor = journal_cursor(node)
    killed_at = time.monotonic()
    node.run("kill", "-9", str(pid))
    _wait_replaced(node, pid, "systemd to restart the unit after kill -9")
    record_property("measured: kill -9 -> ready again (s)", f"{time.monotonic() - killed_at:.1f}")
    assert int(node.show(HEAD_UNIT, "NRestarts")["NRestarts"]) == restarts + 1
    assert not _alive(node, children), "children of the killed supervisor survived it"
    messages = [_message(e) for e in unit_journal(node, cursor)]
    assert any("Main process exited, code=killed, status=9/KILL" in m for m in messages), messages


@pytest.mark.system
def test_watchdog_kills_a_stopped_supervisor_and_systemd_restarts_it(head_node, record_property):
    node = head_node
    pid = ensure_serving(node)
    cursor = journal_cursor(node)
    stopped_at = time.monotonic()
    node.run("kill", "-STOP", str(pid))
    _wait_replaced(node, pid, "the watchdog to kill the stopped supervisor and systemd to restart it")
    messages = [_message(e) for e in unit_journal(node, cursor)]
    assert any(f"Watchdog timeout (limit {TEST_WATCHDOG_S}s)" in m for m in messages), messages
    assert any("Failed with result 'watchdog'" in m for m in messages), messages
    record_property("measured: SIGSTOP -> ready again via the watchdog (s)", f"{time.monotonic() - stopped_at:.1f}")


@pytest.mark.system
def test_stop_drains_in_flight_requests_and_leaves_no_process(head_node, record_property):
    node = head_node
    ensure_serving(node)
    children = _children(node)
    # long enough to be in flight when the stop lands, on a fast CPU too (200 and 500 tokens were sometimes done first on one; within the 12 s drain on a slow one)
    stream = json.dumps({"model": "demo", "prompt": "drain me", "max_tokens": 1200, "ignore_eos": True, "stream": True, "temperature": 0})
    client = node_popen(node, f"curl -sSN --max-time 120 -H 'Content-Type: application/json' -d '{stream}' "
                              f"http://127.0.0.1:{API_PORT}/v1/completions > /run/dpserve-test-stream.out; echo rc=$?")
    try:
        wait_until(lambda: "data: {" in node.run("cat", "/run/dpserve-test-stream.out", check=False).stdout, 60, "the stream to start",
                   interval=0.05)
        cursor = journal_cursor(node)
        started = time.monotonic()
        node.systemctl("stop", HEAD_UNIT, timeout=180)
        record_property("measured: systemctl stop with a stream in flight (s)", f"{time.monotonic() - started:.1f}")
        out, _ = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()
    assert out.strip() == "rc=0", out
    text = node.run("cat", "/run/dpserve-test-stream.out").stdout
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert text.rstrip().endswith("data: [DONE]"), text[-500:]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    messages = [_message(e) for e in unit_journal(node, cursor)]
    assert any(m.startswith("api-0: draining") and "in_flight=1" in m for m in messages), "\n".join(messages)
    props = node.show(HEAD_UNIT, "ActiveState", "Result", "ExecMainStatus")
    assert props == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, props
    assert not dpserve_processes(node), dpserve_processes(node)
    assert not _alive(node, children)


@pytest.mark.system
def test_stop_with_a_drain_longer_than_the_watchdog_period_ends_cleanly(head_node):
    """systemd stops watching at `stop`, but any WATCHDOG=1 that arrives afterwards re-arms it.
    Made deterministic: the supervisor is held (SIGSTOP) just past one ping interval, so its
    loop owes a ping when `systemctl stop` resumes it; a hung API server makes the drain run
    its whole budget (--shutdown-timeout 12 s + --kill-grace-s 5 s), past WatchdogSec (10 s)."""
    node = head_node
    pid = ensure_serving(node)
    api = next(c["pid"] for c in json.loads(node.http(f"http://127.0.0.1:{HEALTH_PORT}/status")[1])["children"]
               if c["name"] == "api-0")

    def last_ping() -> int:
        return int(node.show(HEAD_UNIT, "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"] or 0)

    before = last_ping()
    wait_until(lambda: last_ping() != before, 3 * TEST_WATCHDOG_S, "a watchdog ping", interval=0.05)
    cursor = journal_cursor(node)
    node.run("kill", "-STOP", str(pid))
    held_from = time.monotonic()
    node.run("kill", "-STOP", str(api))
    wait_until(lambda: time.monotonic() - held_from > TEST_WATCHDOG_S / 2 + 1, TEST_WATCHDOG_S, "one ping interval")
    node.systemctl("stop", HEAD_UNIT, timeout=180)  # SIGTERM + SIGCONT to the supervisor
    messages = [_message(e) for e in unit_journal(node, cursor)]
    assert not [m for m in messages if "Watchdog timeout" in m], messages
    assert node.show(HEAD_UNIT, "Result")["Result"] == "success"
    assert not dpserve_processes(node), dpserve_processes(node)


MN = "mn"  # the multi-node deployment: head instance on the head node, worker on a second node
MN_PORTS = {"DPSERVE_PORT": "8100", "DPSERVE_DATA_PARALLEL_SUPERVISOR_PORT": "9356", "DPSERVE_DATA_PARALLEL_RPC_PORT": "29650"}


@pytest.mark.system
def test_worker_unit_joins_the_head(testbed, head_node, demo_model_dir):
    """dpserve-worker@mn on a second node joins the head unit's `dpserve head`; a request
    pinned to the worker's rank succeeds."""
    head = head_node
    worker = testbed.add_node("worker", binds=[(demo_model_dir, NODE_MODEL_DIR)])
    worker.run(dpserve_bin(), "install-units", timeout=120)
    worker.write_file("/etc/systemd/system/dpserve-worker@.service.d/50-system-test.conf", dropin_text(project_paths()))
    settings = {**MN_PORTS, "DPSERVE_MODEL": NODE_MODEL_DIR, "DPSERVE_SERVED_MODEL_NAME": "demo", "DPSERVE_HOST": "0.0.0.0",
                "DPSERVE_DATA_PARALLEL_SIZE": "2", "DPSERVE_DATA_PARALLEL_SIZE_LOCAL": "1", "DPSERVE_API_SERVER_COUNT": "1",
                "DPSERVE_DATA_PARALLEL_ADDRESS": head.address, "DPSERVE_DATA_PARALLEL_KEY_FILE": f"/etc/dpserve/{MN}.key"}
    for node, extra in ((head, {}), (worker, {"DPSERVE_DATA_PARALLEL_START_RANK": "1", "DPSERVE_HEADLESS": "true"})):
        node.write_file(f"/etc/dpserve/{MN}.env", "".join(f"{k}={v}\n" for k, v in {**settings, **extra}.items()), mode=0o640)
        node.write_file(f"/etc/dpserve/{MN}.key", "system-test-shared-secret-0123456789abcdef\n", mode=0o600)
        node.run("chown", "dpserve:dpserve", f"/etc/dpserve/{MN}.key")
    for node in (head, worker):
        node.systemctl("daemon-reload")
    units = ((head, f"dpserve-head@{MN}.service"), (worker, f"dpserve-worker@{MN}.service"))
    try:
        # the head is ready only once every rank registered: start both, then wait for both
        for node, unit in units:
            node.systemctl("start", "--no-block", unit)
        for node, unit in units:
            wait_until(lambda node=node, unit=unit: node.show(unit, "ActiveState")["ActiveState"] == "active", 300, f"{unit} to be ready")
        assert "2/2 ranks registered" in head.show(units[0][1], "StatusText")["StatusText"]
        proc = testbed.in_switch("curl", "-sS", "-i", "--max-time", "60", "-H", "Content-Type: application/json",
                                 "-H", "X-data-parallel-rank: 1", "-d", COMPLETION,
                                 f"http://{head.address}:{MN_PORTS['DPSERVE_PORT']}/v1/completions", check=False, timeout=90)
        assert proc.returncode == 0 and " 200 " in proc.stdout.splitlines()[0], proc.stdout + proc.stderr
        assert "x-data-parallel-rank: 1" in proc.stdout.lower(), proc.stdout
        worker.systemctl("stop", units[1][1])
        assert worker.show(units[1][1], "Result")["Result"] == "success"
    finally:
        for node, unit in reversed(units):
            node.systemctl("stop", unit, check=False)
