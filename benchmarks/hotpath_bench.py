#!/usr/bin/env python3
"""CPU per call of the API server's request handlers, in process, without sockets.

    python benchmarks/hotpath_bench.py [--model-dir DIR] [--code TREE] [--n 4000] [--repeats 7]

Drives OpenAIServing.completions / chat_completions (the real handlers, router,
metrics and tokenizer) with prebuilt aiohttp requests and a fake engine client
that finishes each request as soon as it is sent. What is left out on purpose:
HTTP parsing and the socket writes (aiohttp's, the same for any handler) and
the ZeroMQ send (engine_client.py). Reported: CPU microseconds per call, the
best of --repeats batches (process CPU time, so other load on the machine
barely moves it). --code TREE measures another source tree (see
profile_api.py); run it once per tree to compare before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _apply_code_tree(argv: list[str]) -> None:
    """--code TREE must take effect before dpserve is imported: re-exec with a shim."""
    if "--code" not in argv or os.environ.get("_HOTPATH_SHIM"):
        return
    tree = os.path.abspath(argv[argv.index("--code") + 1])
    shim = tempfile.mkdtemp(prefix="hotpath-shim-")
    os.makedirs(os.path.join(shim, "dpserve"))
    for sub in ("engine", "daemons"):
        os.symlink(os.path.join(tree, sub), os.path.join(shim, "dpserve", sub))
    env = {**os.environ, "_HOTPATH_SHIM": shim, "PYTHONPATH": shim}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


class _Config(SimpleNamespace):
    """A duck-typed ApiServerConfig: attributes not given fall back to the real
    config's defaults where this tree has them (new options do not break the benchmark)."""

    def __getattr__(self, name: str):
        import msgspec
        from dpserve.daemons.config import ApiServerConfig

        for field in msgspec.structs.fields(ApiServerConfig):
            if field.name == name and (field.default is not msgspec.NODEFAULT or field.default_factory is not msgspec.NODEFAULT):
                value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
                setattr(self, name, value)  # looked up once: the handlers read it per request
                return value
        raise AttributeError(name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--code", default=None, help="dpserve source tree to measure (default: the installed one)")
    p.add_argument("--n", type=int, default=4000, help="requests per batch")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt-words", type=int, default=8)
    args = p.parse_args(argv)

    import msgspec
    from aiohttp import streams
    from aiohttp.test_utils import make_mocked_request
    from dpserve.daemons.api.metrics import ApiMetrics
    try:
        from dpserve.daemons.api.migration import Migrator
    except ImportError:  # --code at a tree before migration
        Migrator = None
    from dpserve.daemons.api.router import Router
    try:
        import dpserve.daemons.api.endpoints as serving_mod
    except ImportError:  # --code: a tree from before the endpoints were split out of serving.py
        import dpserve.daemons.api.serving as serving_mod
    OpenAIServing = serving_mod.OpenAIServing
    from dpserve.daemons.api.tokenizer import TextTokenizer
    from dpserve.engine.common.protocol import LoadTable, RankLoad, RequestOutput

    from benchmarks.load import make_prompts
    from benchmarks.nodes import ensure_demo_model

    model = ensure_demo_model(args.model_dir)
    # Only the attributes the handlers and metrics read (a duck-typed ApiServerConfig, so
    # new required fields of the real config do not break this benchmark).
    cfg = _Config(name="api-0", index=0, model_dir=model, served_model_name="demo", api_key=None,
                          data_parallel_size=1, max_model_len=2048, lb_policy="queue",
                          max_waiting_per_rank=4096, max_request_body_bytes=1 << 22,
                          # ApiServerConfig's defaults (a namespace, so --code can point at older trees)
                          wait_for_engine_s=60.0, request_first_token_timeout_s=600.0,
                          http_idle_timeout_s=30.0, http_body_timeout_s=60.0, http_max_connections=2048,
                          stream_buffer_bytes=1 << 20, stream_buffer_total_bytes=256 << 20, stream_write_timeout_s=60.0)
    tokenizer = TextTokenizer.from_dir(model)
    router = Router(1, "queue", 1 << 62)  # no admission limit: nothing here ever finishes on an engine
    router.update_table(LoadTable(1, 1, [RankLoad(0, "x", True)]))
    router.engine_hello(0, "x")

    class FakeClient:
        """Finishes every request on send with `tokens` tokens of one engine step each."""

        def __init__(self) -> None:
            self.router = router
            self.tokens = 1
            if Migrator is not None:
                self.migrator = Migrator(self, 0, False, 0.0, None)  # never moves: no rank is ever lost here

        def send(self, state, add, rank: int) -> None:
            state.rank = rank
            router.on_send(rank, state.remaining)
            ids = add.prompt_token_ids
            n = self.tokens
            for i in range(n):
                state.push(RequestOutput(state.request_id, [ids[i % len(ids)]], "length" if i == n - 1 else None))
            router.on_finish(rank, state.remaining)

        def abort(self, state) -> None:
            pass

    client = FakeClient()
    metrics = ApiMetrics(cfg, router)

    class _Log:
        def __getattr__(self, name):
            return lambda *a, **k: None

    serving = OpenAIServing(cfg, tokenizer, client, metrics, _Log())
    router.max_waiting_per_rank = 1 << 62  # admission's threshold too: no rank reports here, so none may fill
    enc = msgspec.json.Encoder()
    prompts = make_prompts([(args.prompt_words, 1.0)], 256, 0)

    def bodies(kind: str, max_tokens: int, stream: bool) -> list[bytes]:
        out = []
        for prompt in prompts:
            body = {"model": "demo", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            if kind == "chat":
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            if stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            out.append(enc.encode(body))
        return out

    class _Proto:
        def __init__(self) -> None:
            self._reading_paused = False

        def pause_reading(self, *a, **k) -> None:
            pass

        def resume_reading(self, *a, **k) -> None:
            pass

    class NullWriter:
        """aiohttp's payload writer, minus the socket: counts bytes and returns."""

        buffer_size = 0
        length = None
        transport = None

        def __init__(self) -> None:
            self.output_size = 0

        def enable_chunking(self) -> None:
            pass

        def enable_compression(self, *a, **k) -> None:
            pass

        async def write_headers(self, status_line, headers) -> None:
            pass

        def send_headers(self, *a, **k) -> None:
            pass

        async def write(self, chunk, *a, **k) -> None:
            self.output_size += len(chunk)

        async def write_eof(self, chunk=b"") -> None:
            self.output_size += len(chunk)

        async def drain(self) -> None:
            pass

    class NullTransport:
        """A connection whose client keeps up: what stream pacing reads of it costs what a
        real transport's does (a Mock's attribute calls would cost ~100 us a stream)."""

        def get_write_buffer_size(self) -> int:
            return 0

        def is_closing(self) -> bool:
            return False

        def get_extra_info(self, name, default=None):
            return default

        def set_write_buffer_limits(self, high=None, low=None) -> None:
            pass

    async def requests(path: str, payloads: list[bytes], n: int):
        """n fresh requests: clones of one mocked request per body, each with its own payload."""
        loop = asyncio.get_running_loop()
        writer = NullWriter()
        templates = [make_mocked_request("POST", path, headers={"Content-Type": "application/json",
                                                                "Content-Length": str(len(data))},
                                         writer=writer, transport=NullTransport(), client_max_size=1 << 22) for data in payloads]
        out = []
        for i in range(n):
            data = payloads[i % len(payloads)]
            reader = streams.StreamReader(_Proto(), 2**16, loop=loop)
            reader.feed_data(data)
            reader.feed_eof()
            req = templates[i % len(payloads)].clone()
            req._payload = reader
            out.append(req)
        return out

    async def run_case(handler, path: str, payloads: list[bytes], tokens: int) -> float:
        client.tokens = tokens
        best = float("inf")
        for _ in range(args.repeats):
            reqs = await requests(path, payloads, args.n)
            gc.collect()
            gc.disable()
            try:
                t0 = time.process_time()
                for r in reqs:
                    resp = await handler(r)
                    if resp.status != 200:
                        raise RuntimeError(f"status {resp.status}: {getattr(resp, 'body', b'')[:200]!r}")
                t1 = time.process_time()
            finally:
                gc.enable()
            best = min(best, (t1 - t0) / args.n * 1e6)
        return best

    cases = [
        ("completions, max_tokens=1", serving.completions, "/v1/completions", bodies("completions", 1, False), 1),
        ("completions, max_tokens=16", serving.completions, "/v1/completions", bodies("completions", 16, False), 16),
        ("completions, stream, 16 tokens", serving.completions, "/v1/completions", bodies("completions", 16, True), 16),
        ("chat, max_tokens=1", serving.chat_completions, "/v1/chat/completions", bodies("chat", 1, False), 1),
        ("chat, stream, 16 tokens", serving.chat_completions, "/v1/chat/completions", bodies("chat", 16, True), 16),
    ]

    async def run() -> None:
        print(f"code: {Path(serving_mod.__file__).resolve().parents[1]}  (n={args.n}, best of {args.repeats})")
        print(f"{'handler':<34} {'CPU us/call':>11}")
        for name, handler, path, payloads, tokens in cases:
            us = await run_case(handler, path, payloads, tokens)
            print(f"{name:<34} {us:>11.1f}", flush=True)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    _apply_code_tree(sys.argv)
    sys.exit(main())
