"""vLLM's request metrics (daemons/api/request_metrics.py): values, vLLM's buckets and
labels, the sum over a node's API servers, and a restarted API server's continuity."""

from __future__ import annotations

import re

from dpserve.daemons.api.request_metrics import RequestMetrics, tokens_buckets
from prometheus_client import CollectorRegistry, generate_latest


def scrape(metrics: RequestMetrics) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    return generate_latest(registry).decode()


def sample(text: str, name: str, **labels: str) -> float:
    want = {"model_name": "m", **labels}
    for line in text.splitlines():
        match = re.match(r"^([^{ ]+)\{([^}]*)\} (\S+)$", line)
        if match and match.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            if all(got.get(k) == v for k, v in want.items()):
                return float(match.group(3))
    raise AssertionError(f"{name} {want} not in the scrape")


def test_one_request_fills_every_series_with_vllm_labels_and_buckets():
    m = RequestMetrics("m", 2, 256, None, 0)
    # sent at 10.0, queued 0.0625 s on its rank, first token at 10.25, 5 tokens in all, last at 10.75
    m.observe(1, 7, 5, 16, "length", 10.0, 10.25, 10.75, 0.0625)
    text = scrape(m)
    assert sample(text, "vllm:prompt_tokens_total", engine="1") == 7
    assert sample(text, "vllm:generation_tokens_total", engine="1") == 5
    assert sample(text, "vllm:request_success_total", engine="1", finished_reason="length") == 1
    assert sample(text, "vllm:request_success_total", engine="0", finished_reason="length") == 0
    assert sample(text, "vllm:time_to_first_token_seconds_sum", engine="1") == 0.25
    assert sample(text, "vllm:time_to_first_token_seconds_bucket", engine="1", le="0.1") == 0
    assert sample(text, "vllm:time_to_first_token_seconds_bucket", engine="1", le="0.25") == 1  # le: inclusive
    assert sample(text, "vllm:e2e_request_latency_seconds_sum", engine="1") == 0.75
    assert sample(text, "vllm:request_queue_time_seconds_sum", engine="1") == 0.0625
    assert sample(text, "vllm:request_prefill_time_seconds_sum", engine="1") == 0.1875
    assert sample(text, "vllm:request_decode_time_seconds_sum", engine="1") == 0.5
    assert sample(text, "vllm:request_inference_time_seconds_sum", engine="1") == 0.6875
    # four intervals of 0.125 s: counted four times, summing to the decode time (vLLM's count and sum)
    assert sample(text, "vllm:inter_token_latency_seconds_count", engine="1") == 4
    assert sample(text, "vllm:inter_token_latency_seconds_sum", engine="1") == 0.5
    assert sample(text, "vllm:inter_token_latency_seconds_bucket", engine="1", le="0.1") == 0
    assert sample(text, "vllm:inter_token_latency_seconds_bucket", engine="1", le="0.15") == 4
    for name in ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds"):
        assert sample(text, name + "_count", engine="1") == 1 and sample(text, name + "_sum", engine="1") == 0.125
    assert sample(text, "vllm:request_prompt_tokens_bucket", engine="1", le="5.0") == 0
    assert sample(text, "vllm:request_prompt_tokens_bucket", engine="1", le="10.0") == 1
    assert sample(text, "vllm:request_max_num_generation_tokens_sum", engine="1") == 16
    m.step(1, 40)
    assert sample(scrape(m), "vllm:iteration_tokens_total_bucket", engine="1", le="64.0") == 1
    # vLLM's 1-2-5 token buckets up to the context length
    assert tokens_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)


def test_a_request_without_tokens_counts_only_its_end():
    m = RequestMetrics("m", 1, 64, None, 0)
    m.observe(0, 9, 0, 8, "abort", 1.0, 0.0, 0.0, 0.0)
    text = scrape(m)
    assert sample(text, "vllm:request_success_total", engine="0", finished_reason="abort") == 1
    assert sample(text, "vllm:time_to_first_token_seconds_count", engine="0") == 0
    assert sample(text, "vllm:prompt_tokens_total", engine="0") == 9


def test_every_api_server_answers_the_nodes_sum_and_a_restart_continues(tmp_path):
    a = RequestMetrics("m", 2, 128, str(tmp_path), 0)
    b = RequestMetrics("m", 2, 128, str(tmp_path), 1)
    a.observe(0, 10, 3, 8, "stop", 0.0, 0.1, 0.3, 0.0)
    b.observe(1, 20, 4, 8, "stop", 0.0, 0.2, 0.5, 0.0)
    b.observe(0, 5, 1, 8, "length", 0.0, 0.1, 0.1, 0.0)
    a.save()
    b.save()
    for text in (scrape(a), scrape(b)):
        assert sample(text, "vllm:prompt_tokens_total", engine="0") == 15
        assert sample(text, "vllm:prompt_tokens_total", engine="1") == 20
        assert sample(text, "vllm:e2e_request_latency_seconds_count", engine="0") == 2
    # API server 1 restarts: it takes its totals up again, so the node's counters never fall
    b2 = RequestMetrics("m", 2, 128, str(tmp_path), 1)
    assert sample(scrape(a), "vllm:prompt_tokens_total", engine="1") == 20
    b2.observe(1, 1, 1, 8, "stop", 0.0, 0.1, 0.1, 0.0)
    assert sample(scrape(b2), "vllm:prompt_tokens_total", engine="1") == 21
    # a file it cannot read is skipped, not fatal
    (tmp_path / "api-9.msgpack").write_bytes(b"not msgpack")
    assert sample(scrape(a), "vllm:prompt_tokens_total", engine="0") == 15


def test_an_idle_api_server_writes_its_totals_only_when_they_changed(tmp_path):
    m = RequestMetrics("m", 2, 128, str(tmp_path), 0)
    path = tmp_path / "api-0.msgpack"
    m.save()
    assert not path.exists()  # nothing to share yet
    m.step(1, 4)
    m.save()
    first = path.stat().st_ino
    m.save()  # nothing new: not written again (os.replace would give it a new inode)
    assert path.stat().st_ino == first
    m.observe(0, 10, 3, 8, "stop", 0.0, 0.1, 0.3, 0.0)
    m.save()
    assert path.stat().st_ino != first
