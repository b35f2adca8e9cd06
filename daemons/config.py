"""Node configuration: what the CLI parses and what each child process receives.

The supervisor turns one ServeConfig into per-child configs (msgspec Structs)
and hands each to its child as JSON in the environment, so secrets such as the
API key never show in `ps`. Never imports torch.
"""

from __future__ import annotations

import os

import msgspec
from dpserve.engine.config import EngineConfig, EngineProcessConfig  # noqa: F401
from dpserve.engine.procutil import CHILD_CONFIG_ENV, child_config_from_env  # noqa: F401

LB_POLICIES = ("queue", "tokens", "round-robin")
RESTART_POLICIES = ("always", "on-failure", "never")


class ServeConfig(msgspec.Struct, kw_only=True):
    """Everything `dpserve serve` was asked to do on this node."""

    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    data_parallel_size: int = 1
    api_server_count: int = 1
    dtype: str = "auto"
    max_model_len: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    lb_policy: str = "queue"
    max_waiting_per_rank: int = 4096
    max_request_body_bytes: int = 4 * 1024 * 1024
    seed: int = 0
    # supervisor
    supervisor_host: str = "127.0.0.1"
    supervisor_port: int = 9256
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 5.0
    probe_failure_threshold: int = 3
    engine_startup_timeout_s: float = 600.0
    api_server_startup_timeout_base_s: float = 30.0
    api_server_startup_timeout_per_server_s: float = 5.0
    restart_policy: str = "always"
    restart_backoff_initial_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    max_restarts: int = 10  # within restart_window_s, per child
    restart_window_s: float = 300.0
    shutdown_timeout_s: float = 30.0
    kill_grace_s: float = 5.0
    run_dir: str = ""  # ipc sockets; a private temp dir when empty
    log_level: str = "info"

    @property
    def api_server_startup_timeout_s(self) -> float:
        """Scales with the number of API servers (vLLM #43768 hard-coded it)."""
        return (
            self.api_server_startup_timeout_base_s
            + self.api_server_startup_timeout_per_server_s * self.api_server_count
        )

    def validate(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        if self.api_server_count < 1:
            raise ValueError("--api-server-count must be at least 1")
        if self.lb_policy not in LB_POLICIES:
            raise ValueError(f"--lb-policy must be one of {', '.join(LB_POLICIES)}")
        if self.restart_policy not in RESTART_POLICIES:
            raise ValueError(f"--restart-policy must be one of {', '.join(RESTART_POLICIES)}")
        if self.probe_interval_s <= 0 or self.probe_timeout_s <= 0 or self.probe_failure_threshold < 1:
            raise ValueError("probe interval and timeout must be positive, threshold at least 1")
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"{self.model!r} holds no config.json: not a Hugging Face model directory")


class Addresses(msgspec.Struct, kw_only=True):
    """ZeroMQ endpoints of one node (ipc:// on a single node)."""

    supervisor: str
    coordinator_engines: str
    coordinator_table: str
    api_engines: list[str]  # index = API-server index
    api_probes: list[str]  # unix socket paths for per-API-server HTTP probes

    @classmethod
    def for_run_dir(cls, run_dir: str, api_server_count: int) -> "Addresses":
        return cls(
            supervisor=f"ipc://{run_dir}/supervisor.ctl",
            coordinator_engines=f"ipc://{run_dir}/coordinator.engines",
            coordinator_table=f"ipc://{run_dir}/coordinator.table",
            api_engines=[f"ipc://{run_dir}/api-{i}.engines" for i in range(api_server_count)],
            api_probes=[f"{run_dir}/api-{i}.http" for i in range(api_server_count)],
        )


class ApiServerConfig(msgspec.Struct, kw_only=True):
    name: str
    index: int
    model_dir: str
    served_model_name: str
    api_key: str | None
    data_parallel_size: int
    max_model_len: int
    lb_policy: str
    max_waiting_per_rank: int
    max_request_body_bytes: int
    shutdown_timeout_s: float
    listen_fd: int
    engine_address: str
    table_address: str
    supervisor_address: str
    probe_path: str
    parent_pid: int
    log_level: str = "info"


class CoordinatorConfig(msgspec.Struct, kw_only=True):
    name: str
    engines_address: str
    table_address: str
    supervisor_address: str
    api_server_addresses: list[str]
    data_parallel_size: int
    fingerprint: str
    heartbeat_interval_s: float
    stale_after_s: float
    parent_pid: int
    log_level: str = "info"
