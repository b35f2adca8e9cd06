#!/usr/bin/env python3
"""Closed-loop load generator for OpenAI-compatible servers (dpserve).

``--concurrency`` workers share one aiohttp ClientSession (a keep-alive
TCPConnector sized to the concurrency); each worker sends a request, waits for
the full answer, records it and immediately sends the next one.  With
``--request-rate R`` the run is paced instead: arrivals are Poisson at R
requests/s and each worker waits for the next one before sending, so at most
``--concurrency`` are in flight (an arrival that finds every worker busy goes
as soon as one frees).  Paced runs compare per-request costs of two servers at
the same offered load, which a closed loop cannot: there each server's own
throughput sets how much work it batches.

Where it measures the same thing as vLLM's own client -- streamed throughput,
TTFT and ITL against dpserve and ``vllm serve`` -- the comparisons use
``vllm bench serve`` (benchmarks/vllm_bench.py; engine_realistic.py and
vllm_engine_bench.py, ``--client``).  This generator stays for what that client
cannot do: timed windows, non-streamed ``max_tokens=1`` req/s runs, per-rank
pinning and skew, prompt mixes and prefix workloads.

Window and counting
    The run starts, runs ``--warmup`` seconds whose completions are *not*
    counted, then measures.  A request is counted when it *finishes* inside the
    measurement window (it may have started during warm-up).  The window ends
    at ``--duration`` seconds after warm-up, or at the ``--num-requests``-th
    counted completion (errors count too, so a failing server cannot keep the
    run alive), or at ``--max-time`` (a hard cap that always applies),
    whichever comes first.  With ``--num-requests`` the workers stop issuing
    once counted + in-flight reaches N, so exactly N requests are counted.
    Requests still in flight when the window closes are cancelled and reported
    as ``cancelled``, not as errors.  Rates are counts divided by the window.

Token and latency accounting
    * E2E latency: from just before the request is sent to the end of the
      answer ([DONE] for streams, full body otherwise).  Successful requests only.
    * Output tokens: ``usage.completion_tokens`` (non-streaming) or the final
      ``usage`` chunk of a stream (``stream_options.include_usage`` is always
      requested), because servers may merge several tokens into one SSE event.
      A response without usage is counted in ``no_usage`` and contributes its
      number of content events (streams) or 0 (non-streaming) instead.
    * TTFT (streams): time to the first *content-bearing* event (non-empty
      ``text`` / ``delta.content`` / ``delta.reasoning_content``); role-only
      chat deltas do not count.
    * ITL (streams): events that arrive in the same network read form one
      arrival.  For each arrival after the first:
      ``ITL = (gap to previous arrival) / (tokens in this arrival)``, one
      sample per arrival.  Tokens per arrival are exact when the server puts a
      cumulative ``usage`` in every content chunk (continuous usage stats);
      otherwise the split is estimated: the first content event is assumed to
      carry 1 token (the prefill token) and the remaining ``T - 1`` tokens of
      the final usage are spread evenly over the other ``E - 1`` content
      events.  With that split the token-weighted mean ITL equals TPOT.
    * TPOT (streams): ``(E2E - TTFT) / (T - 1)`` per request (vLLM's definition).
    * tok/event: output tokens / content events -- shows how much the server
      merges tokens into one event.

Errors are counted by kind: ``http_<status>``, ``timeout``, ``connection``
(refused / reset / server disconnected), ``payload`` (body cut off mid-way),
``malformed`` (undecodable or wrongly shaped JSON), ``no_done`` (stream ended
without ``data: [DONE]``), ``stream_error`` (an ``error`` object in the stream
or 200 body), ``client_error`` (any other aiohttp error).  After a
``connection`` error a worker sleeps ``error_backoff`` (10 ms) so that a dead
server does not turn the loop into a busy spin; no other error backs off.

Network rule: only loopback hosts (127.0.0.0/8, ::1, localhost) are accepted
unless ``--allow-remote`` is given; redirects are never followed and proxy
environment variables are ignored (aiohttp's trust_env=False).

Library use::

    from benchmarks.load import LoadConfig, run_load, format_table
    result = await run_load(LoadConfig(url="http://127.0.0.1:8000", concurrency=8))
    print(format_table([("dpserve", result)]))
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import random
import resource
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import render  # noqa: E402

__all__ = [
    "LoadConfig",
    "LoadResult",
    "RemoteHostRefused",
    "check_loopback",
    "format_table",
    "main",
    "make_prompts",
    "parse_prompt_mix",
    "run_load",
    "run_load_sync",
]

RANK_HEADER = "X-data-parallel-rank"

# Common lower-case English words that are a single token (with their leading
# space) in the usual BPE vocabularies, so a prompt of N words is ~N tokens.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is for on that with as was by at from it be this are or
    an have not but they his which one you were all we her she there been if
    their has when who will more no out do so can what up said about other into
    than its time only could new them man some these then two first may any like
    now my such make over our even most me state after also made many did must
    before back see through way where get much go well your know should down
    work year because come people just say each those take day good how long
    little very still own see world life never under last right while might
    great old off found thought came part place same both think against again
    away house end school three every small home water room mother area hand
    point face war eye order light side night city head hold kind young
    tree line music game story fish bird river road window book table paper
    green blue red black white small large open close early late happy simple
    """.split()
)


class RemoteHostRefused(ValueError):
    """The URL names a host that is not loopback and allow_remote was not set."""


def check_loopback(url: str, allow_remote: bool = False) -> str:
    """Return the URL's host if it is loopback (or allow_remote); raise otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme {parts.scheme!r} in {url!r} (use http://)")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in URL {url!r}")
    if allow_remote:
        return host
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return host
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise RemoteHostRefused(
        f"refusing to send load to non-loopback host {host!r} ({url}); only 127.0.0.0/8, "
        f"::1 and localhost are allowed -- pass --allow-remote (allow_remote=True) to override"
    )


def parse_prompt_mix(spec: str | Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """'20:0.9,2000:0.1' -> [(20, 0.9), (2000, 0.1)] (weights need not sum to 1)."""
    if not isinstance(spec, str):
        out = [(int(w), float(p)) for w, p in spec]
    else:
        out = []
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            try:
                words, weight = item.split(":")
                out.append((int(words), float(weight)))
            except ValueError:
                raise ValueError(f"bad prompt-mix item {item!r}; expected WORDS:WEIGHT") from None
    if not out:
        raise ValueError("empty prompt mix")
    for words, weight in out:
        if words < 1 or weight < 0:
            raise ValueError(f"bad prompt-mix item {words}:{weight}")
    if sum(w for _, w in out) <= 0:
        raise ValueError("prompt-mix weights sum to zero")
    return out


def make_prompts(mix: Sequence[tuple[int, float]], count: int, seed: int) -> list[str]:
    """Deterministic prompts: lengths allocated to the mix weights by largest
    remainder (exact proportions), order shuffled, words drawn from WORDS."""
    rng = random.Random(seed)
    total = sum(w for _, w in mix)
    quotas = [count * w / total for _, w in mix]
    alloc = [int(q) for q in quotas]
    for i in sorted(range(len(mix)), key=lambda i: quotas[i] - alloc[i], reverse=True)[
        : count - sum(alloc)
    ]:
        alloc[i] += 1
    lengths = [words for (words, _), n in zip(mix, alloc) for _ in range(n)]
    rng.shuffle(lengths)
    return [" ".join(rng.choices(WORDS, k=n)) for n in lengths]


# ----------------------------------------------------------------- config / result


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # None: first id of GET /v1/models
    concurrency: int = 8
    duration: float | None = None  # measurement seconds; None -> 10 unless num_requests
    warmup: float = 0.0
    num_requests: int | None = None
    max_time: float = 600.0  # hard cap on the whole run (warm-up included)
    max_tokens: int = 64
    stream: bool = False
    ignore_eos: bool = False
    prompt_words: int = 32
    prompt_mix: str | Sequence[tuple[int, float]] | None = None
    num_prompts: int = 256  # size of the prebuilt prompt pool, used round-robin
    request_rate: float | None = None  # paced: Poisson arrivals at this rate, at most `concurrency` in flight
    rank_pin: int | None = None
    api_key: str | None = None
    temperature: float = 0.0
    top_p: float | None = None  # sent when set
    top_k: int | None = None  # sent when set
    seed: int = 0  # seeds prompt generation
    request_seed: int | None = None  # sent as the body's "seed" when set
    timeout: float = 60.0  # per request, total
    error_backoff: float = 0.01  # sleep after a connection error
    allow_remote: bool = False


@dataclass
class LoadResult:
    model: str = ""
    endpoint: str = ""
    stream: bool = False
    concurrency: int = 0
    window_s: float = 0.0
    stopped_by: str = ""  # duration | num_requests | max_time | interrupted
    requests: int = 0  # counted (ok + errors)
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_samples: dict[str, str] = field(default_factory=dict)
    warmup_requests: int = 0  # finished during warm-up, not counted
    cancelled: int = 0  # in flight when the window closed
    no_usage: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    content_events: int = 0
    req_per_s: float = 0.0  # ok / window
    output_tok_per_s: float = 0.0
    latency_ms: dict[str, float | None] = field(default_factory=dict)
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    itl_ms: dict[str, float | None] = field(default_factory=dict)
    tpot_ms: dict[str, float | None] = field(default_factory=dict)
    tokens_per_event: float | None = None
    per_rank: dict[str, int] = field(default_factory=dict)
    client_cpu_s: float = 0.0  # this process's CPU during the window
    client_cpu_us_per_req: float | None = None
    # raw samples in seconds (not part of to_dict())
    latencies: list[float] = field(default_factory=list, repr=False)
    latency_prompt_tokens: list[int] = field(default_factory=list, repr=False)  # per latency sample
    ttfts: list[float] = field(default_factory=list, repr=False)
    itls: list[float] = field(default_factory=list, repr=False)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("latencies", "latency_prompt_tokens", "ttfts", "itls"):
            d.pop(k)
        d["error_count"] = self.error_count
        return d


def _pct(vals: list[float], q: float) -> float | None:
    n = len(vals)
    if n == 0:
        return None
    pos = q / 100.0 * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def _summary_ms(samples: list[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    s = sorted(samples)
    out: dict[str, float | None] = {"mean": (sum(s) / len(s) * 1e3) if s else None}
    for q in qs:
        v = _pct(s, q)
        out[f"p{q}"] = None if v is None else v * 1e3
    return out


# ----------------------------------------------------------------- wire shapes


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    message: _Delta | None = None


class _Body(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


class _Model(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[_Model]


class _RequestFailed(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(kind)
        self.kind = kind
        self.detail = detail


# ----------------------------------------------------------------- the run


class _Run:
    def __init__(self, cfg: LoadConfig, stop: asyncio.Event | None):
        if cfg.endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be 'completions' or 'chat'")
        if cfg.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if cfg.num_requests is not None and cfg.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if cfg.request_rate is not None and not cfg.request_rate > 0:
            raise ValueError("request_rate must be > 0")
        self.cfg = cfg
        self.host = check_loopback(cfg.url, cfg.allow_remote)
        base = cfg.url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        self.base = base
        self.path = "/v1/completions" if cfg.endpoint == "completions" else "/v1/chat/completions"
        self.duration = cfg.duration
        if self.duration is None and cfg.num_requests is None:
            self.duration = 10.0
        self.user_stop = stop
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            self.headers["Authorization"] = f"Bearer {cfg.api_key}"
        if cfg.rank_pin is not None:
            self.headers[RANK_HEADER] = str(cfg.rank_pin)
        self.decoder = msgspec.json.Decoder(_Body)
        self.res = LoadResult(endpoint=cfg.endpoint, stream=cfg.stream, concurrency=cfg.concurrency)
        self.tokens_events = 0  # content events of ok streamed requests
        self.tpots: list[float] = []
        self.counted = 0
        self.inflight = 0
        self.next_prompt = 0
        self.next_send = 0.0  # paced: when the next request is due (perf_counter)
        self.pace_rng = random.Random(cfg.seed + 1)
        self.stopping = False
        self.done = asyncio.Event()

    def build_bodies(self, model: str) -> list[bytes]:
        cfg = self.cfg
        mix = parse_prompt_mix(cfg.prompt_mix) if cfg.prompt_mix else [(cfg.prompt_words, 1.0)]
        n = max(1, cfg.num_prompts)
        if cfg.num_requests is not None and cfg.warmup <= 0 and len(mix) == 1:
            n = min(n, cfg.num_requests)
        enc = msgspec.json.Encoder()
        bodies = []
        for prompt in make_prompts(mix, n, cfg.seed):
            body: dict[str, Any] = {"model": model}
            if cfg.endpoint == "completions":
                body["prompt"] = prompt
            else:
                body["messages"] = [{"role": "user", "content": prompt}]
            body["max_tokens"] = cfg.max_tokens
            body["temperature"] = cfg.temperature
            if cfg.top_p is not None:
                body["top_p"] = cfg.top_p
            if cfg.top_k is not None:
                body["top_k"] = cfg.top_k
            if cfg.request_seed is not None:
                body["seed"] = cfg.request_seed
            if cfg.ignore_eos:
                body["ignore_eos"] = True
            if cfg.stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            bodies.append(enc.encode(body))
        return bodies

    async def fetch_model(self, session: aiohttp.ClientSession) -> str:
        url = self.base + "/v1/models"
        try:
            async with session.get(url, headers=self.headers, allow_redirects=False) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"GET {url} -> HTTP {resp.status}: {raw[:200]!r}")
                models = msgspec.json.decode(raw, type=_ModelList)
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.MsgspecError) as exc:
            raise RuntimeError(f"could not list models at {url}: {exc!r}") from None
        if not models.data:
            raise RuntimeError(f"GET {url} returned no models")
        return models.data[0].id

    # -- one request -------------------------------------------------------

    async def one(self, session: aiohttp.ClientSession, body: bytes):
        """-> (kind|None, detail, latency, ttft, itls, tokens, prompt_tokens, events, rank, no_usage)"""
        t0 = time.perf_counter()
        rank = None
        try:
            async with session.post(
                self.url, data=body, headers=self.headers, allow_redirects=False
            ) as resp:
                rank = resp.headers.get(RANK_HEADER)
                if resp.status != 200:
                    raw = await resp.read()
                    return (f"http_{resp.status}", raw[:200].decode("utf-8", "replace"),
                            0.0, None, None, 0, 0, 0, rank, False)
                if self.cfg.stream:
                    return await self.read_stream(resp, t0, rank)
                raw = await resp.read()
                t1 = time.perf_counter()
            obj = self.decoder.decode(raw)
            if obj.error is not None:
                return ("stream_error", repr(obj.error)[:200], 0.0, None, None, 0, 0, 0, rank, False)
            if not obj.choices:
                return ("malformed", "no choices", 0.0, None, None, 0, 0, 0, rank, False)
            u = obj.usage
            if u is None or u.completion_tokens is None:
                return (None, "", t1 - t0, None, None, 0, 0, 0, rank, True)
            return (None, "", t1 - t0, None, None, u.completion_tokens, u.prompt_tokens or 0, 0,
                    rank, False)
        except _RequestFailed as exc:
            return (exc.kind, exc.detail, 0.0, None, None, 0, 0, 0, rank, False)
        except asyncio.TimeoutError as exc:  # includes aiohttp's ServerTimeoutError
            return ("timeout", repr(exc), 0.0, None, None, 0, 0, 0, rank, False)
        except aiohttp.ClientPayloadError as exc:
            return ("payload", repr(exc)[:200], 0.0, None, None, 0, 0, 0, rank, False)
        except (aiohttp.ClientConnectionError, ConnectionError) as exc:
            return ("connection", repr(exc)[:200], 0.0, None, None, 0, 0, 0, rank, False)
        except msgspec.MsgspecError as exc:
            return ("malformed", repr(exc)[:200], 0.0, None, None, 0, 0, 0, rank, False)
        except aiohttp.ClientError as exc:
            return ("client_error", repr(exc)[:200], 0.0, None, None, 0, 0, 0, rank, False)

    async def read_stream(self, resp: aiohttp.ClientResponse, t0: float, rank):
        decode = self.decoder.decode
        perf = time.perf_counter
        buf = b""
        done = False
        exact = True  # every content event carried a cumulative usage
        usage: _Usage | None = None
        arr_t: list[float] = []  # arrival times (reads holding content events)
        arr_n: list[int] = []  # content events per arrival
        arr_cum: list[int] = []  # cumulative completion_tokens after the arrival (exact mode)
        events = 0
        cum = 0
        eof = False
        it = resp.content.iter_any().__aiter__()
        while not eof:
            try:
                data = await it.__anext__()
                buf += data
            except StopAsyncIteration:
                eof = True
                buf += b"\n"
            t = perf()
            if b"\n" not in buf:
                continue
            lines = buf.split(b"\n")
            buf = lines.pop()
            n_here = 0
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                if not payload:
                    continue
                ch = decode(payload)
                if ch.error is not None:
                    raise _RequestFailed("stream_error", repr(ch.error)[:200])
                u = ch.usage
                if u is not None:
                    usage = u
                for c in ch.choices:
                    d = c.delta
                    if c.text or (d is not None and (d.content or d.reasoning_content or d.reasoning)):
                        n_here += 1
                        if u is not None and u.completion_tokens is not None:
                            cum = u.completion_tokens
                        else:
                            exact = False
                        break
            if n_here:
                arr_t.append(t)
                arr_n.append(n_here)
                arr_cum.append(cum)
                events += n_here
        t_end = perf()
        if not done:
            raise _RequestFailed("no_done", f"stream ended without [DONE] after {events} content events")
        no_usage = usage is None or usage.completion_tokens is None
        tokens = events if no_usage else usage.completion_tokens
        prompt_tokens = 0 if no_usage else (usage.prompt_tokens or 0)
        ttft = (arr_t[0] - t0) if arr_t else None
        itls: list[float] | None = None
        if len(arr_t) > 1:
            itls = []
            if exact:
                for i in range(1, len(arr_t)):
                    k = arr_cum[i] - arr_cum[i - 1]
                    if k > 0:
                        itls.append((arr_t[i] - arr_t[i - 1]) / k)
            elif events > 1 and tokens > 1:
                per_event = (tokens - 1) / (events - 1)
                for i in range(1, len(arr_t)):
                    itls.append((arr_t[i] - arr_t[i - 1]) / (arr_n[i] * per_event))
        return (None, "", t_end - t0, ttft, itls, tokens, prompt_tokens, events, rank, no_usage)

    # -- workers and bookkeeping -------------------------------------------

    def record(self, t1: float, r) -> None:
        res = self.res
        if self.stopping:
            res.cancelled += 1
            return
        if t1 < self.t_meas:
            res.warmup_requests += 1
            return
        n = self.cfg.num_requests
        if n is not None and self.counted >= n:
            res.cancelled += 1
            return
        self.counted += 1
        kind, detail, lat, ttft, itls, tokens, ptoks, events, rank, no_usage = r
        if rank is not None:
            res.per_rank[rank] = res.per_rank.get(rank, 0) + 1
        if kind is None:
            res.ok += 1
            res.latencies.append(lat)
            res.latency_prompt_tokens.append(ptoks)
            res.output_tokens += tokens
            res.prompt_tokens += ptoks
            if no_usage:
                res.no_usage += 1
            if self.cfg.stream:
                res.content_events += events
                if ttft is not None:
                    res.ttfts.append(ttft)
                    if tokens > 1:
                        self.tpots.append((lat - ttft) / (tokens - 1))
                if itls:
                    res.itls.extend(itls)
        else:
            res.errors[kind] = res.errors.get(kind, 0) + 1
            if kind not in res.error_samples:
                res.error_samples[kind] = detail
        if n is not None and self.counted >= n:
            self.t_end = t1
            self.stopped_by = "num_requests"
            self.done.set()

    async def worker(self, session: aiohttp.ClientSession) -> None:
        bodies = self.bodies
        nb = len(bodies)
        n = self.cfg.num_requests
        perf = time.perf_counter
        backoff = self.cfg.error_backoff
        rate = self.cfg.request_rate
        while not self.stopping:
            if rate is not None:  # each worker claims the next arrival; late arrivals go at once
                self.next_send += self.pace_rng.expovariate(rate)
                delay = self.next_send - perf()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.stopping:
                    return
            if n is not None and perf() >= self.t_meas and self.counted + self.inflight >= n:
                return
            body = bodies[self.next_prompt % nb]
            self.next_prompt += 1
            self.inflight += 1
            try:
                r = await self.one(session, body)
            finally:
                self.inflight -= 1
            self.record(perf(), r)
            if r[0] == "connection" and backoff > 0:
                await asyncio.sleep(backoff)

    async def run(self) -> LoadResult:
        cfg = self.cfg
        timeout = aiohttp.ClientTimeout(total=cfg.timeout)
        connector = aiohttp.TCPConnector(
            limit=cfg.concurrency, limit_per_host=cfg.concurrency, keepalive_timeout=60,
            ttl_dns_cache=None,
        )
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, trust_env=False, auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        ) as session:
            model = cfg.model or await self.fetch_model(session)
            self.res.model = model
            self.url = self.base + self.path
            self.bodies = self.build_bodies(model)

            t_start = self.next_send = time.perf_counter()
            self.t_meas = t_start + max(0.0, cfg.warmup)
            hard_end = t_start + cfg.max_time
            deadline = hard_end
            if self.duration is not None:
                deadline = min(deadline, self.t_meas + self.duration)
            self.t_end = deadline
            self.stopped_by = "duration" if self.duration is not None and deadline < hard_end else "max_time"

            ru0 = None
            workers = [asyncio.ensure_future(self.worker(session)) for _ in range(cfg.concurrency)]
            all_workers = asyncio.gather(*workers, return_exceptions=True)
            waits = {all_workers, asyncio.ensure_future(self.done.wait())}
            if self.user_stop is not None:
                waits.add(asyncio.ensure_future(self.user_stop.wait()))
            try:
                if cfg.warmup > 0:
                    await asyncio.wait(waits, timeout=max(0.0, self.t_meas - time.perf_counter()),
                                       return_when=asyncio.FIRST_COMPLETED)
                ru0 = resource.getrusage(resource.RUSAGE_SELF)
                await asyncio.wait(waits, timeout=max(0.0, deadline - time.perf_counter()),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                now = time.perf_counter()
                self.stopping = True
                if self.user_stop is not None and self.user_stop.is_set() and not self.done.is_set():
                    self.t_end = min(now, deadline)
                    self.stopped_by = "interrupted"
                elif all_workers.done() and not self.done.is_set():
                    self.t_end = min(now, deadline)
                ru1 = resource.getrusage(resource.RUSAGE_SELF)
                for w in workers:
                    w.cancel()
                self.res.cancelled += self.inflight  # these never reach record()
                outcomes = await all_workers
                for f in waits:
                    if not f.done():
                        f.cancel()
            for o in outcomes:  # a bug in a worker must not vanish silently
                if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError):
                    raise o
        return self.finish(ru0, ru1)

    def finish(self, ru0, ru1) -> LoadResult:
        res = self.res
        window = max(1e-9, self.t_end - self.t_meas)
        res.window_s = window if self.t_end > self.t_meas else 0.0
        res.stopped_by = self.stopped_by
        res.requests = self.counted
        if res.window_s > 0:
            res.req_per_s = res.ok / window
            res.output_tok_per_s = res.output_tokens / window
        res.latency_ms = _summary_ms(res.latencies)
        if self.cfg.stream:
            res.ttft_ms = _summary_ms(res.ttfts)
            res.itl_ms = _summary_ms(res.itls)
            res.tpot_ms = _summary_ms(self.tpots)
            if res.content_events:
                res.tokens_per_event = res.output_tokens / res.content_events
        if ru0 is not None:
            res.client_cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            if res.requests:
                res.client_cpu_us_per_req = res.client_cpu_s / res.requests * 1e6
        res.errors = dict(sorted(res.errors.items()))
        res.per_rank = dict(sorted(res.per_rank.items(), key=lambda kv: (len(kv[0]), kv[0])))
        return res


async def run_load(cfg: LoadConfig, stop: asyncio.Event | None = None) -> LoadResult:
    """Run one closed-loop load test; never raises for per-request failures.

    Raises RemoteHostRefused for a non-loopback URL (unless cfg.allow_remote),
    ValueError for a bad config and RuntimeError when cfg.model is None and
    the model list cannot be fetched.  Setting `stop` ends the run early.
    """
    return await _Run(cfg, stop).run()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # type: ignore

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def run_load_sync(cfg: LoadConfig) -> LoadResult:
    """run_load on a fresh event loop (uvloop when importable)."""
    with asyncio.Runner(loop_factory=_new_loop) if hasattr(asyncio, "Runner") else _LegacyRunner() as r:
        return r.run(run_load(cfg))


class _LegacyRunner:  # Python 3.10 has no asyncio.Runner
    def __enter__(self):
        self.loop = _new_loop()
        return self

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def __exit__(self, *exc):
        self.loop.close()


# ----------------------------------------------------------------- output


def _f(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def format_table(results: Sequence[tuple[str, LoadResult]]) -> str:
    """Side-by-side table: one column per (label, result)."""
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, fn) -> None:
        rows.append((name, [fn(r) for _, r in results]))

    row("model", lambda r: r.model)
    row("endpoint", lambda r: f"{r.endpoint}{'+stream' if r.stream else ''}")
    row("concurrency", lambda r: str(r.concurrency))
    row("window s", lambda r: f"{r.window_s:.2f} ({r.stopped_by})")
    row("requests", lambda r: str(r.requests))
    row("ok", lambda r: str(r.ok))
    row("errors", lambda r: str(r.error_count) + (
        " (" + ", ".join(f"{k}={v}" for k, v in r.errors.items()) + ")" if r.errors else ""))
    row("warm-up / cancelled", lambda r: f"{r.warmup_requests} / {r.cancelled}")
    row("req/s", lambda r: _f(r.req_per_s, 2))
    row("output tok/s", lambda r: _f(r.output_tok_per_s, 1))
    row("output tokens", lambda r: str(r.output_tokens) + (f" ({r.no_usage} w/o usage)" if r.no_usage else ""))
    for key in ("p50", "p90", "p99"):
        row(f"latency {key} ms", lambda r, k=key: _f(r.latency_ms.get(k)))
    if any(r.stream for _, r in results):
        for key in ("p50", "p99"):
            row(f"TTFT {key} ms", lambda r, k=key: _f(r.ttft_ms.get(k)))
        for key in ("p50", "p99"):
            row(f"ITL {key} ms", lambda r, k=key: _f(r.itl_ms.get(k), 2))
        row("TPOT p50 ms", lambda r: _f(r.tpot_ms.get("p50"), 2))
        row("tok/event", lambda r: _f(r.tokens_per_event, 2))
    if any(r.per_rank for _, r in results):
        row("per rank", lambda r: " ".join(f"{k}:{v}" for k, v in r.per_rank.items()) or "-")
    row("client CPU us/req", lambda r: _f(r.client_cpu_us_per_req, 0))

    return render([""] + [label for label, _ in results], [[name] + vals for name, vals in rows])


# ----------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/load.py",
        description="Closed-loop load generator for OpenAI-compatible servers (loopback only by default).",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL (default %(default)s)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="default: first id from GET /v1/models")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=None,
                   help="measurement seconds after warm-up (default 10 unless --num-requests)")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds whose completions are not counted")
    p.add_argument("--num-requests", type=int, default=None, help="stop after N counted requests")
    p.add_argument("--max-time", type=float, default=600.0, help="hard cap on the whole run (s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt-words", type=int, default=32)
    g.add_argument("--prompt-mix", default=None, help='words:weight list, e.g. "20:0.9,2000:0.1"')
    p.add_argument("--num-prompts", type=int, default=256, help="distinct prompts in the pool")
    p.add_argument("--request-rate", type=float, default=None,
                   help="paced: Poisson arrivals at this many requests/s (at most --concurrency in flight)")
    p.add_argument("--rank-pin", type=int, default=None, help=f"send header {RANK_HEADER}: R")
    p.add_argument("--api-key", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None, help="send as the body's top_p")
    p.add_argument("--top-k", type=int, default=None, help="send as the body's top_k (vLLM's extension)")
    p.add_argument("--seed", type=int, default=0, help="seed for prompt generation")
    p.add_argument("--request-seed", type=int, default=None, help="send as the body's seed field")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request total timeout (s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback host")
    return p


def config_from_args(a: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        url=a.url, endpoint=a.endpoint, model=a.model, concurrency=a.concurrency,
        duration=a.duration, warmup=a.warmup, num_requests=a.num_requests, max_time=a.max_time,
        max_tokens=a.max_tokens, stream=a.stream, ignore_eos=a.ignore_eos,
        prompt_words=a.prompt_words, prompt_mix=a.prompt_mix, num_prompts=a.num_prompts,
        rank_pin=a.rank_pin, api_key=a.api_key, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        seed=a.seed,
        request_seed=a.request_seed, timeout=a.timeout, allow_remote=a.allow_remote,
        request_rate=a.request_rate,
    )


async def _cli_run(cfg: LoadConfig) -> LoadResult:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):
        pass  # not the main thread / not supported
    try:
        return await run_load(cfg, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 ok, 1 nothing succeeded (or the run could not start), 2 bad arguments/host."""
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        if cfg.prompt_mix:
            parse_prompt_mix(cfg.prompt_mix)
        check_loopback(cfg.url, cfg.allow_remote)
    except ValueError as exc:  # includes RemoteHostRefused
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if hasattr(asyncio, "Runner"):
        with asyncio.Runner(loop_factory=_new_loop) as runner:
            try:
                res = runner.run(_cli_run(cfg))
            except (RuntimeError, ValueError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
    else:  # pragma: no cover - Python 3.10
        try:
            res = asyncio.run(_cli_run(cfg))
        except (RuntimeError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(res.to_dict(), sort_keys=True))
    else:
        print(format_table([("result", res)]))
        for kind, detail in res.error_samples.items():
            print(f"  first {kind}: {detail}", file=sys.stderr)
    if res.ok == 0:
        print("error: no request succeeded" if res.requests else "error: no request was counted",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
