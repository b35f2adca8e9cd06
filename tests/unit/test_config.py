"""Node configuration rules and the shared-secret key derivation."""

from __future__ import annotations

import pytest
from dpserve.daemons.config import Addresses, ServeConfig
from dpserve.engine.common.auth import CurveKeys


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    return str(tmp_path)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "dp.key"
    path.write_text("s" * 32)
    return str(path)


def cfg(model_dir, **kw) -> ServeConfig:
    return ServeConfig(model=model_dir, served_model_name="m", **kw)


def test_api_server_startup_timeout_scales_with_count(model_dir):
    one = cfg(model_dir, api_server_count=1, api_server_startup_timeout_base_s=30, api_server_startup_timeout_per_server_s=5)
    sixteen = cfg(model_dir, api_server_count=16, api_server_startup_timeout_base_s=30, api_server_startup_timeout_per_server_s=5)
    assert one.api_server_startup_timeout_s == 35
    assert sixteen.api_server_startup_timeout_s == 110


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(role="head", data_parallel_size=4, data_parallel_size_local=2), "must be authenticated"),
        (dict(role="worker", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=3, headless=True), "exceeds"),
        (dict(role="worker", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=0, headless=True), "rank 0"),
        (dict(role="worker", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2), "--headless"),
        (dict(role="worker", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, headless=True, lb_mode="hybrid"), "contradicts"),
        (dict(role="head", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2), "start-rank must be 0"),
        (dict(role="serve", data_parallel_size=4, data_parallel_size_local=2), "dpserve head"),
        (dict(data_parallel_size=2, api_server_count=3, lb_mode="external", role="head"), "one API server per local rank"),
        (dict(lb_policy="random"), "--lb-policy"),
        (dict(probe_interval_s=0), "probe"),
    ],
)
def test_invalid_combinations_are_refused_clearly(model_dir, kw, message):
    with pytest.raises(ValueError, match=message):
        cfg(model_dir, **kw).validate()


def test_valid_multi_node_shapes(model_dir, key_file):
    cfg(model_dir, role="head", data_parallel_size=4, data_parallel_size_local=2, key_file=key_file).validate()
    cfg(model_dir, role="worker", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, headless=True, key_file=key_file).validate()
    hybrid = cfg(model_dir, role="worker", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, lb_mode="hybrid", key_file=key_file)
    hybrid.validate()
    assert hybrid.eligible_ranks() == [2, 3]
    assert cfg(model_dir, lb_mode="global", role="head", data_parallel_size=4, data_parallel_size_local=2).eligible_ranks() == [0, 1, 2, 3]


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        cfg(str(tmp_path / "nope")).validate()
    with pytest.raises(ValueError, match="config.json"):
        cfg(str(tmp_path)).validate()


def test_addresses_single_node_ipc_multi_node_tcp(model_dir, key_file):
    single = Addresses.for_node(cfg(model_dir, api_server_count=2), "/run/x", "127.0.0.1")
    assert single.coordinator_engines == "ipc:///run/x/coordinator.engines"
    assert single.api_engines == ["ipc:///run/x/api-0.engines", "ipc:///run/x/api-1.engines"]
    head = cfg(model_dir, role="head", data_parallel_size=4, data_parallel_size_local=2, api_server_count=2,
               data_parallel_address="10.0.0.1", data_parallel_rpc_port=29550, key_file=key_file)
    multi = Addresses.for_node(head, "/run/x", "10.0.0.1")
    assert multi.coordinator_engines == "tcp://10.0.0.1:29550"
    assert multi.coordinator_table == "tcp://10.0.0.1:29551"
    assert multi.api_engines == ["tcp://10.0.0.1:29552", "tcp://10.0.0.1:29553"]
    headless = cfg(model_dir, role="worker", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, headless=True)
    assert Addresses.for_node(headless, "/run/x", "10.0.0.2").api_engines == []


def test_curve_keys_derive_the_same_on_every_node_and_differ_per_secret():
    a, b, c = CurveKeys(b"x" * 32), CurveKeys(b"x" * 32), CurveKeys(b"y" * 32)
    assert a.server_public == b.server_public and a.client_secret == b.client_secret
    assert a.server_public != c.server_public and a.client_public != c.client_public
    assert a.server_public != a.client_public
    with pytest.raises(ValueError, match="at least"):
        CurveKeys(b"short")


@pytest.mark.parametrize(
    "env, expected",
    [({}, 30.0), ({"DPSERVE_SHUTDOWN_TIMEOUT_S": "12"}, 12.0), ({"DPSERVE_SHUTDOWN_TIMEOUT": "7"}, 7.0),
     ({"DPSERVE_SHUTDOWN_TIMEOUT_S": "12", "DPSERVE_SHUTDOWN_TIMEOUT": "7"}, 12.0)],
)
def test_shutdown_timeout_reads_the_s_name_and_keeps_the_old_one(monkeypatch, env, expected):
    from dpserve.daemons.cli.main import main

    for name in ("DPSERVE_SHUTDOWN_TIMEOUT_S", "DPSERVE_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main.commands["serve"].make_context("serve", []).params["shutdown_timeout"] == expected
