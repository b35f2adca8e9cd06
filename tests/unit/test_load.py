"""benchmarks/load.py against benchmarks/baseline_aiohttp.py, loopback only."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.load import (  # noqa: E402
    LoadConfig,
    LoadResult,
    RemoteHostRefused,
    check_loopback,
    format_table,
    main,
    make_prompts,
    parse_prompt_mix,
    run_load,
)

pytestmark = pytest.mark.timeout(60)

BASELINE = ROOT / "benchmarks" / "baseline_aiohttp.py"


class Server:
    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc = proc
        self.url = url

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Stop by pid; return what it printed after the listening line."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                out, _ = self.proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                out, _ = self.proc.communicate(timeout=5)
            return out or ""
        return ""


def start_baseline(*extra: str) -> Server:
    proc = subprocess.Popen(
        [sys.executable, str(BASELINE), "--host", "127.0.0.1", "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
    )
    try:
        deadline = time.monotonic() + 10
        line = ""
        # readline blocks, but the server prints this line (or dies) promptly
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if line.startswith("listening on ") or not line:
                break
        if not line.startswith("listening on "):
            raise RuntimeError(f"baseline did not start: {line!r}")
        return Server(proc, line.split()[-1])
    except BaseException:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
        raise


@pytest.fixture(scope="module")
def server():
    srv = start_baseline()
    try:
        yield srv
    finally:
        srv.stop()


def run(cfg: LoadConfig) -> LoadResult:
    return asyncio.run(run_load(cfg))


def test_non_streaming(server):
    r = run(LoadConfig(url=server.url, concurrency=4, duration=1.0, warmup=0.2, max_tokens=8))
    assert r.model == "baseline"
    assert r.errors == {}, r.error_samples
    assert r.requests == r.ok > 20
    assert r.output_tokens == 8 * r.ok  # from usage.completion_tokens
    assert r.prompt_tokens == 8 * r.ok
    assert 0.9 < r.window_s < 1.1 and r.stopped_by == "duration"
    assert r.req_per_s == pytest.approx(r.ok / r.window_s)
    assert r.warmup_requests > 0
    lat = r.latency_ms
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
    assert r.ttft_ms == {} and r.itl_ms == {}
    assert r.per_rank == {"0": r.requests}


def test_streaming_chat(server):
    r = run(LoadConfig(url=server.url, endpoint="chat", concurrency=4, duration=1.0, max_tokens=16,
                       stream=True, rank_pin=3, ignore_eos=True))
    assert r.errors == {}, r.error_samples
    assert r.ok > 20
    assert r.output_tokens == 16 * r.ok  # from the final usage chunk
    assert r.no_usage == 0
    assert r.content_events == 16 * r.ok  # the role-only first delta is not content
    assert r.tokens_per_event == pytest.approx(1.0)
    assert r.ttft_ms["p50"] is not None and r.ttft_ms["p50"] <= r.latency_ms["p50"]
    assert r.ttft_ms["p99"] <= r.latency_ms["p99"] + 1e-6
    assert r.per_rank == {"3": r.requests}  # baseline echoes the pinned rank
    assert len(r.ttfts) == r.ok
    assert all(x >= 0 for x in r.itls)


def test_streaming_itl_with_paced_tokens():
    srv = start_baseline("--token-delay-ms", "5")
    try:
        r = run(LoadConfig(url=srv.url, concurrency=4, num_requests=8, max_tokens=6, stream=True))
    finally:
        srv.stop()
    assert r.requests == r.ok == 8 and r.stopped_by == "num_requests"
    assert r.output_tokens == 48
    # 5 gaps of ~5 ms per request
    assert 3.0 < r.itl_ms["p50"] < 50.0
    assert 3.0 < r.tpot_ms["p50"] < 50.0
    assert r.ttft_ms["p50"] < r.latency_ms["p50"]


def test_paced_rate_holds_whatever_the_concurrency(server):
    # a closed loop against this server runs far above 40 req/s (test_non_streaming: > 20 in
    # 1 s at c=4 is its floor); paced, the offered rate is the rate whatever the workers
    for concurrency in (2, 16):
        r = run(LoadConfig(url=server.url, concurrency=concurrency, duration=2.0, warmup=0.2, max_tokens=2,
                           request_rate=40.0))
        assert r.errors == {}, r.error_samples
        assert 40 <= r.ok <= 130, (concurrency, r.ok)  # Poisson, mean 80 in 2 s
    with pytest.raises(ValueError):
        run(LoadConfig(url=server.url, request_rate=0.0))


def test_num_requests_exact(server):
    r = run(LoadConfig(url=server.url, model="baseline", concurrency=4, num_requests=25, max_tokens=4))
    assert r.requests == r.ok == 25
    assert r.cancelled == 0
    assert r.stopped_by == "num_requests"


def test_cli_json_and_default_model(server, capsys):
    rc = main(["--url", server.url, "--duration", "0.5", "--concurrency", "2", "--json",
               "--prompt-mix", "5:0.5,50:0.5", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    d = json.loads(out)
    assert d["model"] == "baseline" and d["ok"] > 0 and d["error_count"] == 0
    assert "latencies" not in d


def test_refuses_non_loopback():
    for url in ("http://10.1.2.3:8000", "http://example.com", "http://[2001:db8::1]:80", "http://0.0.0.0:8000"):
        with pytest.raises(RemoteHostRefused):
            check_loopback(url)
        with pytest.raises(RemoteHostRefused):
            run(LoadConfig(url=url, model="m", duration=0.1))
    for url in ("http://127.0.0.1:1", "http://localhost:1", "http://[::1]:1", "http://127.1.2.3:1/v1"):
        check_loopback(url)
    assert main(["--url", "http://192.0.2.1:8000", "--duration", "0.1"]) == 2


def test_connection_errors_counted_when_server_stopped():
    srv = start_baseline()
    try:
        url = srv.url

        async def go() -> LoadResult:
            loop = asyncio.get_running_loop()
            loop.call_later(0.4, srv.stop, signal.SIGKILL)
            return await run_load(LoadConfig(url=url, model="baseline", concurrency=4, duration=1.0,
                                             max_tokens=4, timeout=2))

        r = asyncio.run(go())
    finally:
        srv.stop(signal.SIGKILL)
    assert r.ok > 0
    assert r.errors.get("connection", 0) > 0, r.errors
    assert r.requests == r.ok + r.error_count
    # the server is gone now: everything fails, nothing raises, CLI exits 1
    r2 = run(LoadConfig(url=url, model="baseline", concurrency=4, duration=0.3))
    assert r2.ok == 0 and r2.requests == r2.errors["connection"] > 0
    assert main(["--url", url, "--model", "baseline", "--duration", "0.2", "--json"]) == 1


def test_prompts_and_table():
    mix = parse_prompt_mix("20:0.9,2000:0.1")
    assert mix == [(20, 0.9), (2000, 0.1)]
    ps = make_prompts(mix, 50, seed=7)
    assert ps == make_prompts(mix, 50, seed=7)
    assert sorted(len(p.split()) for p in ps) == [20] * 45 + [2000] * 5
    assert ps != make_prompts(mix, 50, seed=8)
    with pytest.raises(ValueError):
        parse_prompt_mix("20-0.9")
    a, b = LoadResult(model="x", ok=3, requests=3), LoadResult(model="y", stream=True, errors={"timeout": 1})
    t = format_table([("A", a), ("B", b)])
    assert "A" in t.splitlines()[0] and "B" in t.splitlines()[0]
    assert "timeout=1" in t and "TTFT p50 ms" in t


def test_error_kinds_from_misbehaving_server():
    from aiohttp import web

    async def models(request):
        return web.json_response({"data": [{"id": "bad"}]})

    async def completions(request):
        mode = request.headers.get("X-data-parallel-rank")
        if mode == "0":
            return web.Response(status=503, text="busy")
        if mode == "1":
            return web.Response(body=b"{not json", content_type="application/json")
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"x"}]}\n\n')  # and no [DONE]
        await resp.write_eof()
        return resp

    async def go():
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        try:
            out = {}
            for pin, stream in ((0, False), (1, False), (2, True)):
                out[pin] = await run_load(LoadConfig(url=url, concurrency=2, num_requests=6,
                                                     rank_pin=pin, stream=stream))
            return out
        finally:
            await runner.cleanup()

    out = asyncio.run(go())
    assert out[0].errors == {"http_503": 6} and out[0].model == "bad"
    assert out[1].errors == {"malformed": 6}
    assert out[2].errors == {"no_done": 6}
    assert all(r.ok == 0 and r.requests == 6 for r in out.values())
