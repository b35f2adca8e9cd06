"""The Ansible rollout against real systemd nodes: 1 head + 2 workers over ssh.

site.yml brings every node up with every rank registered; a second run changes
nothing; rolling-restart.yml restarts each node once while a client that retries
across node addresses sees no failed request (global mode: API servers on every node).
A deployment that grows and shrinks while it runs: `site.yml --limit NEWHOST` adds a
worker whose rank the head has never seen, `remove-node.yml --limit HOST` retires one,
and neither touches another node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import skip_unless_required
from tests.system.conftest import NODE_MODEL_DIR, _readable_model, dpserve_bin, dropin_text, project_paths, wait_until

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
DEPLOYMENT = "fleet"
API_PORT, HEALTH_PORT, RPC_PORT = 8300, 9456, 29750
UNIT_DIRS = ("/etc/systemd/system/dpserve-head@.service.d", "/etc/systemd/system/dpserve-worker@.service.d")

LOOP_CLIENT = textwrap.dedent("""
    import json, os, sys, time, urllib.request
    urls, stop_file, deadline = sys.argv[1].split(","), sys.argv[2], time.monotonic() + float(sys.argv[3])
    body = json.dumps({"model": "demo", "prompt": "rolling", "max_tokens": 2}).encode()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    ok = failed = retried = 0
    i = 0
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        for attempt in range(len(urls) * 2):
            url = urls[(i + attempt) % len(urls)]
            try:
                req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
                with opener.open(req, timeout=30) as resp:
                    if resp.status == 200:
                        ok += 1
                        break
            except Exception:
                pass
            retried += 1
            time.sleep(0.05)
        else:
            failed += 1
        i += 1
    print(json.dumps({"ok": ok, "failed": failed, "retried": retried}))
""")


def ansible_bin(name: str) -> str:
    path = Path(sys.prefix) / "bin" / name
    if not path.exists():
        skip_unless_required(f"{name} is not installed (pip install -e '.[test]')")
    return str(path)


@pytest.fixture(scope="module")
def fleet(testbed, demo_model_dir, tmp_path_factory):
    if not Path("/usr/sbin/sshd").exists():
        skip_unless_required("needs openssh-server on the host (nodes run its sshd): apt-get install openssh-server")
    tmp = tmp_path_factory.mktemp("ansible")
    key = tmp / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    nodes = [testbed.add_node(name, binds=[(_readable_model(demo_model_dir), NODE_MODEL_DIR)]) for name in ("ahead", "aw1", "aw2")]
    dropin = dropin_text(project_paths())
    for node in nodes:
        node.run("mkdir", "-p", "-m", "700", "/root/.ssh")
        node.write_file("/root/.ssh/authorized_keys", (tmp / "id_ed25519.pub").read_text(), mode=0o600)
        for unit_dir in UNIT_DIRS:
            node.write_file(f"{unit_dir}/50-system-test.conf", dropin)
        # ssh.service is masked in testbed nodes; run the daemon for this test only
        node.run("mkdir", "-p", "/run/sshd")
        node.run("/usr/sbin/sshd")
    secret = tmp / "dp.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    head, w1, w2 = nodes
    inventory = tmp / "inventory.ini"
    inventory.write_text(textwrap.dedent(f"""\
        [head]
        ahead ansible_host={head.address} dpserve_ranks=1

        [workers]
        aw1 ansible_host={w1.address} dpserve_ranks=1
        aw2 ansible_host={w2.address} dpserve_ranks=1

        [dpserve:children]
        head
        workers

        [dpserve:vars]
        ansible_user=root
        ansible_ssh_private_key_file={key}
        ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'
        ansible_python_interpreter=/usr/bin/python3
        dpserve_deployment={DEPLOYMENT}
        dpserve_install_method=existing
        dpserve_bin={dpserve_bin()}
        dpserve_model_path={NODE_MODEL_DIR}
        dpserve_served_model_name=demo
        dpserve_key_src={secret}
        dpserve_lb_mode=global
        dpserve_api_port={API_PORT}
        dpserve_supervisor_port={HEALTH_PORT}
        dpserve_rpc_port={RPC_PORT}
        dpserve_max_model_len=512
        dpserve_probe_interval_s=0.5
        dpserve_probe_timeout_s=2
        dpserve_shutdown_timeout_s=10
        dpserve_ready_timeout_s=300
        """))
    try:
        yield {"nodes": nodes, "inventory": inventory, "tmp": tmp}
    finally:
        for node in nodes:
            unit = "dpserve-head@fleet.service" if node is head else "dpserve-worker@fleet.service"
            node.systemctl("stop", unit, check=False, timeout=120)


def playbook(testbed, fleet, name: str, *args: str, timeout: float = 900) -> tuple[float, str]:
    env = {**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"), "ANSIBLE_HOST_KEY_CHECKING": "False",
           "ANSIBLE_LOCAL_TEMP": str(fleet["tmp"] / "ansible-local"), "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    t0 = time.monotonic()
    log = fleet["tmp"] / f"{name}.log"
    with open(log, "a") as f:
        proc = subprocess.run(
            ["nsenter", "-t", str(testbed.switch.pid), "-n", ansible_bin("ansible-playbook"), "-i", str(fleet["inventory"]), name, *args],
            stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=str(ANSIBLE_DIR), env=env,
        )
    text = log.read_text()
    log.write_text("")  # the next run of the same playbook starts a fresh log
    assert proc.returncode == 0, text[-6000:]
    return time.monotonic() - t0, text


def recap(text: str) -> dict[str, dict[str, int]]:
    hosts = {}
    for line in text.split("PLAY RECAP", 1)[1].splitlines():
        m = re.match(r"^(\S+)\s+:\s+(.*)$", line.strip())
        if m:
            hosts[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return hosts


def unit_of(node, fleet) -> str:
    return f"dpserve-head@{DEPLOYMENT}.service" if node is fleet["nodes"][0] else f"dpserve-worker@{DEPLOYMENT}.service"


@pytest.mark.system
@pytest.mark.timeout(1500)
def test_rollout_rerun_and_rolling_restart(testbed, fleet, record_property):
    nodes = fleet["nodes"]
    head = nodes[0]
    took, text = playbook(testbed, fleet, "site.yml")
    record_property("measured: ansible rollout of 3 nodes (s)", round(took, 1))
    for node in nodes:
        assert node.http(f"http://127.0.0.1:{HEALTH_PORT}/readyz")[0] == 200, node.name
    code, body = node_readyz = head.http(f"http://127.0.0.1:{API_PORT}/readyz")
    assert code == 200 and json.loads(body)["alive_ranks"] == [0, 1, 2], node_readyz
    proc = testbed.in_switch("curl", "-sS", "--max-time", "60", "-H", "Content-Type: application/json",
                             "-d", json.dumps({"model": "demo", "prompt": "hello", "max_tokens": 4}),
                             f"http://{head.address}:{API_PORT}/v1/completions", check=False, timeout=90)
    assert proc.returncode == 0 and json.loads(proc.stdout)["usage"]["completion_tokens"] == 4, proc.stdout + proc.stderr
    env = nodes[1].run("cat", f"/etc/dpserve/{DEPLOYMENT}.env").stdout
    assert "DPSERVE_DATA_PARALLEL_START_RANK=1" in env and "DPSERVE_DATA_PARALLEL_SIZE=3" in env, env
    assert nodes[2].run("stat", "-c", "%a %U", f"/etc/dpserve/{DEPLOYMENT}.key").stdout.split() == ["600", "dpserve"]
    journal = nodes[1].run("journalctl", "-u", f"dpserve-worker@{DEPLOYMENT}", "--no-pager", "-o", "cat").stdout
    assert "registered with the coordinator" in journal and head.address in journal, journal[-3000:]

    # a second run changes nothing
    _, text = playbook(testbed, fleet, "site.yml")
    counts = recap(text)
    assert set(counts) == {"ahead", "aw1", "aw2"}, text[-3000:]
    assert all(c["changed"] == 0 and c["failed"] == 0 for c in counts.values()), counts

    # rolling restart under a request loop that retries across the nodes' addresses
    before = {n.name: n.show(unit_of(n, fleet), "InvocationID")["InvocationID"] for n in nodes}
    stop_file = "/tmp/dpserve-rolling-stop"
    urls = ",".join(f"http://{n.address}:{API_PORT}" for n in nodes)
    client = _switch_popen(testbed, [sys.executable, "-c", LOOP_CLIENT, urls, stop_file, "600"])
    try:
        time.sleep(1)
        took, _ = playbook(testbed, fleet, "rolling-restart.yml")
        time.sleep(1)
    finally:
        Path(stop_file).touch()
        out, _ = client.communicate(timeout=120)
        os.unlink(stop_file)
    result = json.loads(out)
    record_property("measured: rolling restart of 3 nodes (s)", round(took, 1))
    record_property("measured: rolling restart requests ok/failed/retried", f"{result['ok']}/{result['failed']}/{result['retried']}")
    assert result["failed"] == 0 and result["ok"] > 20, result
    after = {n.name: n.show(unit_of(n, fleet), "InvocationID")["InvocationID"] for n in nodes}
    assert all(after[name] != before[name] for name in before), (before, after)
    wait_until(lambda: head.http(f"http://127.0.0.1:{HEALTH_PORT}/readyz")[0] == 200, 60, "the head after the restart")


def _switch_popen(testbed, cmd: list[str]) -> subprocess.Popen:
    """A client process in the switch namespace (it reaches every node); stopped by the caller."""
    return subprocess.Popen(["nsenter", "-t", str(testbed.switch.pid), "-n", *cmd], stdout=subprocess.PIPE, text=True)


ELASTIC_API_PORT, ELASTIC_HEALTH_PORT, ELASTIC_RPC_PORT = 8310, 9466, 29760


def elastic_inventory(fleet, nodes, with_second: bool) -> None:
    head, w1, w2 = nodes
    second = f"ew2 ansible_host={w2.address} dpserve_ranks=1 dpserve_start_rank=2\n" if with_second else ""
    text = fleet["inventory"].read_text()
    common = text[text.index("[dpserve:vars]"):].replace(f"dpserve_deployment={DEPLOYMENT}", "dpserve_deployment=elastic")
    common = common.replace("dpserve_lb_mode=global", "dpserve_lb_mode=internal")
    common = common.replace(f"dpserve_api_port={API_PORT}", f"dpserve_api_port={ELASTIC_API_PORT}")
    common = common.replace(f"dpserve_supervisor_port={HEALTH_PORT}", f"dpserve_supervisor_port={ELASTIC_HEALTH_PORT}")
    common = common.replace(f"dpserve_rpc_port={RPC_PORT}", f"dpserve_rpc_port={ELASTIC_RPC_PORT}")
    fleet["elastic_inventory"].write_text(
        f"[head]\neh ansible_host={head.address} dpserve_ranks=1\n\n"
        f"[workers]\new1 ansible_host={w1.address} dpserve_ranks=1 dpserve_start_rank=1\n{second}\n"
        "[dpserve:children]\nhead\nworkers\n\n"
        + common + "dpserve_data_parallel_size=2\ndpserve_data_parallel_size_max=3\n"
    )


@pytest.mark.system
@pytest.mark.timeout(1500)
def test_a_node_is_added_and_removed_with_limit(testbed, fleet, record_property):
    """Runs on the fleet's three machines as a second deployment ("elastic": its own ports)."""
    nodes = fleet["nodes"]
    head, w1, w2 = nodes
    fleet["elastic_inventory"] = fleet["tmp"] / "elastic.ini"
    elastic_inventory(fleet, nodes, with_second=False)
    run = {**fleet, "inventory": fleet["elastic_inventory"]}
    unit = {"eh": "dpserve-head@elastic.service", "ew": "dpserve-worker@elastic.service"}
    try:
        playbook(testbed, run, "site.yml")
        api = f"http://127.0.0.1:{ELASTIC_API_PORT}/readyz"
        assert json.loads(head.http(api)[1])["alive_ranks"] == [0, 1]
        before = {n.name: n.show(unit["eh" if n is head else "ew"], "InvocationID")["InvocationID"] for n in (head, w1)}

        # add: a third host, only it touched; its rank joins the running head
        elastic_inventory(fleet, nodes, with_second=True)
        took, text = playbook(testbed, run, "site.yml", "--limit", "ew2")
        record_property("measured: ansible add of one node (s)", round(took, 1))
        assert set(recap(text)) == {"ew2"}, text[-3000:]
        wait_until(lambda: json.loads(head.http(api)[1])["alive_ranks"] == [0, 1, 2], 30, "rank 2 joined")
        status = json.loads(head.http(f"http://127.0.0.1:{ELASTIC_HEALTH_PORT}/status")[1])
        assert (status["data_parallel_size"], status["data_parallel_size_max"]) == (3, 3), status
        assert "DPSERVE_DATA_PARALLEL_SIZE_MAX=3" in w2.run("cat", "/etc/dpserve/elastic.env").stdout

        # remove: the first worker retires and stops; the head goes on with ranks 0 and 2
        took, text = playbook(testbed, run, "remove-node.yml", "--limit", "ew1")
        record_property("measured: ansible removal of one node (s)", round(took, 1))
        assert set(recap(text)) == {"ew1"}, text[-3000:]
        assert w1.show(unit["ew"], "ActiveState")["ActiveState"] == "inactive"
        status = json.loads(head.http(f"http://127.0.0.1:{ELASTIC_HEALTH_PORT}/status")[1])
        assert [r["rank"] for r in status["cluster"]["ranks"]] == [0, 2] and status["data_parallel_size"] == 2, status
        assert head.http(f"http://127.0.0.1:{ELASTIC_HEALTH_PORT}/readyz")[0] == 200
        after = head.show(unit["eh"], "InvocationID")["InvocationID"]
        assert after == before[head.name]  # the head was never restarted
    finally:
        for node, name in ((head, "eh"), (w1, "ew"), (w2, "ew")):
            node.systemctl("stop", unit[name], check=False, timeout=120)
