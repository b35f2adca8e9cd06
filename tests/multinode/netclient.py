"""HTTP and ZeroMQ client actions run INSIDE a test network namespace; prints one JSON object.

The test process lives in the host's namespace and cannot reach 10.77.0.x, so
it runs this script through `nsenter -n`. Every loop here is bounded in count
and time and talks only to the namespaces' own addresses.

  get URL                               status and body
  wait-ready URL TIMEOUT                poll until 200
  burst URL N CONCURRENCY [PIN]         N completions; counts by status and serving rank
  loop URL SECONDS CONCURRENCY          closed loop; every request's (start, end, status, rank)
  streams URL N MAX_TOKENS              N greedy streamed completions at once; each one's text, error, rank
  rogue HEAD_ADDR RPC_PORT API_ADDR KEYFILE   try to join without the key, with a wrong key, with a wrong config
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import sys
import time

import aiohttp

BODY = {"model": "demo", "prompt": "multi node", "max_tokens": 2, "temperature": 0}


async def _one(session, url, pin=None):
    headers = {"X-data-parallel-rank": str(pin)} if pin is not None else {}
    try:
        async with session.post(url + "/v1/completions", json=BODY, headers=headers) as resp:
            await resp.read()
            return resp.status, resp.headers.get("X-data-parallel-rank")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return type(exc).__name__, None


async def burst(url: str, n: int, concurrency: int, pin=None) -> dict:
    sem = asyncio.Semaphore(concurrency)
    statuses: dict[str, int] = {}
    ranks: dict[str, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def go():
            async with sem:
                status, rank = await _one(session, url, pin)
                statuses[str(status)] = statuses.get(str(status), 0) + 1
                if rank is not None:
                    ranks[rank] = ranks.get(rank, 0) + 1

        await asyncio.gather(*(go() for _ in range(n)))
    return {"statuses": statuses, "ranks": ranks}


async def loop(url: str, seconds: float, concurrency: int) -> dict:
    records = []
    deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def worker():
            while time.monotonic() < deadline and len(records) < 200_000:
                start = time.monotonic() - t0
                status, rank = await _one(session, url)
                records.append((round(start, 4), round(time.monotonic() - t0, 4), str(status), rank))
                if status != 200:
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"records": records, "started_wall": time.time() - (time.monotonic() - t0)}


async def streams(url: str, n: int, max_tokens: int) -> dict:
    async def one(session, i):
        body = {"model": "demo", "prompt": f"stream {i} across nodes", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, error = [], None
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                rank = resp.headers.get("X-data-parallel-rank")
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        error = event.get("error", {}).get("message") if "error" in event else error
                        text += [c["text"] for c in event.get("choices", ())]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return {"text": "".join(text), "error": repr(exc), "rank": None}
        return {"text": "".join(text), "error": error, "rank": rank}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
        return {"results": await asyncio.gather(*(one(session, i) for i in range(n)))}


async def get(url: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(url) as resp:
            text = await resp.text()
            return {"status": resp.status, "body": text}


async def wait_ready(url: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = await get(url)
            if last["status"] == 200:
                return last
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            last = {"status": None, "body": repr(exc)}
        await asyncio.sleep(0.25)
    return {"status": "timeout", "last": last}


def rogue(head: str, rpc_port: int, api_address: str, key_file: str) -> dict:
    """Each attempt an outsider could make; the answer says what it got back."""
    import zmq
    from dpserve.engine.common.auth import CurveKeys, make_client
    from dpserve.engine.common.codec import Codec
    from dpserve.engine.common.protocol import CoordinatorInput, CoordinatorToEngine, EngineHello, EngineRegister, EngineToApi

    codec = Codec(CoordinatorInput | CoordinatorToEngine)
    ctx = zmq.Context()
    # A DEALER's send blocks while it has no peer, and a CURVE handshake that
    # the server refuses leaves it with none (CI saw the API-server injection
    # below block for good). Every send here gives up after 3 s: a message that
    # could not even be queued reached nobody, which is what is checked.
    ctx.setsockopt(zmq.SNDTIMEO, 3000)
    good = CurveKeys.from_file(key_file)
    wrong = CurveKeys(b"not-the-deployment-secret-at-all")

    def register(keys, fingerprint: str) -> str:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            make_client(sock, keys)
        sock.connect(f"tcp://{head}:{rpc_port}")
        try:
            sock.send(codec.encode(EngineRegister(1, "rogue", fingerprint, 1, "rogue", 0)))
        except zmq.Again:
            sock.close(0)
            return "no answer"
        if sock.poll(3000):
            reply = codec.decode(sock.recv())
            sock.close(0)
            return f"accepted={reply.accepted} reason={reply.reason}"
        sock.close(0)
        return "no answer"

    result = {
        "no_key": register(None, "whatever"),
        "wrong_key": register(wrong, "whatever"),
        "wrong_config": register(good, "0000000000000000"),
    }
    # Inject into an API server's engine channel without the key: nothing may arrive.
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"0")
    sock.connect(api_address)
    try:
        sock.send(Codec(EngineToApi).encode(EngineHello(0, "rogue")))
    except zmq.Again:
        result["api_reply_without_key"] = "nothing"
    else:
        result["api_reply_without_key"] = "got data" if sock.poll(2000) else "nothing"
    sock.close(0)
    # No ctx.term(): libzmq can block in it for good after a failed CURVE
    # handshake on a slow machine (libzmq #2733, pyzmq #626), even with
    # LINGER 0. main() leaves with os._exit once the answer is printed.
    return result


def main() -> None:
    # Stuck past the caller's patience: leave with every thread's stack on
    # stderr, which the test shows, rather than be killed without a word.
    faulthandler.dump_traceback_later(float(os.environ.get("NETCLIENT_DEADLINE", "110")), exit=True)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "get":
        out = asyncio.run(get(args[0]))
    elif cmd == "wait-ready":
        out = asyncio.run(wait_ready(args[0], float(args[1])))
    elif cmd == "burst":
        pin = int(args[3]) if len(args) > 3 else None
        out = asyncio.run(burst(args[0], int(args[1]), int(args[2]), pin))
    elif cmd == "loop":
        out = asyncio.run(loop(args[0], float(args[1]), int(args[2])))
    elif cmd == "streams":
        out = asyncio.run(streams(args[0], int(args[1]), int(args[2])))
    elif cmd == "rogue":
        print(json.dumps(rogue(args[0], int(args[1]), args[2], args[3])), flush=True)
        os._exit(0)
    else:
        raise SystemExit(f"unknown command {cmd}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
