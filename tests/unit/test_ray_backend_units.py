"""The Ray backend's plain-Python side: placement feasibility, the cluster
address, configuration rules and the node's plan (no Ray cluster needed)."""

from __future__ import annotations

import importlib.metadata
import os
import socket

import msgspec
import pytest
from click.testing import CliRunner
from dpserve.daemons.addresses import Addresses
from dpserve.daemons.cli.main import main as cli
from dpserve.daemons.config import ServeConfig
from dpserve.daemons.supervisor.plan import RayPlan, ephemeral_key_file, plan_children
from dpserve.engine.backends.ray import placement as ray_placement
from dpserve.engine.backends.ray.placement import RayError, placement_problem, resolve_address
from dpserve.engine.backends.ray.rank import RayRank

CPU1 = {"CPU": 1.0}


@pytest.mark.parametrize(
    "nodes, need, count, strategy, expect",
    [
        ([{"CPU": 1}, {"CPU": 1}], CPU1, 2, "strict-spread", ""),
        ([{"CPU": 1}, {"CPU": 1}], CPU1, 3, "strict-spread", "strict-spread needs 3 nodes that each hold one of 3 rank bundles of {CPU: 1}; 2 can"),
        ([{"CPU": 4}, {"CPU": 0.5}], CPU1, 2, "strict-spread", "1 can"),
        ([{"CPU": 4}, {"CPU": 1}], CPU1, 4, "strict-pack", ""),
        ([{"CPU": 2}, {"CPU": 2}], CPU1, 3, "strict-pack", "strict-pack needs one node that holds all 3"),
        ([{"CPU": 2}, {"CPU": 2}], CPU1, 4, "spread", ""),
        ([{"CPU": 2}, {"CPU": 1}], CPU1, 4, "pack", "CPU: needs 4, the cluster has 3"),
        ([{"CPU": 8}], {"CPU": 1.0, "GPU": 1.0}, 2, "spread", "GPU: needs 2, the cluster has 0"),
        # enough CPUs in total, but no node holds a whole 2-CPU bundle more than once
        ([{"CPU": 3}, {"CPU": 3}], {"CPU": 2.0}, 3, "spread", "no node fits enough of them"),
        ([{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}], {"CPU": 1.0, "GPU": 2.0}, 2, "strict-spread", ""),
        ([], CPU1, 1, "spread", "CPU: needs 1, the cluster has 0"),
    ],
)
def test_placement_problem_names_what_is_missing(nodes, need, count, strategy, expect):
    problem = placement_problem(nodes, need, count, strategy)
    if expect:
        assert expect in problem
    else:
        assert problem == ""


def test_resolve_address_given_env_then_ray_start_file(monkeypatch, tmp_path):
    assert resolve_address("10.0.0.5:6379") == "10.0.0.5:6379"
    with pytest.raises(RayError, match=r"Ray Client \(ray://\) is not supported"):
        resolve_address("ray://10.0.0.5:10001")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.6:6379")
    assert resolve_address("auto") == "10.0.0.6:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    current = tmp_path / "ray_current_cluster"
    monkeypatch.setattr(ray_placement, "RAY_CURRENT_CLUSTER", str(current))
    with pytest.raises(RayError, match="no Ray cluster found"):
        resolve_address("auto")
    current.write_text("127.0.0.1:6380\n")
    assert resolve_address("auto") == "127.0.0.1:6380"


def test_bad_address_forms_are_refused():
    with pytest.raises(RayError, match="is not HOST:PORT"):
        ray_placement.check_reachable("nohost", 1)


def test_ray_not_installed_is_a_config_error_with_the_install_hint(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert "pip install 'dpserve[ray]'" in ray_placement.ray_version_problem()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"pip install 'dpserve\[ray\]'"):
        ServeConfig(model=str(tmp_path), served_model_name="m", data_parallel_backend="ray").validate()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.9.3")
    assert "supports ray>=2.60,<3" in ray_placement.ray_version_problem()


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    return str(tmp_path)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(data_parallel_backend="threads"), "--data-parallel-backend must be one of mp, ray"),
        (dict(data_parallel_backend="ray", ray_placement="anywhere"), "--ray-placement must be one of"),
        (dict(data_parallel_backend="ray", ray_cpus_per_rank=0), "--ray-cpus-per-rank must be positive"),
        (dict(data_parallel_backend="ray", role="head", data_parallel_size=2, data_parallel_size_local=1), "Ray's nodes need no dpserve worker"),
        (dict(data_parallel_backend="ray", role="head", data_parallel_size=2, lb_mode="global"), "or a load-balancing mode"),
    ],
)
def test_ray_configuration_rules(model_dir, kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("`", "`")):
        ServeConfig(model=model_dir, served_model_name="m", **kw).validate()


def test_ray_flags_without_the_ray_backend_are_refused_not_ignored(model_dir):
    for flags in (["--ray-address", "1.2.3.4:6379"], ["--data-parallel-key-file", "/etc/x"], ["--ray-placement", "pack"]):
        result = CliRunner().invoke(cli, ["serve", model_dir, *flags])
        assert result.exit_code == 2, result.output
    result = CliRunner().invoke(cli, ["worker", model_dir, "--data-parallel-backend", "ray"])
    assert result.exit_code == 2 and "No such option" in result.output


def test_ray_mode_uses_authenticated_tcp_and_plans_a_proxy_per_rank(model_dir, tmp_path):
    key = ephemeral_key_file(str(tmp_path))
    assert oct(os.stat(key).st_mode & 0o777) == "0o600" and len(open(key).read()) == 64
    cfg = ServeConfig(model=model_dir, served_model_name="m", data_parallel_size=2, api_server_count=2, data_parallel_backend="ray",
                      data_parallel_address="10.1.2.3", key_file=key, ray_placement="strict-spread", ray_cpus_per_rank=2)
    assert cfg.uses_tcp and not cfg.is_multi_node
    addr = Addresses.for_node(cfg, str(tmp_path), "10.1.2.3")
    assert addr.coordinator_engines == "tcp://10.1.2.3:29550" and addr.api_engines == ["tcp://10.1.2.3:29552", "tcp://10.1.2.3:29553"]
    ray = RayPlan(address="10.1.2.3:6379", node_ip="10.1.2.3", group_name="dpserve-x-h-1")
    with socket.create_server(("127.0.0.1", 0)) as listen:
        children = {c.name: c for c in plan_children(cfg, addr, [listen], 512, 1.0, ray)}
    assert {c.kind for c in children.values()} == {"coordinator", "engine", "placement", "api"}
    holder = msgspec.json.decode(children["ray-placement"].config_json, type=ray_placement.RayPlacement)
    assert (holder.ranks, holder.strategy, holder.cpus_per_rank, holder.group_name) == (2, "strict-spread", 2, "dpserve-x-h-1")
    assert (holder.gpus_per_rank, holder.tensor_parallel_size) == (-1, 1), "GPUs resolved by the placement child, from the cluster"
    for rank in (0, 1):
        child = children[f"engine-dp{rank}"]
        assert child.module == "dpserve.engine.backends.ray.rank"
        proxy = msgspec.json.decode(child.config_json, type=RayRank)
        assert proxy.engine.engine.rank == rank and proxy.group_name == "dpserve-x-h-1"
        assert proxy.key_file == key and proxy.engine.key_file == "", "the actor gets the secret from its proxy, not a path on another node"
        assert proxy.engine.coordinator_address == "tcp://10.1.2.3:29550"
        assert child.extra_env["RAY_DISABLE_WORKER_LOG_PREFIX"] == "1"
