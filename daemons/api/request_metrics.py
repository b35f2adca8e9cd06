"""vLLM's request-level metrics (vllm:prompt_tokens_total, vllm:time_to_first_token_seconds,
...) with vLLM's names, labels (model_name, engine = the rank) and buckets, summed over
every API server of the node.

Each API server observes its own requests once, when they end (ServingBase.run): a few
bisects and additions into plain lists, never per token. Every second (and on each
scrape) it writes its totals to a file of the node's run directory; a scrape of any API
server answers the sum of all their files, so Prometheus sees one node-wide series
however the shared port spreads scrapes (vLLM's multiprocess mode does the same with
mmaps). A restarted API server takes its predecessor's totals up again, so no counter
of the sum ever falls. Nothing here touches sockets; a file it cannot read is skipped.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Iterable, Sequence

import msgspec
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

# vLLM's bucket families (vllm/v1/metrics/buckets.py, v0.32)
REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                       10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
INTER_TOKEN_LATENCY = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                       10.0, 20.0, 40.0, 80.0)


def tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


# histogram -> (help, bucket family); names as vLLM exposes them
def _histograms(max_model_len: int) -> dict[str, tuple[str, tuple[float, ...]]]:
    tokens = tokens_buckets(max_model_len)
    return {
        "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN),
        "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds (each request's mean interval, "
                                             "counted once per interval).", INTER_TOKEN_LATENCY),
        "vllm:request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY),
        "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY),
        "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY),
        "vllm:request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY),
        "vllm:request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY),
        "vllm:request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY),
        "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", tokens),
        "vllm:request_generation_tokens": ("Number of generation tokens processed.", tokens),
        "vllm:request_max_num_generation_tokens": ("Histogram of maximum number of requested generation tokens.", tokens),
        "vllm:iteration_tokens_total": ("Histogram of number of tokens per engine_step (this node's API servers' "
                                        "shares of each step, each counted by its API server).", ITERATION_TOKENS),
    }


# The order observe() fills them in (its values tuple, then the two per-interval ones).
_OBSERVED = (
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
)
# vLLM's older name of request_time_per_output_token_seconds, still read by dashboards
ALIASES = {"vllm:time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds"}
FINISHED_REASONS = ("stop", "length", "abort", "error")


class Totals(msgspec.Struct):
    """One API server's totals per rank: counters, and per histogram its bucket counts
    (the last one +Inf) and sum."""

    prompt_tokens: list[float]
    generation_tokens: list[float]
    success: dict[str, list[float]]
    buckets: dict[str, list[list[float]]]
    sums: dict[str, list[float]]

    @classmethod
    def empty(cls, num_ranks: int, histograms: dict) -> Totals:
        zeros = lambda: [0.0] * num_ranks  # noqa: E731
        return cls(zeros(), zeros(), {r: zeros() for r in FINISHED_REASONS},
                   {name: [[0.0] * (len(b) + 1) for _ in range(num_ranks)] for name, (_, b) in histograms.items()},
                   {name: zeros() for name in histograms})

    def add(self, other: Totals) -> None:
        """Add `other` (another API server's file) in, as far as both have ranks and buckets."""
        _add(self.prompt_tokens, other.prompt_tokens)
        _add(self.generation_tokens, other.generation_tokens)
        for reason, counts in other.success.items():
            if reason in self.success:
                _add(self.success[reason], counts)
        for name, per_rank in other.buckets.items():
            if name in self.buckets:
                for mine, theirs in zip(self.buckets[name], per_rank):
                    if len(mine) == len(theirs):
                        _add(mine, theirs)
                _add(self.sums[name], other.sums.get(name, []))


def _add(into: list[float], values: Iterable[float]) -> None:
    for i, v in zip(range(len(into)), values):
        into[i] += v


class RequestMetrics:
    """This API server's part of the node's vLLM request metrics, and the collector that
    serves the node's sum. `directory` None: this process's own totals only."""

    def __init__(self, model_name: str, num_ranks: int, max_model_len: int, directory: str | None, index: int) -> None:
        self.model_name = model_name
        self.num_ranks = num_ranks
        self.histograms = _histograms(max_model_len)
        self._bounds = {name: buckets for name, (_, buckets) in self.histograms.items()}
        self.directory = directory
        self.path = os.path.join(directory, f"api-{index}.msgpack") if directory else None
        self.totals = self._load(self.path) or Totals.empty(num_ranks, self.histograms)
        self._iteration = self.totals.buckets["vllm:iteration_tokens_total"]  # (step() runs per engine message)
        self._iteration_sum = self.totals.sums["vllm:iteration_tokens_total"]
        # Per rank, (bounds, that rank's bucket counts, the sums list) of each histogram in
        # _OBSERVED order: observe() reaches them by position, without a dict lookup each.
        self._rows = [tuple((self._bounds[name], self.totals.buckets[name][rank], self.totals.sums[name])
                            for name in _OBSERVED) for rank in range(num_ranks)]
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(Totals)
        # Totals changed since the last save: an idle API server writes nothing (at 1,024 ranks
        # a save encodes every rank's histograms, a tenth of an idle API server's CPU, issue 30).
        self._dirty = False

    # ------------------------------------------------------------ observe (once per engine request)

    def observe(self, rank: int, num_prompt: int, num_output: int, max_tokens: int, finished: str,
                t_sent: float, t_first: float, t_last: float, queue_s: float) -> None:
        """One engine request that ended (monotonic times; t_first 0: no token came).

        TTFT and e2e run from the send; prefill is TTFT less the engine's queue time;
        decode from the first token to the last. Inter-token latency is observed as the
        request's mean interval, once per interval, so its count and sum are vLLM's."""
        if not 0 <= rank < self.num_ranks:
            return
        self._dirty = True
        t = self.totals
        t.prompt_tokens[rank] += num_prompt
        t.generation_tokens[rank] += num_output
        t.success[finished if finished in t.success else "abort"][rank] += 1
        if t_first:
            ttft = t_first - t_sent
            decode = t_last - t_first
            prefill = max(0.0, ttft - queue_s)
            values = (num_prompt, num_output, max_tokens, ttft, t_last - t_sent, queue_s, prefill, decode, prefill + decode)
        else:
            values = (num_prompt, num_output, max_tokens)
        rows = self._rows[rank]
        for (bounds, counts, sums), value in zip(rows, values):
            counts[bisect_left(bounds, value)] += 1
            sums[rank] += value
        if t_first and num_output > 1:
            mean = decode / (num_output - 1)
            for (bounds, counts, sums), count in zip(rows[len(values):], (1, num_output - 1)):
                counts[bisect_left(bounds, mean)] += count
                sums[rank] += mean * count

    def step(self, rank: int, tokens: int) -> None:
        """One engine step's outputs for this API server: its tokens (prompt and generated)."""
        if tokens and 0 <= rank < self.num_ranks:
            self._dirty = True
            self._iteration[rank][bisect_left(ITERATION_TOKENS, tokens)] += 1
            self._iteration_sum[rank] += tokens

    # ------------------------------------------------------------ share and serve

    def save(self) -> None:
        """Write this API server's totals for the others (atomically: a reader sees the old or the new)."""
        if self.path is None or not self._dirty:
            return
        self._dirty = False
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(self._encode(self.totals))
            os.replace(tmp, self.path)
        except OSError:
            pass  # the run directory is gone (shutdown): nothing to share

    def _load(self, path: str | None) -> Totals | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                got = msgspec.msgpack.decode(f.read(), type=Totals)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        fresh = Totals.empty(self.num_ranks, self.histograms)
        fresh.add(got)
        return fresh

    def node_totals(self) -> Totals:
        """The sum of every API server's totals: this one's live, the others' last files."""
        total = Totals.empty(self.num_ranks, self.histograms)
        total.add(self.totals)
        if self.directory is None:
            return total
        self.save()
        try:
            names = [n for n in os.listdir(self.directory) if n.endswith(".msgpack")]
        except OSError:
            return total
        for name in names:
            path = os.path.join(self.directory, name)
            if path == self.path:
                continue
            try:
                with open(path, "rb") as f:
                    total.add(self._decoder.decode(f.read()))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                continue
        return total

    def collect(self):
        t = self.node_totals()
        labels = ["model_name", "engine"]
        prompt = CounterMetricFamily("vllm:prompt_tokens", "Number of prefill tokens processed.", labels=labels)
        generation = CounterMetricFamily("vllm:generation_tokens", "Number of generation tokens processed.", labels=labels)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.", labels=[*labels, "finished_reason"])
        for rank in range(self.num_ranks):
            values = [self.model_name, str(rank)]
            prompt.add_metric(values, t.prompt_tokens[rank])
            generation.add_metric(values, t.generation_tokens[rank])
            for reason in FINISHED_REASONS:
                success.add_metric([*values, reason], t.success[reason][rank])
        yield from (prompt, generation, success)
        served = {**{name: name for name in self.histograms}, **ALIASES}
        for exposed, name in served.items():
            yield self._family(exposed, name, t, labels)

    def _family(self, exposed: str, name: str, t: Totals, labels: Sequence[str]) -> HistogramMetricFamily:
        doc, bounds = self.histograms[name]
        family = HistogramMetricFamily(exposed, doc, labels=labels)
        for rank in range(self.num_ranks):
            running, cumulative = 0.0, []
            for bound, count in zip((*bounds, float("inf")), t.buckets[name][rank]):
                running += count
                cumulative.append((_le(bound), running))
            family.add_metric([self.model_name, str(rank)], cumulative, t.sums[name][rank])
        return family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
