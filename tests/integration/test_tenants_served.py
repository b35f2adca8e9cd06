"""Tenants on a started node (one rank, two API servers behind the port): 401 for an
unknown key, 429 with Retry-After naming the limit, one limit held by both API
servers together, a tenant's max_tokens cap, SIGHUP reloading the file in place,
per-tenant /metrics, and no key in any log line, error body, /status or `ps`."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.server import DpServer, wait_until

pytestmark = pytest.mark.slow

KEY_SEARCH = "sk-search-aaaaaaaaaaaa"
KEY_TIGHT = "sk-tight-bbbbbbbbbbbb"
KEY_LATE = "sk-late-cccccccccccc"
TENANTS = f"""
[tenants.search]
key = "{KEY_SEARCH}"
max_tokens = 8

[tenants.tight]
key = "{KEY_TIGHT}"
requests_per_s = 0.1
"""


def post(url: str, key: str | None, body: dict) -> tuple[int, dict, dict]:
    """A fresh connection per request: the kernel spreads them over both API servers."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


@pytest.fixture(scope="module")
def node(demo_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    srv = DpServer(demo_model_dir, "--data-parallel-size", "1", "--api-server-count", "2", "--api-key-file", str(path),
                   "--max-model-len", "128", "--api-server-launch", "exec")
    try:
        srv.start()
        srv.key_path = path
        yield srv
    finally:
        srv.stop()


def body(max_tokens: int | None = 4) -> dict:
    return {"model": "demo", "prompt": "hello there", **({"max_tokens": max_tokens} if max_tokens else {})}


def test_keys_limits_and_reload(node):
    # an unknown key: 401, and the body says nothing of what was sent
    code, _, err = post(node.url, "sk-wrong-key", body())
    assert code == 401 and err["error"]["code"] == "invalid_api_key" and "sk-wrong" not in json.dumps(err)
    assert post(node.url, None, body())[0] == 401
    # a tenant's max_tokens: the default clamps to it, asking past it is a 400 naming it
    code, _, out = post(node.url, KEY_SEARCH, body(None))
    assert code == 200 and out["usage"]["completion_tokens"] <= 8
    code, _, err = post(node.url, KEY_SEARCH, body(9))
    assert code == 400 and err["error"]["param"] == "max_tokens"
    # one request every 10 s for "tight", whichever API server takes it
    assert post(node.url, KEY_TIGHT, body())[0] == 200
    time.sleep(0.8)  # the other API server hears of it within sync.FLUSH_S (0.25 s)
    refused = [post(node.url, KEY_TIGHT, body()) for _ in range(6)]
    assert all(code == 429 for code, _, _ in refused), [c for c, _, _ in refused]
    code, headers, err = refused[0]
    assert err["error"]["code"] == "rate_limit_exceeded" and err["error"]["param"] == "requests_per_s"
    assert "'tight'" in err["error"]["message"] and 1 <= int(headers["Retry-After"]) <= 10
    # both API servers refused (the port spreads connections over them): counted per server
    metrics = node.metrics()
    assert 'dpserve_tenant_requests_total{api_server="' in metrics and 'tenant="search"' in metrics
    # dpserve status: the busiest tenants, as the coordinator's totals reach the API servers (each second)
    def status_lists_tenants() -> bool:
        out = subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "status", node.health_url],
                             capture_output=True, text=True, timeout=30)
        rows = out.stdout.split("TENANT", 1)[-1].splitlines()
        return any(r.startswith("search") for r in rows) and any(r.startswith("tight") for r in rows)

    wait_until(status_lists_tenants, 10, what="tenants in dpserve status")

    # SIGHUP to the API servers: the file again, in place (their pids do not change)
    node.key_path.write_text(TENANTS + f'\n[tenants.late]\nkey = "{KEY_LATE}"\n')
    apis = [c for c in node.status()["children"] if c["name"].startswith("api-")]
    for c in apis:
        os.kill(c["pid"], signal.SIGHUP)
    wait_until(lambda: node.log().count("key file reloaded") >= len(apis), 10, what="reloads")
    assert all(post(node.url, KEY_LATE, body())[0] == 200 for _ in range(4))
    assert [c["pid"] for c in node.status()["children"] if c["name"].startswith("api-")] == [c["pid"] for c in apis]
    assert "tenant added" in node.log() and "tenant=late" in node.log()

    # the supervisor's SIGHUP (systemctl reload): API servers restarted one by one read the file anew
    node.key_path.write_text(TENANTS.replace("max_tokens = 8", "max_tokens = 6"))
    node.proc.send_signal(signal.SIGHUP)
    old = {c["pid"] for c in apis}

    def restarted() -> bool:
        now = [c for c in node.status()["children"] if c["name"].startswith("api-")]
        return not old & {c["pid"] for c in now} and all(c["state"] == "ready" for c in now)

    wait_until(restarted, 60, what="a rolling restart of the API servers")
    assert all(post(node.url, KEY_LATE, body())[0] == 401 for _ in range(4))  # removed from the file
    assert post(node.url, KEY_SEARCH, body(7))[0] == 400
    assert "tenant changed" in node.log() and "max_tokens='8 -> 6'" in node.log()


def test_no_key_in_logs_or_ps(node):
    node.refresh_child_pids()
    secrets = (KEY_SEARCH, KEY_TIGHT, KEY_LATE, "sk-wrong-key")
    for pid in {node.proc.pid, *node.child_pids}:
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as f:
                    text = f.read().decode(errors="replace")
            except OSError:
                continue
            assert not any(s in text for s in secrets), (pid, part)
    log = node.log()
    assert not any(s in log for s in secrets)
    status = json.dumps(node.status())  # /status: neither a key nor its digest
    assert not any(s in status or hashlib.sha256(s.encode()).hexdigest() in status for s in secrets)
