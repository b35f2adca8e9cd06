"""Node configuration: what the CLI parses and what each child process receives.

The supervisor turns one ServeConfig into per-child configs (msgspec Structs)
and hands each to its child as JSON in the environment, so secrets such as the
API key never show in `ps`. Never imports torch.

Each default is written once: an engine setting's in EngineConfig, a node
setting's here in ServeConfig; the CLI shows these (cli/options.py) and a
child's config copies its values from ServeConfig by field name (child_config).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import msgspec
from dpserve.daemons.api.tenants import Tenant
from dpserve.daemons.coordinator.routing import is_node_local
from dpserve.engine.common.config import ENGINES, NATIVE_ENGINE, SCHEDULING_POLICIES, EngineConfig

S = TypeVar("S", bound=msgspec.Struct)

LB_POLICIES = ("queue", "tokens", "round-robin", "cache-aware")
LB_MODES = ("internal", "hybrid", "external", "global")
ROLES = ("serve", "head", "worker")
RESTART_POLICIES = ("always", "on-failure", "never")
API_SERVER_LAUNCH = ("prefork", "exec")
RANK_LINKS = ("auto", "direct", "node")
# --rank-links auto: through the node's hops from this many ranks in the cluster. At 256 ranks x 32
# API servers the hops started the cluster sooner (routable 4.2-4.9 s against 5.5-5.7 s) with 5.5 MiB
# less per API server; below, a hop's +50 us and +2-3 us of API-server CPU a message buy nothing
# (benchmarks/RESULTS.md, issue 30 fifth round).
NODE_LINKS_FROM_RANKS = 256
DP_BACKENDS = ("mp", "ray")
RAY_PLACEMENTS = ("spread", "strict-spread", "pack", "strict-pack")
# vLLM's names; the parsers are daemons/api/tools/parsers.py's and daemons/api/reasoning.py's
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def field_defaults(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """Each field's default (a fresh value for a factory's); required fields are left out."""
    out = {}
    for f in msgspec.structs.fields(struct):
        if f.default is not msgspec.NODEFAULT:
            out[f.name] = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            out[f.name] = f.default_factory()
    return out


def child_config(target: type[S], source: msgspec.Struct, prefix: str = "", **given: Any) -> S:
    """A `target` whose fields are `given`, else copied from the field of `source`
    with the same name (first with `prefix`: ray_cpus_per_rank -> cpus_per_rank).
    msgspec checks every type, so a same-named field of another meaning fails here."""
    have = set(source.__struct_fields__)
    values = dict(given)
    for name in target.__struct_fields__:
        if name in values:
            continue
        for candidate in (prefix + name, name) if prefix else (name,):
            if candidate in have:
                values[name] = getattr(source, candidate)
                break
    return msgspec.convert(values, type=target)


_ENGINE = field_defaults(EngineConfig)


class ServeConfig(msgspec.Struct, kw_only=True):
    """Everything `dpserve serve` was asked to do on this node."""

    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # --api-key-file as a TOML file of tenants (daemons/api/tenants): each API server reads it,
    # again on SIGHUP; tenant_keys is that file as the node started (key sha256 hex, tenant):
    # what an API server serves if the file cannot be read when it starts
    tenants_file: str | None = None
    tenant_keys: list[tuple[str, Tenant]] | None = None
    data_parallel_size: int = 1
    api_server_count: int = 1  # 0 on a headless worker: it runs none
    # the ranks' engine settings; their defaults are EngineConfig's
    dtype: str = _ENGINE["dtype"]
    device: str = _ENGINE["device"]
    max_model_len: int = _ENGINE["max_model_len"]
    max_num_seqs: int = _ENGINE["max_num_seqs"]
    max_num_batched_tokens: int = _ENGINE["max_num_batched_tokens"]
    enable_chunked_prefill: bool = _ENGINE["enable_chunked_prefill"]
    enforce_eager: bool | None = _ENGINE["enforce_eager"]
    scheduling_policy: str = _ENGINE["scheduling_policy"]  # also read by the API servers (a nonzero priority under fcfs: 400)
    long_prefill_token_threshold: int = _ENGINE["long_prefill_token_threshold"]
    kv_cache_memory_bytes: int = _ENGINE["kv_cache_memory_bytes"]
    gpu_memory_utilization: float = _ENGINE["gpu_memory_utilization"]
    block_size: int = _ENGINE["block_size"]
    cpu_reserved_cores: int = -1  # CPU ranks' threads leave this many cores to the API servers (-1: plan.rank_threads' rule)
    # the rank engine: dpserve (native) or vllm (vLLM's LLMEngine in the rank process)
    engine: str = _ENGINE["engine"]
    tensor_parallel_size: int = _ENGINE["tensor_parallel_size"]
    enable_prefix_caching: bool | None = _ENGINE["enable_prefix_caching"]
    engine_args: dict[str, str] = {}  # --engine-arg KEY=VALUE (vLLM EngineArgs fields)
    lb_policy: str = "tokens"
    kv_events: bool = True  # cache-aware: route on the ranks' KV events (off: on what was sent, approximate)
    max_waiting_per_rank: int = 4096
    # admission held at the frontend (daemons/api/admission.py): a rank running --max-num-seqs
    # sequences with hold_waiting_per_rank more waiting is full; while every rank is, requests wait
    # at the API server in per-tenant queues, released in weighted fair order (off: every request
    # goes straight to a rank's queue, up to max_waiting_per_rank)
    admission_hold: bool = True
    hold_waiting_per_rank: int = 1
    max_held_per_tenant: int = 1024  # per API server; beyond it 429
    reserve_window_s: float = 5.0  # places reserved by recent demand per (class, tenant) (api/reserve.py); 0: none
    max_request_body_bytes: int = 4 * 1024 * 1024
    # structured output's cost model (daemons/api/guided.py): past these, 400 before any compile
    max_guided_grammar_bytes: int = 65536
    max_guided_bytes_per_request: int = 1 << 20
    max_guided_choices: int = 1000
    max_guided_regex_size: int = 4096
    max_guided_schema_properties: int = 1000
    max_guided_schema_depth: int = 64
    max_response_bytes: int = 64 * 1024 * 1024  # a request whose response could be larger gets 400
    # vLLM's: the most logprobs a request may ask for (-1: the vocabulary), /load, /tokenizer_info
    max_logprobs: int = 20
    return_tokens_as_token_ids: bool = False  # vLLM's: the request field's default
    enable_force_include_usage: bool = False  # vLLM's: every stream as if it asked for continuous usage
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False
    # vLLM's tool calling ("auto" parses answers with the parser) and reasoning output
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    generation_config: str = "auto"  # vLLM's: a request's unset sampling values (api/sampling_defaults.py)
    override_generation_config: str = ""
    # API servers: how long a request waits for a rank, for its first token, and HTTP limits
    wait_for_engine_s: float = 60.0
    request_first_token_timeout_s: float = 600.0
    # a request whose rank is lost or drained moves to another rank (at most this often); pinned ones only if asked
    max_migrations: int = 3
    migrate_pinned: bool = False
    http_idle_timeout_s: float = 30.0
    http_body_timeout_s: float = 60.0
    http_max_connections: int = 2048
    # streams whose clients stop reading: bytes held per stream and per API server, then a pause; abort after the timeout
    stream_buffer_bytes: int = 1 << 20
    stream_buffer_total_bytes: int = 256 << 20
    stream_write_timeout_s: float = 60.0
    seed: int = _ENGINE["seed"]
    # supervisor
    supervisor_host: str = "127.0.0.1"
    supervisor_port: int = 9256
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 5.0
    probe_failure_threshold: int = 3
    engine_startup_timeout_s: float = 600.0
    coordinator_startup_timeout_s: float = 60.0
    api_server_startup_timeout_base_s: float = 30.0
    api_server_startup_timeout_per_server_s: float = 5.0
    api_server_launch: str = "prefork"  # fork API servers from a pre-imported launcher, or exec each
    # how this node's ranks reach the API servers: a connection each, or one per node per API
    # server through the node's hop (engine/rank/node_hop.py; for clusters of hundreds of ranks)
    rank_links: str = "auto"
    restart_policy: str = "always"
    restart_backoff_initial_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    max_restarts: int = 10  # within restart_window_s, per child
    restart_window_s: float = 300.0
    shutdown_timeout_s: float = 30.0
    kill_grace_s: float = 5.0
    run_dir: str = ""  # ipc sockets; a private temp dir when empty
    log_level: str = "info"
    # multi-node (vLLM's flag names and meanings)
    role: str = "serve"  # serve: one node; head: coordinator + local ranks; worker: joins a head
    data_parallel_size_local: int = 0  # 0: all ranks on this node
    data_parallel_start_rank: int = 0
    # Ranks may join a running head up to this many (0: --data-parallel-size; same on every node).
    data_parallel_size_max: int = 0
    data_parallel_address: str = "127.0.0.1"  # the head's address
    data_parallel_rpc_port: int = 29550
    # First port of this node's API servers' engine channels (API server i: base+i); 0: rpc-port+2.
    # Two nodes on one address need different bases.
    data_parallel_api_rpc_port_base: int = 0
    # The head is ready while at least this many ranks are routable (0: one); startup still waits for all.
    min_ready_ranks: int = 0
    node_address: str = ""  # this node's address for its API servers (workers; default: route to head)
    headless: bool = False
    lb_mode: str = "internal"
    key_file: str = ""
    # Ray as the distributed backend (`dpserve serve` only): ranks are actors on a Ray cluster
    data_parallel_backend: str = "mp"  # mp: ranks are this node's processes; ray: Ray actors
    ray_address: str = "auto"  # the cluster's GCS HOST:PORT; auto: RAY_ADDRESS, then `ray start`'s
    ray_placement: str = "spread"
    ray_cpus_per_rank: float = 1.0
    ray_gpus_per_rank: float = -1.0  # < 0: --tensor-parallel-size when the cluster has GPUs, else 0
    ray_connect_timeout_s: float = 15.0
    ray_placement_timeout_s: float = 60.0

    @property
    def node_hops(self) -> bool:
        """Whether this node's ranks reach the API servers through its hops (--rank-links)."""
        if self.rank_links == "auto":
            return self.data_parallel_size >= NODE_LINKS_FROM_RANKS
        return self.rank_links == "node"

    @property
    def uses_ray(self) -> bool:
        return self.data_parallel_backend == "ray"

    @property
    def uses_tcp(self) -> bool:
        """Ranks reach this node over TCP (authenticated): other nodes hold ranks,
        or Ray may place them anywhere."""
        return self.is_multi_node or self.uses_ray

    @property
    def size_local(self) -> int:
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def size_max(self) -> int:
        """The most ranks the deployment may hold: the size of every rank-indexed array."""
        return max(self.data_parallel_size_max, self.data_parallel_size)

    @property
    def local_ranks(self) -> range:
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + self.size_local)

    @property
    def is_multi_node(self) -> bool:
        """Ranks live on other nodes too, or may join (a head holding every rank, for good, is a single node)."""
        return self.size_local < self.size_max

    @property
    def runs_coordinator(self) -> bool:
        return self.role in ("serve", "head")

    @property
    def runs_api_servers(self) -> bool:
        return not self.headless

    def eligible_ranks(self) -> list[int]:
        """Ranks this node's API servers route to (per API server in external mode: see api_ranks)."""
        if is_node_local(self.lb_mode):
            return list(self.local_ranks)
        return list(range(self.size_max))  # ranks that have not joined (yet) are simply not routable

    @property
    def api_rpc_port_base(self) -> int:
        """API server i's engine channel listens on this + i (multi-node)."""
        return self.data_parallel_api_rpc_port_base or self.data_parallel_rpc_port + 2

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
        if self.runs_api_servers and self.api_server_count < 1:
            raise ValueError("--api-server-count must be at least 1")
        self._validate_engine()
        if self.cpu_reserved_cores < -1:
            raise ValueError("--cpu-reserved-cores must be -1 (the rule) or a number of cores")
        if self.lb_policy not in LB_POLICIES:
            raise ValueError(f"--lb-policy must be one of {', '.join(LB_POLICIES)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.api_server_launch not in API_SERVER_LAUNCH:
            raise ValueError(f"--api-server-launch must be one of {', '.join(API_SERVER_LAUNCH)}")
        if self.rank_links not in RANK_LINKS:
            raise ValueError(f"--rank-links must be one of {', '.join(RANK_LINKS)}")
        if self.restart_policy not in RESTART_POLICIES:
            raise ValueError(f"--restart-policy must be one of {', '.join(RESTART_POLICIES)}")
        if self.probe_interval_s <= 0 or self.probe_timeout_s <= 0 or self.probe_failure_threshold < 1:
            raise ValueError("probe interval and timeout must be positive, threshold at least 1")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if self.lb_mode not in LB_MODES:
            raise ValueError(f"load-balancing mode must be one of {', '.join(LB_MODES)}")
        size, local, start = self.data_parallel_size, self.size_local, self.data_parallel_start_rank
        if self.data_parallel_size_max and self.data_parallel_size_max < size:
            raise ValueError(f"--data-parallel-size-max {self.data_parallel_size_max} is below --data-parallel-size {size}")
        # A worker may hold ranks past the starting size (it joins a running head), up to the max.
        joins = self.role == "worker" and self.data_parallel_size_max
        bound, flag = (self.size_max, "--data-parallel-size-max") if joins else (size, "--data-parallel-size")
        if local < 1 or local > bound:
            raise ValueError(f"--data-parallel-size-local {local} must be in [1, {flag} {bound}]")
        if start < 0 or start + local > bound:
            raise ValueError(f"--data-parallel-start-rank {start} + --data-parallel-size-local {local} exceeds {flag} {bound}")
        if self.role == "serve" and self.size_max != size:
            raise ValueError("ranks join a running head: --data-parallel-size-max is for `dpserve head` and `dpserve worker`")
        if self.role == "serve" and (local != size or start != 0 or self.headless):
            raise ValueError("`dpserve serve` runs every rank on this node; use `dpserve head` / `dpserve worker` for multi-node")
        if self.role == "head" and start != 0:
            raise ValueError("the head holds ranks from 0: --data-parallel-start-rank must be 0 on the head")
        if self.role == "worker" and start == 0:
            raise ValueError("a worker cannot hold rank 0 (the head does): set --data-parallel-start-rank")
        if self.headless and self.role != "worker":
            raise ValueError("--headless is for workers")
        if self.headless and self.lb_mode != "internal":
            raise ValueError(f"--headless contradicts --{self.lb_mode} load balancing: that mode runs API servers on every node")
        if self.role == "worker" and not self.headless and self.lb_mode == "internal":
            raise ValueError("in internal load balancing only the head runs API servers: start workers with --headless")
        if self.lb_mode == "external" and self.api_server_count != local:
            raise ValueError("external load balancing runs one API server per local rank: --api-server-count must equal --data-parallel-size-local")
        if not 0 <= self.min_ready_ranks <= size:
            raise ValueError(f"--min-ready-ranks {self.min_ready_ranks} must be in [0, --data-parallel-size {size}]")
        if self.runs_api_servers and self.api_rpc_port_base + self.api_server_count - 1 > 65535:
            raise ValueError("--data-parallel-api-rpc-port-base + --api-server-count exceeds port 65535")
        self._validate_ray()
        if self.is_multi_node and not self.key_file:
            raise ValueError(
                "multi-node traffic must be authenticated: give --data-parallel-key-file (the same secret on every node)"
            )
        if self.key_file and not os.path.isfile(self.key_file):
            raise ValueError(f"key file {self.key_file!r} does not exist")
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"{self.model!r} holds no config.json: not a Hugging Face model directory")

    def _validate_ray(self) -> None:
        if self.data_parallel_backend not in DP_BACKENDS:
            raise ValueError(f"--data-parallel-backend must be one of {', '.join(DP_BACKENDS)}")
        if not self.uses_ray:
            return
        if self.role == "worker" or self.size_local != self.data_parallel_size or self.lb_mode != "internal":
            raise ValueError(
                "--data-parallel-backend ray places every rank from one node: `dpserve serve` (or `dpserve head` without"
                " --data-parallel-size-local or a load-balancing mode); Ray's nodes need no dpserve worker"
            )
        if self.ray_placement not in RAY_PLACEMENTS:
            raise ValueError(f"--ray-placement must be one of {', '.join(RAY_PLACEMENTS)}")
        if self.ray_cpus_per_rank <= 0:
            raise ValueError("--ray-cpus-per-rank must be positive")
        from dpserve.engine.backends.ray.placement import ray_version_problem

        problem = ray_version_problem()
        if problem:
            raise ValueError(problem)

    def _validate_engine(self) -> None:
        """Options that do not apply to the chosen engine are refused, never ignored."""
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if self.engine == NATIVE_ENGINE:
            native = "the native engine (--engine native)"
            if self.engine_args:
                raise ValueError(f"--engine-arg passes options to vLLM's engine; {native} takes none: use --engine vllm")
            if self.tensor_parallel_size != 1:
                raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: {native} runs one device per rank; use --engine vllm")
            return
        # vLLM: installed, a supported version (package metadata only: importing vLLM takes seconds)
        from dpserve.engine.backends.vllm.args import check_vllm_version, vllm_version

        problem = check_vllm_version(vllm_version())
        if problem:
            raise ValueError(problem)


_SERVE = field_defaults(ServeConfig)


class ApiServerConfig(msgspec.Struct, kw_only=True):
    name: str
    index: int
    node_rank: int
    coordinator_address: str
    eligible_ranks: list[int]  # ranks this API server may route to
    key_file: str
    model_dir: str
    served_model_name: str
    api_key: str | None
    tenants_file: str | None = None
    tenant_keys: list[tuple[str, Tenant]] | None = None
    data_parallel_size: int
    max_model_len: int
    lb_policy: str
    kv_events: bool = True
    scheduling_policy: str = _SERVE["scheduling_policy"]
    max_waiting_per_rank: int
    admission_hold: bool = _SERVE["admission_hold"]
    hold_waiting_per_rank: int = _SERVE["hold_waiting_per_rank"]
    max_num_seqs: int = _SERVE["max_num_seqs"]  # a rank's batch places (the hold counts them)
    max_held_per_tenant: int = _SERVE["max_held_per_tenant"]
    reserve_window_s: float = _SERVE["reserve_window_s"]
    api_server_count: int = 1  # on this node (reservations split the places between them)
    max_request_body_bytes: int
    shutdown_timeout_s: float
    listen_fd: int
    engine_address: str
    table_address: str
    supervisor_address: str
    probe_path: str
    parent_pid: int
    # ServeConfig's defaults, for tools that run an API server without a node (benchmarks/simcluster.py)
    log_level: str = _SERVE["log_level"]
    wait_for_engine_s: float = _SERVE["wait_for_engine_s"]
    request_first_token_timeout_s: float = _SERVE["request_first_token_timeout_s"]
    max_migrations: int = _SERVE["max_migrations"]
    migrate_pinned: bool = _SERVE["migrate_pinned"]
    http_idle_timeout_s: float = _SERVE["http_idle_timeout_s"]
    http_body_timeout_s: float = _SERVE["http_body_timeout_s"]
    http_max_connections: int = _SERVE["http_max_connections"]
    stream_buffer_bytes: int = _SERVE["stream_buffer_bytes"]
    stream_buffer_total_bytes: int = _SERVE["stream_buffer_total_bytes"]
    stream_write_timeout_s: float = _SERVE["stream_write_timeout_s"]
    max_guided_grammar_bytes: int = _SERVE["max_guided_grammar_bytes"]
    max_guided_bytes_per_request: int = _SERVE["max_guided_bytes_per_request"]
    max_guided_choices: int = _SERVE["max_guided_choices"]
    max_guided_regex_size: int = _SERVE["max_guided_regex_size"]
    max_guided_schema_properties: int = _SERVE["max_guided_schema_properties"]
    max_guided_schema_depth: int = _SERVE["max_guided_schema_depth"]
    max_response_bytes: int = _SERVE["max_response_bytes"]
    max_logprobs: int = _SERVE["max_logprobs"]
    return_tokens_as_token_ids: bool = _SERVE["return_tokens_as_token_ids"]
    enable_force_include_usage: bool = _SERVE["enable_force_include_usage"]
    enable_server_load_tracking: bool = _SERVE["enable_server_load_tracking"]
    enable_tokenizer_info_endpoint: bool = _SERVE["enable_tokenizer_info_endpoint"]
    enable_auto_tool_choice: bool = _SERVE["enable_auto_tool_choice"]
    tool_call_parser: str | None = _SERVE["tool_call_parser"]
    reasoning_parser: str | None = _SERVE["reasoning_parser"]
    generation_config: str = _SERVE["generation_config"]
    override_generation_config: str = _SERVE["override_generation_config"]


class CoordinatorConfig(msgspec.Struct, kw_only=True):
    name: str
    lb_mode: str
    key_file: str
    engines_address: str
    table_address: str
    supervisor_address: str
    data_parallel_size: int
    fingerprint: str
    heartbeat_interval_s: float
    stale_after_s: float
    parent_pid: int
    log_level: str = _SERVE["log_level"]
