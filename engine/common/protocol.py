"""Every message that crosses a process boundary in dpserve, as typed msgspec Structs.

This module owns the wire format (msgpack, tagged unions, one protocol version)
and nothing else: it must never import torch, transformers or anything from
dpserve.daemons, because API-server processes import it and must start fast.

Channels (who binds / who connects):
- API server  <-> engine:      API server binds a ROUTER, each engine connects a
  DEALER whose identity is its rank. Requests flow down, batched outputs up.
- engine       -> coordinator: coordinator binds a ROUTER; engines connect a
  DEALER, register (EngineRegister -> RegisterReply) and then send LoadReports.
- coordinator  -> API servers: coordinator binds a PUB; API servers SUB to LoadTable.
- every child  -> supervisor:  supervisor binds a PULL; children PUSH ChildReady
  and Heartbeat (heartbeats come from the loop that does the work).
- supervisor   -> coordinator: RankDown / RankUp on the coordinator's ROUTER.
"""

from __future__ import annotations

import msgspec
from dpserve.engine.kv_events import KVEventBatch, KVSnapshot, KVSnapshotRequest

# Raised when a message's wire form changes incompatibly: a node of the other version is refused
# at registration, by name, not left sending what the head cannot decode (2: NodeLoad packed; 3: LoadDelta flat;
# 4: KV events as routing keys, riding with outputs).
PROTOCOL_VERSION = 4

# Finish reasons as they appear in OpenAI responses, plus the internal one
# that the API server turns into an error.
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ERROR = "error"


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """What an engine needs to decode one request. Validated by the API server."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Penalties, bias, logprobs (vLLM's semantics). Trailing defaults are omitted on the wire, so a
    # plain request's bytes do not change.
    presence_penalty: float = 0.0  # output tokens only
    frequency_penalty: float = 0.0  # output tokens only, per occurrence
    repetition_penalty: float = 1.0  # prompt and output tokens
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's and the top k
    guided_grammar: str | None = None  # an llguidance grammar (JSON), built by the API server
    # vLLM's request priority: lower is served first under --scheduling-policy priority (the API
    # server refuses a nonzero one under fcfs). Last, and omitted at 0: a plain request's bytes do not change.
    priority: int = 0
    # vLLM's logprob_token_ids: with logprobs, these ids' logprobs at each position instead of the top ones
    # (the API server checks them against the vocabulary and --max-logprobs). Omitted when empty.
    logprob_token_ids: tuple[int, ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        """Anything that changes the logits before temperature (penalties, bias) or truncates like min_p."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_p or self.logit_bias or self.guided_grammar
        )


_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def seed_for(seed: int, position: int) -> int:
    """The 64-bit generator seed of output position `position` of a request seeded `seed`:
    splitmix64 of the pair, so neighbouring positions (and seeds) get unrelated streams.
    Any int is a valid API seed (wrapped to 64 bits: -1 -> 2**64 - 1)."""
    z = ((seed & _MASK64) + (position + 1) * 0x9E37_79B9_7F4A_7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return z ^ (z >> 31)


# ---------------------------------------------------------------- API server -> engine


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """A request for a rank. A continuation (a request moved from a lost or drained rank)
    carries the tokens it already produced as the last `num_prior_outputs` prompt ids:
    the engine prefills them with the prompt but counts them as outputs (max_tokens,
    min_tokens, penalties, the seeded position, the grammar's state) and never sends
    them again. `params` are the original request's, unchanged."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    num_prior_outputs: int = 0


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class PauseRequests(msgspec.Struct, tag="pause", array_like=True):
    """Stop stepping these requests: their clients stopped reading (the API server's
    stream buffer is full). They keep their place and KV; unknown ids are ignored."""

    request_ids: list[str]


class ResumeRequests(msgspec.Struct, tag="resume", array_like=True):
    """Step these paused requests again: their clients read what was buffered."""

    request_ids: list[str]


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Utility round trip; the engine answers with Pong from its busy loop."""

    nonce: int


EngineInput = AddRequest | AbortRequests | PauseRequests | ResumeRequests | Ping | KVSnapshotRequest  # (issue 29)


# ---------------------------------------------------------------- engine -> API server


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position's log-probabilities: the chosen token's (with its 1-based rank
    in the vocabulary) and the top alternatives, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request from one engine step.

    finish_reason is None while the request runs; once set, the engine has
    forgotten the request and sends nothing more for it.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when params.logprobs is set
    # With the first token, when params.prompt_logprobs is set: prompt tokens 1.. (token 0 has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # With the first token: prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    # With the first token: seconds from the engine's receipt to its first schedule (vLLM's queue time).
    queue_s: float = 0.0


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one engine step produced for one API server, and the step's KV events
    when it subscribed to them (one message a step, not two)."""

    rank: int
    outputs: list[RequestOutput]
    num_running: int
    num_waiting: int
    kv: KVEventBatch | None = None


class EngineHello(msgspec.Struct, tag="hello", array_like=True):
    """First message an engine sends on a freshly connected API-server channel."""

    rank: int
    incarnation: str
    protocol_version: int = PROTOCOL_VERSION


class Pong(msgspec.Struct, tag="pong", array_like=True):
    rank: int
    nonce: int


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    """Sent by a dying engine to every API server before it exits. `clean`: the
    stop was asked for (SIGTERM, a rolling restart), not a failure; trailing and
    defaulted, so a peer without it still decodes the message."""

    rank: int
    incarnation: str
    reason: str
    clean: bool = False


EngineToApi = EngineOutputs | EngineHello | Pong | EngineDead | KVEventBatch | KVSnapshot  # (KV events: engine/kv_events.py)


# ---------------------------------------------------------------- engine <-> coordinator


class EngineRegister(msgspec.Struct, tag="register", array_like=True):
    rank: int
    incarnation: str
    fingerprint: str
    pid: int
    host: str
    node_rank: int = 0  # the node's first rank: identifies the node
    protocol_version: int = PROTOCOL_VERSION


class RegisterReply(msgspec.Struct, tag="welcome", array_like=True):
    accepted: bool
    reason: str
    api_server_addresses: list[str]


class ApiServerList(msgspec.Struct, tag="api_list", array_like=True):
    """Coordinator -> engine: the API servers this engine must connect to (grows as nodes join)."""

    api_server_addresses: list[str]


class PleaseRegister(msgspec.Struct, tag="reregister", array_like=True):
    """Coordinator -> engine: I do not know you (I restarted, or declared you lost)."""

    reason: str


class ApiServerRegister(msgspec.Struct, tag="api_register", array_like=True):
    """API server -> coordinator, repeated every second: where engines reach me."""

    node_rank: int
    index: int
    address: str
    incarnation: str


class LoadReport(msgspec.Struct, tag="load", array_like=True):
    """An engine's load, sent whenever it changes (rate-limited) and as a heartbeat."""

    rank: int
    incarnation: str
    num_running: int
    num_waiting: int
    num_waiting_prefill_tokens: int
    num_remaining_decode_tokens: int
    slot_usage: float
    step_ms: float
    num_requests_finished: int = 0  # cumulative, since this incarnation started
    num_requests_aborted: int = 0  # cumulative: aborted by their API server (client gone, stop string)
    kv_usage: float = 0.0  # share of the rank's KV blocks in use (vLLM's kv_cache_usage_perc)
    num_preemptions: int = 0  # cumulative: sequences preempted for KV blocks (recomputed later)
    num_prefix_queries: int = 0  # cumulative: prompt tokens looked up in the prefix cache
    num_prefix_hits: int = 0  # cumulative: of those, tokens found cached


class OpenHop(msgspec.Struct, tag="open_hop", array_like=True):
    """Rank -> its node's relay (node-local): carry this rank's link to the API server at
    `address` through the node's hop for it (engine/rank/node_hop.py), opening the hop
    if the node has none yet. Idempotent; repeated on every reconnection."""

    address: str


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    """The engine is connected to every API server and takes requests."""

    rank: int
    incarnation: str


class RankDown(msgspec.Struct, tag="rank_down", array_like=True):
    """Supervisor -> coordinator: this rank's process is gone; fail its requests."""

    rank: int
    reason: str


class NodeHello(msgspec.Struct, tag="node_hello", array_like=True):
    """Supervisor -> coordinator, repeated every few seconds: the address the
    other nodes reach this node on (shown per rank in every node's /status)."""

    node_rank: int
    address: str


class PrefixRouted(msgspec.Struct, tag="prefix", array_like=True):
    """API server -> coordinator -> every API server (cache-aware routing): prompts
    with these block keys (daemons/prefix_index.py) were sent to these ranks.
    The coordinator forwards it unread; receivers skip their own (origin)."""

    origin: str  # the sending API server's incarnation
    routed: list[tuple[int, list[int]]]  # (rank, block keys of one prompt)


class GreetAgain(msgspec.Struct, tag="greet_again", array_like=True):
    """API server -> coordinator -> rank: the API server at `address` cannot route to
    `rank` (its sends fail, or it never heard this incarnation's hello); the rank
    reconnects its socket to that address and says hello on the fresh connection
    (a reason starting with GREET_NO_HELLO, on a young connection: only says hello)."""

    rank: int
    address: str
    reason: str = ""


GREET_NO_HELLO = "no hello from incarnation"  # GreetAgain.reason's start when only the hello is missing
# GreetAgain.reason from the coordinator itself when an API server came back (a new incarnation at
# a known address): a rank whose connection cannot show that (behind its node's hop, or without
# connection monitors) says hello at once; one whose monitor saw the new handshake has already.
GREET_API_RESTARTED = "api server restarted"


class NodeLoad(msgspec.Struct, tag="node_load", array_like=True):
    """A node's relay -> coordinator: its ranks' reports in one message (issue 30),
    once per report interval and, while loads change, at most every flush interval.
    `alive`: ranks whose own reports are fresh at the relay (the heartbeat: a rank
    missing from it goes stale at the coordinator; a silent node takes all of its
    ranks with it). `loads`: the reports that changed since the last NodeLoad (every
    rank's on a resync), each as (rank, incarnation, *a LoadDelta row), so that the
    coordinator keeps and forwards a row untouched. Registration, readiness and
    deaths still go per rank. `heard_ms_ago[i]`: how long before sending the relay
    last heard `alive[i]`, so that staleness is judged from the rank's own last
    report, not from its relay's last beat (empty: just now). All three are packed
    (engine/rank/node_relay.py: ROW, u32 lists), so the coordinator reads a drain of
    them as arrays, with no Python step a row."""

    node_rank: int
    seq: int
    alive: bytes
    loads: bytes
    heard_ms_ago: bytes = b""


class TenantUsage(msgspec.Struct, tag="tenant_usage", array_like=True):
    """API server -> coordinator -> every API server (tenant limits across the cluster):
    what its tenants used since its last report, at most every 0.25 s while they use
    anything. The coordinator counts it (cluster totals) and forwards it as it came;
    receivers charge their own buckets with it and skip their own (origin)."""

    origin: str  # the sending API server's incarnation
    usage: list[tuple[str, int, int, int, int]]  # (tenant, requests, tokens charged (net), tokens delivered, in flight now)
    held: list[tuple[str, int]] = []  # (tenant, held at its frontend now; a tenant not named: 0): max_concurrent counts them, shares do not


class TenantTotals(msgspec.Struct, tag="tenant_totals", array_like=True):
    """Coordinator -> API servers, every second: each tenant's recent use across the cluster."""

    totals: list[tuple[str, float, float, int]]  # (tenant, delivered tokens/s, requests/s, in flight)


CoordinatorInput = (
    EngineRegister | LoadReport | EngineReady | RankDown | ApiServerRegister | NodeHello | PrefixRouted | GreetAgain | NodeLoad | TenantUsage
)
CoordinatorToEngine = RegisterReply | ApiServerList | PleaseRegister | GreetAgain


class RankLoad(msgspec.Struct, array_like=True):
    rank: int
    incarnation: str
    is_alive: bool
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_prefill_tokens: int = 0
    num_remaining_decode_tokens: int = 0
    slot_usage: float = 0.0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    down_reason: str = ""
    kv_usage: float = 0.0
    num_preemptions: int = 0
    node_rank: int = -1  # the rank's node (its first rank), from its registration; -1: unknown
    host: str = ""  # the engine's hostname, from its registration
    address: str = ""  # its node's address, from the node's supervisor (NodeHello)
    since: float = 0.0  # coordinator's wall clock when is_alive/down_reason last changed state
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0


class LoadTable(msgspec.Struct, tag="table", array_like=True):
    """Coordinator -> API servers: the entries of some ranks, alive or not.

    Each entry replaces what the receiver held for that rank; ranks not named
    keep theirs. The coordinator names the ranks that changed, and every rank
    once a second (at most 256 a message), so cost follows change.
    """

    seq: int
    data_parallel_size: int
    ranks: list[RankLoad]
    num_api_servers: int = 0  # registered with the coordinator, cluster-wide (0: not said)


class LoadDelta(msgspec.Struct, tag="delta", array_like=True):
    """Coordinator -> API servers: the load of ranks that changed while their membership
    (incarnation, liveness, node, address) did not: a LoadTable's entry in ~1/3 of
    the bytes (issue 30). `runs` names the ranks as (first rank, count) runs of
    consecutive ranks, in order; `loads[11i:11i+11]` the i-th named rank's (num_running,
    num_waiting, num_waiting_prefill_tokens, num_remaining_decode_tokens,
    slot_usage permille, num_requests_finished, num_requests_aborted, kv_usage
    permille, num_preemptions, num_prefix_queries, num_prefix_hits). It shares
    LoadTable's seq: a receiver applies either in order."""

    seq: int
    data_parallel_size: int
    runs: list[tuple[int, int]]
    loads: list[int]  # flat, 11 ints a rank: no list a row to build (tolist) or decode

    @property
    def ranks(self) -> list[int]:
        """The ranks the rows are for, in order."""
        return [rank for first, count in self.runs for rank in range(first, first + count)]


TableChannel = LoadTable | LoadDelta | PrefixRouted | TenantUsage | TenantTotals  # what API servers read on the coordinator's PUB socket


# ---------------------------------------------------------------- children -> supervisor


class ChildReady(msgspec.Struct, tag="child_ready", array_like=True):
    name: str
    pid: int
    detail: str = ""


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    name: str
    pid: int
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # engines: share of KV blocks in use


ToSupervisor = ChildReady | Heartbeat
