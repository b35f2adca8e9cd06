"""The ZeroMQ endpoints of one node, derived from its ServeConfig (ipc:// on a single
node, tcp:// on the advertised addresses when multi-node)."""

from __future__ import annotations

import msgspec
from dpserve.daemons.config import ServeConfig


class Addresses(msgspec.Struct, kw_only=True):
    """ZeroMQ endpoints of one node (ipc:// on a single node)."""

    supervisor: str
    coordinator_engines: str
    coordinator_table: str
    api_engines: list[str]  # index = API-server index
    api_probes: list[str]  # unix socket paths for per-API-server HTTP probes
    node_loads: str = ""  # the node's load relay: its ranks' LoadReports (issue 30; supervisor/relays.py)
    node_table: str = ""  # the node's table relay, when it runs: what its API servers subscribe to

    @classmethod
    def for_node(cls, cfg: ServeConfig, run_dir: str, node_address: str) -> Addresses:
        """ipc:// on a single node; tcp:// on the advertised addresses when multi-node.

        Ports on a multi-node deployment: rpc-port (coordinator: registration,
        load reports), rpc-port+1 (load table), api-rpc-port-base+i (API server
        i's engine channel, on the node that runs it; rpc-port+2+i by default).
        """
        n = cfg.api_server_count if cfg.runs_api_servers else 0
        probes = [f"{run_dir}/api-{i}.http" for i in range(n)]
        if cfg.uses_tcp:
            head, rpc, base = cfg.data_parallel_address, cfg.data_parallel_rpc_port, cfg.api_rpc_port_base
            engines, table = f"tcp://{head}:{rpc}", f"tcp://{head}:{rpc + 1}"
            api_engines = [f"tcp://{node_address}:{base + i}" for i in range(n)]
        else:
            engines, table = f"ipc://{run_dir}/coordinator.engines", f"ipc://{run_dir}/coordinator.table"
            api_engines = [f"ipc://{run_dir}/api-{i}.engines" for i in range(n)]
        return cls(
            supervisor=f"ipc://{run_dir}/supervisor.ctl",  # node-local either way
            coordinator_engines=engines,
            coordinator_table=table,
            api_engines=api_engines,
            api_probes=probes,
            node_loads=f"ipc://{run_dir}/node.loads",  # node-local either way
            node_table=f"ipc://{run_dir}/node.table",
        )
