"""Node configuration rules and the shared-secret key derivation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from dpserve.daemons.addresses import Addresses
from dpserve.daemons.config import ServeConfig
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


def parse(command: str, argv: list[str]) -> tuple[dict, set[str], list[tuple[str, str]]]:
    """The options a node command would run with, what the user gave, and the deprecated spellings used."""
    from dpserve.daemons.cli.main import main
    from dpserve.daemons.cli.options import given

    ctx = main.commands[command].make_context(command, list(argv))
    opts = dict(ctx.params)
    names, used = given(ctx, opts)
    return opts, names, used


RENAMED = [  # old spelling, new spelling, parameter, a value
    ("--supervisor-host", "--data-parallel-supervisor-host", "supervisor_host", "10.0.0.9"),
    ("--shutdown-timeout-s", "--shutdown-timeout", "shutdown_timeout_s", "12"),
]
# vLLM's own spellings, kept as the primary names (they are what a vLLM user types).
VLLM_NAMES = ["--data-parallel-supervisor-port", "--dp-supervisor-probe-interval-s", "--dp-supervisor-probe-timeout-s",
              "--dp-supervisor-probe-failure-threshold", "--shutdown-timeout", "--data-parallel-size", "--api-server-count"]


def env_name(flag: str) -> str:
    return "DPSERVE_" + flag[2:].upper().replace("-", "_")


@pytest.fixture
def clean_env(monkeypatch):
    for old, new, _, _ in RENAMED:
        monkeypatch.delenv(env_name(old), raising=False)
        monkeypatch.delenv(env_name(new), raising=False)
    return monkeypatch


@pytest.mark.parametrize("old, new, name, value", RENAMED)
@pytest.mark.parametrize("command", ["serve", "head", "worker"])
def test_old_spellings_still_work_and_are_reported(clean_env, command, old, new, name, value):
    opts, names, used = parse(command, [old, value])
    assert str(opts[name]) == str(type(opts[name])(value)) and name in names
    assert used == [(old, new)]
    clean_env.setenv(env_name(old), value)
    opts, names, used = parse(command, [])
    assert str(opts[name]) == str(type(opts[name])(value)) and used == [(env_name(old), env_name(new))]
    # the new spelling wins over the old one from the same place; the command line over the environment
    clean_env.setenv(env_name(new), "1")
    assert str(parse(command, [])[0][name]) == str(type(opts[name])("1"))
    assert str(parse(command, [old, value])[0][name]) == str(type(opts[name])(value))


def test_old_spellings_are_hidden_from_help():
    from dpserve.daemons.cli.main import main

    for command in ("serve", "head", "worker"):
        text = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
        for old, new, _, _ in RENAMED:
            assert new in text and f"{old} " not in text, (command, old)
        for name in VLLM_NAMES:
            assert f"{name} " in text, (command, name)


def test_an_old_spelling_logs_a_deprecation_line_naming_the_new_flag(tmp_path):
    """The journal line (warning priority, <4>) is written before the configuration is checked."""
    env = {**os.environ, "DPSERVE_SUPERVISOR_HOST": "127.0.0.1"}
    run = subprocess.run(
        [sys.executable, "-m", "dpserve.daemons.cli.main", "serve", str(tmp_path / "missing"), "--shutdown-timeout-s", "3"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert run.returncode == 2, run.stderr
    warnings = [line for line in run.stderr.splitlines() if line.startswith("<4>")]
    assert any("--shutdown-timeout-s is deprecated" in w and "use --shutdown-timeout" in w for w in warnings), run.stderr
    assert any("DPSERVE_SUPERVISOR_HOST is deprecated" in w and "DPSERVE_DATA_PARALLEL_SUPERVISOR_HOST" in w for w in warnings), run.stderr


def test_only_what_the_user_gave_counts_as_given(clean_env):
    opts, names, _ = parse("serve", ["--port", "8000"])  # the default's value, but given
    assert "port" in names and "host" not in names
    clean_env.setenv("DPSERVE_HOST", "0.0.0.0")
    assert "host" in parse("serve", [])[1]


def test_an_environment_error_names_the_variable(monkeypatch):
    from dpserve.daemons.cli.main import main

    monkeypatch.setenv("DPSERVE_DATA_PARALLEL_SIZE", "0")
    result = CliRunner().invoke(main, ["serve"])
    assert result.exit_code == 2 and "'DPSERVE_DATA_PARALLEL_SIZE'" in result.output, result.output
    monkeypatch.delenv("DPSERVE_DATA_PARALLEL_SIZE")
    result = CliRunner().invoke(main, ["serve", "-dp", "0"])
    assert result.exit_code == 2 and "'--data-parallel-size'" in result.output and "DPSERVE_" not in result.output


def test_serve_takes_the_one_node_head_options(model_dir, clean_env):
    from dpserve.daemons.cli.main import main

    opts, names, _ = parse("serve", ["--min-ready-ranks", "2", "-dp", "3"])
    assert opts["min_ready_ranks"] == 2 and "min_ready_ranks" in names
    # the engine channels' ports are TCP ports: Ray's, as --data-parallel-rpc-port
    result = CliRunner().invoke(main, ["serve", model_dir, "--data-parallel-api-rpc-port-base", "30000"])
    assert result.exit_code == 2 and "--data-parallel-api-rpc-port-base apply to --data-parallel-backend ray only" in result.output


def test_help_says_what_a_zero_default_means():
    from dpserve.daemons.cli.main import main

    text = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output.split())
    assert "--block-size INTEGER RANGE Tokens per KV-cache block. [default: (0 = the engine's own: 16 native" in text
    assert "%%" not in text and "40% of available memory" in text


def test_a_headless_worker_runs_no_api_server_whatever_the_count(model_dir, key_file):
    import structlog
    from dpserve.daemons.cli.main import _build_config

    opts, names, _ = parse("worker", [model_dir, "-dp", "4", "-dpl", "2", "-dpr", "2", "--headless", "--api-server-count", "2",
                                      "--data-parallel-key-file", key_file])
    opts.pop("ports_file")
    worker = _build_config("worker", model_dir, opts, names, structlog.get_logger())
    worker.validate()
    assert worker.api_server_count == 0


def test_each_child_gets_the_node_settings_it_shares_by_name(model_dir):
    """Child configs are filtered from ServeConfig: a setting given to the node reaches every child that has it."""
    import socket

    import msgspec
    from dpserve.daemons.config import ApiServerConfig, CoordinatorConfig
    from dpserve.daemons.supervisor.plan import plan_children
    from dpserve.engine.common.config import EngineProcessConfig

    node = cfg(model_dir, data_parallel_size=2, api_server_count=2, max_num_seqs=7, block_size=32, seed=5, log_level="debug",
               http_max_connections=99, shutdown_timeout_s=3.5, lb_policy="queue", api_key="k", engine_args={})
    with socket.create_server(("127.0.0.1", 0)) as listen:
        children = {c.name: c for c in plan_children(node, Addresses.for_node(node, "/run/x", "127.0.0.1"), [listen], 256, 0.5)}
    assert sorted(children) == ["api-0", "api-1", "coordinator", "engine-dp0", "engine-dp1"]
    api = msgspec.json.decode(children["api-1"].config_json, type=ApiServerConfig)
    assert (api.http_max_connections, api.shutdown_timeout_s, api.lb_policy, api.api_key, api.log_level) == (99, 3.5, "queue", "k", "debug")
    assert (api.max_model_len, api.model_dir, api.index, api.eligible_ranks) == (256, model_dir, 1, [0, 1])
    engine = msgspec.json.decode(children["engine-dp1"].config_json, type=EngineProcessConfig)
    assert (engine.engine.max_num_seqs, engine.engine.block_size, engine.engine.seed, engine.engine.max_model_len) == (7, 32, 5, 256)
    assert (engine.engine.rank, engine.engine.local_rank, engine.engine.num_local_ranks, engine.log_level) == (1, 1, 2, "debug")
    coord = msgspec.json.decode(children["coordinator"].config_json, type=CoordinatorConfig)
    assert (coord.data_parallel_size, coord.stale_after_s, coord.heartbeat_interval_s) == (2, 15.0, 0.5)


def test_cpu_reserved_cores_sets_the_ranks_threads(model_dir):
    import os
    import socket

    from dpserve.daemons.supervisor.plan import plan_children

    ncpu = len(os.sched_getaffinity(0))
    for reserved, local, want in ((-1, 1, ncpu), (ncpu, 1, 1), (1, 1, max(1, ncpu - 1)), (0, 2, max(1, ncpu // 2))):
        node = cfg(model_dir, data_parallel_size=local, api_server_count=1, cpu_reserved_cores=reserved, engine_args={})
        node.validate()
        with socket.create_server(("127.0.0.1", 0)) as listen:
            children = plan_children(node, Addresses.for_node(node, "/run/x", "127.0.0.1"), [listen], 256, 0.5)
        threads = {c.extra_env["OMP_NUM_THREADS"] for c in children if c.kind == "engine"}
        assert threads == {str(want)}, (reserved, local)
    with pytest.raises(ValueError, match="cpu-reserved-cores"):
        cfg(model_dir, cpu_reserved_cores=-2).validate()


def test_the_readme_options_table_matches_serve_help():
    """Every flag of the README's table is a visible `dpserve serve` option, and its default column is what --help shows."""
    from pathlib import Path

    from dpserve.daemons.cli.main import main

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("| option | default | meaning |"):].split("\n\n")[0].splitlines()[2:]
    serve = main.commands["serve"]
    ctx = serve.make_context("serve", [], resilient_parsing=True)
    by_flag = {opt: param for param in serve.params for opt in param.opts}
    assert len(table) > 30
    for row in table:
        flags, default = row.split(" | ")[0:2]
        flag = flags.strip("| ").split(",")[0].strip("`")
        param = by_flag[flag]
        assert not param.hidden, flag
        shows = param.show_default if isinstance(param.show_default, str) else param.get_default(ctx)
        if shows is None or shows == "":
            assert default == "none", (flag, default)
        elif isinstance(shows, (int, float)) and not isinstance(shows, bool):
            assert float(default) == shows, (flag, default, shows)
        else:
            assert default == str(shows), (flag, default, shows)


def test_the_native_engine_has_one_name_and_the_old_one_still_works(clean_env):
    """--engine native; --engine dpserve (its old name) is taken as native and reported, and
    both hash to the same fingerprint, so a node on the old name still joins its head."""
    from dpserve.engine.common.codec import config_fingerprint

    opts, names, used = parse("serve", ["--engine", "dpserve"])
    assert opts["engine"] == "native" and "engine" in names
    assert used == [("--engine dpserve", "--engine native")]
    opts, _, used = parse("serve", [])
    assert opts["engine"] == "native" and used == []
    assert config_fingerprint("m", "float32", 64, 2, "native") == config_fingerprint("m", "float32", 64, 2, "dpserve")
    assert config_fingerprint("m", "float32", 64, 2, "vllm") != config_fingerprint("m", "float32", 64, 2, "native")
