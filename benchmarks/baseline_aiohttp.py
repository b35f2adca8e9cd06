#!/usr/bin/env python3
"""Practical ceiling: a bare aiohttp server speaking just enough OpenAI.

POST /v1/completions and /v1/chat/completions parse the JSON body (msgspec)
and answer a fixed completion of ``max_tokens`` tokens (default 16, capped by
--max-chunks) with usage; with ``"stream": true`` they send one SSE event per
token, written one by one, then a usage chunk (when stream_options.include_usage)
and ``data: [DONE]``.  GET /v1/models lists one model; GET /stats returns the
request count and CPU seconds since the first request.  Every answer carries
``X-data-parallel-rank`` (the pinned rank echoed, else --rank).

On SIGINT/SIGTERM it prints its CPU use per request to stdout and exits.
The first stdout line is ``listening on http://HOST:PORT`` (use --port 0 for a
free port).  Binds loopback only unless --allow-remote.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import resource
import signal
import sys
import time

import msgspec
from aiohttp import web

RANK_HEADER = "X-data-parallel-rank"
MODEL = "baseline"


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _Req(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    prompt: object = None
    messages: object = None


class Baseline:
    def __init__(self, rank: int, max_chunks: int, token_delay: float):
        self.rank = str(rank)
        self.max_chunks = max_chunks
        self.token_delay = token_delay
        self.requests = 0
        self.cpu0: float | None = None
        self.t0: float | None = None
        self.decoder = msgspec.json.Decoder(_Req)
        self.enc = msgspec.json.Encoder()
        self.created = int(time.time())
        self._cache: dict[tuple, object] = {}

    def _count(self) -> None:
        if self.cpu0 is None:
            self.cpu0 = _cpu()
            self.t0 = time.perf_counter()
        self.requests += 1

    def _rank(self, request: web.Request) -> str:
        return request.headers.get(RANK_HEADER, self.rank)

    async def models(self, request: web.Request) -> web.Response:
        body = self.enc.encode({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": self.created, "owned_by": "baseline"}]})
        return web.Response(body=body, content_type="application/json",
                            headers={RANK_HEADER: self._rank(request)})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    def snapshot(self) -> dict:
        cpu = (_cpu() - self.cpu0) if self.cpu0 is not None else 0.0
        return {
            "requests": self.requests,
            "cpu_s_since_first_request": cpu,
            "cpu_s_total": _cpu(),
            "cpu_us_per_request": (cpu / self.requests * 1e6) if self.requests else None,
        }

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self._count()
        chat = request.path.endswith("/chat/completions")
        try:
            req = self.decoder.decode(await request.read())
        except msgspec.MsgspecError as exc:
            return web.Response(status=400, content_type="application/json",
                                body=self.enc.encode({"error": {"message": str(exc), "type": "invalid_request_error",
                                                              "param": None, "code": None}}))
        if (req.messages if chat else req.prompt) is None:
            return web.Response(status=400, content_type="application/json",
                                body=b'{"error":{"message":"missing prompt/messages","type":"invalid_request_error",'
                                     b'"param":null,"code":null}}')
        n = max(1, min(req.max_tokens or 16, self.max_chunks))
        model = req.model or MODEL
        headers = {RANK_HEADER: self._rank(request)}
        if not req.stream:
            return web.Response(body=self._full(chat, n, model), content_type="application/json",
                                headers=headers)
        include_usage = bool(req.stream_options and req.stream_options.get("include_usage"))
        chunks = self._chunks(chat, n, model, include_usage)
        resp = web.StreamResponse(headers=headers)
        resp.content_type = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        await resp.prepare(request)
        delay = self.token_delay
        for c in chunks:
            await resp.write(c)
            if delay:
                await asyncio.sleep(delay)
        await resp.write_eof()
        return resp

    def _full(self, chat: bool, n: int, model: str) -> bytes:
        key = ("full", chat, n, model)
        body = self._cache.get(key)
        if body is None:
            text = " tok" * n
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
            if chat:
                obj = {"id": "chatcmpl-baseline", "object": "chat.completion", "created": self.created,
                       "model": model, "usage": usage,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "logprobs": None, "finish_reason": "length"}]}
            else:
                obj = {"id": "cmpl-baseline", "object": "text_completion", "created": self.created,
                       "model": model, "usage": usage,
                       "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}]}
            body = self.enc.encode(obj)
            if len(self._cache) < 1024:
                self._cache[key] = body
        return body  # type: ignore[return-value]

    def _chunks(self, chat: bool, n: int, model: str, include_usage: bool) -> list[bytes]:
        key = ("stream", chat, n, model, include_usage)
        chunks = self._cache.get(key)
        if chunks is None:
            enc = self.enc
            obj_name = "chat.completion.chunk" if chat else "text_completion"
            cid = "chatcmpl-baseline" if chat else "cmpl-baseline"

            def ev(choices, usage=None) -> bytes:
                o = {"id": cid, "object": obj_name, "created": self.created, "model": model, "choices": choices}
                if usage is not None:
                    o["usage"] = usage
                return b"data: " + enc.encode(o) + b"\n\n"

            chunks = []
            if chat:
                chunks.append(ev([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]))
            for i in range(n):
                fin = "length" if i == n - 1 else None
                if chat:
                    choice = {"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": fin}
                else:
                    choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": fin}
                chunks.append(ev([choice]))
            if include_usage:
                chunks.append(ev([], {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}))
            chunks.append(b"data: [DONE]\n\n")
            if len(self._cache) < 1024:
                self._cache[key] = chunks
        return chunks  # type: ignore[return-value]


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(args: argparse.Namespace) -> None:
    b = Baseline(args.rank, args.max_chunks, args.token_delay_ms / 1000.0)
    app = web.Application()
    app.router.add_get("/v1/models", b.models)
    app.router.add_get("/stats", b.stats)
    app.router.add_post("/v1/completions", b.complete)
    app.router.add_post("/v1/chat/completions", b.complete)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening on http://{args.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    s = b.snapshot()
    per = s["cpu_us_per_request"]
    print(
        f"baseline: {s['requests']} requests, {s['cpu_s_since_first_request']:.3f} CPU s since the first "
        f"request ({s['cpu_s_total']:.3f} s total), "
        + (f"{per:.1f} CPU us/request" if per is not None else "no requests"),
        flush=True,
    )
    await runner.cleanup()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--rank", type=int, default=0, help=f"value of the {RANK_HEADER} response header")
    p.add_argument("--max-chunks", type=int, default=4096, help="cap on tokens per answer")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="sleep between streamed tokens")
    p.add_argument("--allow-remote", action="store_true", help="allow binding a non-loopback address")
    args = p.parse_args(argv)
    if not args.allow_remote and not _is_loopback(args.host):
        print(f"error: refusing to bind non-loopback host {args.host!r} (use --allow-remote)", file=sys.stderr)
        return 2
    try:
        import uvloop  # type: ignore
    except ImportError:
        uvloop = None
    if uvloop is not None:
        uvloop.run(serve(args))
    else:
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
