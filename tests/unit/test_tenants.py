"""Tenants: the key file's forms, constant-time lookup, buckets with a virtual clock,
429 bodies with Retry-After, reloads that keep what was used, and nothing of a key
in an error or a log line."""

from __future__ import annotations

import hashlib

import pytest
from dpserve.daemons.api.openai_types import ApiError
from dpserve.daemons.api.tenants import DEFAULT_TENANT, Tenant
from dpserve.daemons.api.tenants.gate import Call, TenantGate, limit_error
from dpserve.daemons.api.tenants.keyfile import changes, parse_tenants, read_key_file
from dpserve.daemons.api.tenants.limits import TOKEN_BURST_S, Limited, Limits

KEY_A = "sk-search-0123456789"
KEY_B = "sk-batch-9876543210"
TOML = f"""
[tenants.search]
key = "{KEY_A}"
weight = 2
priority = 0
requests_per_s = 20
tokens_per_min = 6000
max_concurrent = 3
max_tokens = 64

[tenants.batch]
key_sha256 = "{hashlib.sha256(KEY_B.encode()).hexdigest()}"
priority = 5
"""


class Log:
    """The structlog calls the gate makes, kept as the text a journal line would hold."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def _say(self, event: str, **fields) -> None:
        self.lines.append(" ".join([event, *(f"{k}={v}" for k, v in fields.items())]))

    info = warning = error = _say

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def write(tmp_path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_single_key_file_keeps_its_form(tmp_path):
    assert read_key_file(write(tmp_path, "sk-one\nignored second line\n")) == ("sk-one", None)
    with pytest.raises(ValueError, match="is empty"):
        read_key_file(write(tmp_path, "\n"))
    with pytest.raises(ValueError, match="printable ASCII"):
        read_key_file(write(tmp_path, "sk one\n"))


def test_tenants_file_parses_limits_and_both_key_forms(tmp_path):
    key, book = read_key_file(write(tmp_path, TOML))
    assert key is None
    assert book.tenants["search"] == Tenant("search", weight=2.0, priority=0, requests_per_s=20.0, tokens_per_min=6000,
                                            max_concurrent=3, max_tokens=64)
    assert book.tenants["batch"] == Tenant("batch", priority=5)
    assert book.lookup(KEY_A.encode()).name == "search"
    assert book.lookup(KEY_B.encode()).name == "batch"
    assert book.lookup(b"sk-nobody") is None
    assert book.lookup(KEY_A.encode() + b"x") is None


@pytest.mark.parametrize("text, words", [
    ("[tenants.a]\nweight = 1\n", "exactly one of key or key_sha256"),
    ('[tenants.a]\nkey = "k1"\nkey_sha256 = "' + "0" * 64 + '"\n', "exactly one of key or key_sha256"),
    ('[tenants.a]\nkey_sha256 = "abc"\n', "64 hex digits"),
    ('[tenants.a]\nkey = "k1"\nweight = 0\n', "weight must be a number > 0"),
    ('[tenants.a]\nkey = "k1"\ntokens_per_min = 1.5\n', "tokens_per_min must be an integer > 0"),
    ('[tenants.a]\nkey = "k1"\nmax_concurrent = true\n', "max_concurrent must be an integer > 0"),
    ('[tenants.a]\nkey = "k1"\nburst = 3\n', "unknown field 'burst'"),
    ('[tenants."a b"]\nkey = "k1"\n', "tenant name"),
    ('[tenants.a]\nkey = "k1"\n[tenants.b]\nkey = "k1"\n', "have the same key"),
    ('[tenants.a]\nkey = "k 1"\n', "printable ASCII"),
    ('[other]\nx = 1\n', "unknown top-level entry"),
    ('[tenants.a\nkey = "k1"\n', "not valid TOML"),
])
def test_bad_tenants_files_are_refused_without_quoting_a_key(text, words):
    with pytest.raises(ValueError, match=words) as err:
        parse_tenants(text)
    assert "k1" not in str(err.value) and "k 1" not in str(err.value)


def test_token_bucket_holds_tokens_per_minute_with_a_virtual_clock():
    clock = Clock()
    tenant = Tenant("t", tokens_per_min=6000)  # 100 tokens/s, a bucket of TOKEN_BURST_S of them
    limits = Limits({"t": tenant}, clock)
    served = 0
    for _ in range(6000):  # 60 virtual seconds, a request of 10 tokens every 10 ms when the bucket lets it
        clock.t += 0.01
        try:
            st = limits.admit(tenant)
        except Limited:
            continue
        served += limits.reserve(st, 4, 6)  # the bucket is not in debt when admit() let it in
        limits.done(st, 10, 4, 6)
    burst = 100 * TOKEN_BURST_S
    assert 6000 + burst - 20 <= served <= 6000 + burst + 20


def test_limit_errors_name_the_limit_and_carry_retry_after():
    clock = Clock()
    tenant = Tenant("search", requests_per_s=2, max_concurrent=10)
    limits = Limits({"search": tenant}, clock)
    limits.admit(tenant)
    limits.admit(tenant)
    with pytest.raises(Limited) as err:
        limits.admit(tenant)
    api = limit_error(err.value)
    assert api.status == 429 and api.headers == {"Retry-After": "1"}
    assert api.code == "rate_limit_exceeded" and api.param == "requests_per_s"
    assert "'search'" in api.message and "requests_per_s" in api.message
    clock.t += 0.5  # one request's worth back
    limits.admit(tenant)

    tokens = Tenant("tok", tokens_per_min=600)  # 10 tokens/s
    limits = Limits({"tok": tokens}, clock)
    st = limits.admit(tokens)
    limits.reserve(st, 100, 200)  # 300 reserved from a bucket of 100: 200 in debt
    with pytest.raises(Limited) as err:
        limits.admit(tokens)
    assert err.value.retry_after == 21  # (200 + 1) / 10 tokens a second, rounded up
    limits.done(st, 300, 100, 0)  # used 100 of the 300: the debt is 0, the bucket at 0
    with pytest.raises(Limited) as err:
        limits.admit(tokens)
    assert err.value.retry_after == 1


def test_max_concurrent_counts_this_server_and_the_others():
    clock = Clock()
    tenant = Tenant("c", max_concurrent=3)
    limits = Limits({"c": tenant}, clock)
    a = limits.admit(tenant)
    limits.remote("other-server", "c", 2, 0, 2)  # another API server has 2 in flight
    with pytest.raises(Limited) as err:
        limits.admit(tenant)
    assert err.value.limit == "max_concurrent"
    limits.done(a, 0, 0, 0)
    limits.admit(tenant)
    clock.t += 10  # the other server went silent: its count expires
    limits.admit(tenant)


def test_remote_usage_charges_this_servers_buckets():
    clock = Clock()
    tenant = Tenant("t", tokens_per_min=600, requests_per_s=1)
    limits = Limits({"t": tenant}, clock)
    limits.remote("other", "t", 0, 100, 0)  # another server used the whole token bucket
    with pytest.raises(Limited) as err:
        limits.admit(tenant)
    assert err.value.limit == "tokens_per_min"
    clock.t += 1
    limits.remote("other", "t", 1, 0, 0)  # and the request bucket
    with pytest.raises(Limited) as err:
        limits.admit(tenant)
    assert err.value.limit == "requests_per_s"


def test_call_caps_max_tokens_and_reserves(tmp_path):
    gate = TenantGate(write(tmp_path, TOML), read_key_file(write(tmp_path, TOML))[1], Log())
    tenant = gate.authenticate(f"Bearer {KEY_A}".encode())
    call = gate.admit(tenant)

    class Req:
        max_tokens = None
        max_completion_tokens = None

    assert call.max_tokens(Req(), 10, 200) == 64  # the default clamps to the cap
    Req.max_tokens = 100
    with pytest.raises(ApiError) as err:
        call.max_tokens(Req(), 10, 100)
    assert err.value.status == 400 and err.value.param == "max_tokens" and "64" in err.value.message
    assert call.reserved == 74
    call.finish()
    assert gate.limits.states["search"].in_flight == 0
    assert gate.authenticate(f"bearer {KEY_B}".encode()).name == "batch"
    assert gate.authenticate(KEY_B.encode()) is None  # no scheme
    assert isinstance(call, Call)


def test_reload_logs_changes_never_keys_and_keeps_usage(tmp_path):
    path = write(tmp_path, TOML)
    log = Log()
    gate = TenantGate(path, read_key_file(path)[1], log)
    st = gate.limits.admit(gate.book.tenants["search"])
    gate.limits.reserve(st, 10, 50)
    level = gate.limits.states["search"].tokens.level
    (tmp_path / "keys").write_text(TOML.replace("tokens_per_min = 6000", "tokens_per_min = 12000").replace("[tenants.batch]", "[tenants.bulk]"))
    assert gate.reload()
    assert set(gate.book.tenants) == {"search", "bulk"}
    kept = gate.limits.states["search"]
    assert kept.in_flight == 1 and kept.tokens.level == level and kept.tokens.rate == 200
    assert gate.book.lookup(KEY_B.encode()).name == "bulk"
    (tmp_path / "keys").write_text('[tenants.x]\nkey = "bad key"\n')
    assert not gate.reload()  # kept the current tenants
    assert gate.book.lookup(KEY_A.encode()).name == "search"
    text = log.text
    for secret in (KEY_A, KEY_B, "bad key", hashlib.sha256(KEY_B.encode()).hexdigest()):
        assert secret not in text
    assert "tokens_per_min" in text and "bulk" in text


def test_changes_say_what_changed():
    old = {"a": Tenant("a", weight=1.0), "b": Tenant("b")}
    new = {"a": Tenant("a", weight=2.0), "c": Tenant("c")}
    assert changes(old, new) == [
        ("a", "changed", {"weight": "1.0 -> 2.0"}),
        ("b", "removed", {}),
        ("c", "added", {"weight": 1.0, "priority": 0, "requests_per_s": None, "tokens_per_min": None, "max_concurrent": None, "max_tokens": None}),
    ]
    assert DEFAULT_TENANT.name == "default"


def test_metrics_and_status_show_tenants(tmp_path):
    from dpserve.daemons.api.tenants.metrics import TenantCollector
    from dpserve.daemons.api.tenants.sync import TenantSync
    from dpserve.daemons.cli.status_table import render, tenants_from_metrics
    from dpserve.engine.common.protocol import TenantTotals
    from prometheus_client import CollectorRegistry, generate_latest

    gate = TenantGate(write(tmp_path, TOML), read_key_file(write(tmp_path, TOML))[1], Log())
    sync = TenantSync(lambda: gate.limits, "me", lambda data: None)
    sync.apply(TenantTotals([("search", 120.5, 3.0, 4), ("batch", 900.0, 1.0, 9)]))
    registry = CollectorRegistry()
    registry.register(TenantCollector(gate, sync, 1))
    call = gate.admit(gate.book.tenants["search"])
    call.prompt, call.completion = 7, 5
    call.finish()
    text = generate_latest(registry).decode()
    assert 'dpserve_tenant_requests_total{api_server="1",tenant="search"} 1.0' in text
    assert 'dpserve_tenant_tokens_total{api_server="1",kind="completion",tenant="search"} 5.0' in text
    tenants = tenants_from_metrics(text)
    assert {t["name"]: (t["tokens_per_s"], t["in_flight"]) for t in tenants} == {"search": (120.5, 4), "batch": (900.0, 9)}
    screen = render({"ready": True, "reason": "", "phase": "serving", "model": "m", "port": 8000, "pid": 1,
                     "data_parallel_size": 1, "children": [], "tenants": tenants})
    rows = screen.split("TENANT")[1].splitlines()
    assert rows[1].startswith("batch") and rows[2].startswith("search")  # busiest first
