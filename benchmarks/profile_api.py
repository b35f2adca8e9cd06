#!/usr/bin/env python3
"""API-server CPU per request, and where it goes: py-spy over api-0 under load.

    python benchmarks/profile_api.py                        # CPU/request, RSS
    python benchmarks/profile_api.py --py-spy               # + a py-spy profile of api-0
    python benchmarks/profile_api.py --code /tmp/before --code . --rounds 3
                                                            # A/B: two source trees, alternating
    python benchmarks/profile_api.py --dp 2 --variant=--lb-policy=tokens --variant=--lb-policy=cache-aware --rounds 4
                                                            # A/B: two sets of server arguments, alternating

--code DIR runs dpserve from another source tree (a folder holding engine/
and daemons/, e.g. `git archive HEAD engine daemons | tar -x -C /tmp/before`)
by putting a dpserve/{engine,daemons} shim first on PYTHONPATH, ahead of the
editable install. Rounds alternate between the trees so that machine noise
hits both alike. py-spy (`pip install py-spy`) samples the running process
from outside; nothing in the server changes. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load import LoadConfig  # noqa: E402
from benchmarks.nodes import (  # noqa: E402
    DpNode,
    code_tree_env,
    ensure_demo_model,
    exit_on_sigterm,
    fmt,
    load_average,
    measure_sync,
    render,
)


def summarize_raw(path: str, top: int) -> str:
    """Self and inclusive shares per frame from py-spy's raw (collapsed) output."""
    own: Counter = Counter()
    incl: Counter = Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            incl[frame] += n
    if not total:
        return "py-spy: no samples"
    out = [f"py-spy: {total} samples of api-0 (idle excluded)", "self:"]
    out += [f"  {c / total * 100:5.1f}%  {f}" for f, c in own.most_common(top)]
    out.append("inclusive:")
    out += [f"  {c / total * 100:5.1f}%  {f}" for f, c in incl.most_common(top)]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="demo model dir (built with `dpserve demo-model` if missing)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--api", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=256,
                   help="distinct prompts, sent round-robin (more than a run sends: every prompt new, no prefix hits)")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--request-rate", type=float, default=None,
                   help="paced load at this many requests/s (load.py --request-rate): both arms then do the same "
                        "work per second, so their CPU per request compares without the batching a closed loop's "
                        "own throughput sets; keep it under the slower arm's capacity")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--code", action="append", default=[], help="a dpserve source tree to run (repeat to compare)")
    p.add_argument("--omp-threads", default="1", help="OMP_NUM_THREADS for the node ('default': the supervisor's choice)")
    p.add_argument("--py-spy", action="store_true", help="record api-0 with py-spy during the (last) run")
    p.add_argument("--py-spy-out", default=None, help="keep the raw py-spy output here")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--server-arg", action="append", default=[], help="an extra dpserve argument (repeat), e.g. --lb-policy=cache-aware")
    p.add_argument("--variant", action="append", default=[],
                   help="extra dpserve arguments of one variant (repeat to compare, shell-quoted), alternated with the others per round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    exit_on_sigterm()

    model = ensure_demo_model(args.model_dir)
    scratch = tempfile.mkdtemp(prefix="profile-api-")
    trees = args.code or [None]
    envs = {}
    for i, tree in enumerate(trees):
        env = code_tree_env(tree, os.path.join(scratch, f"shim{i}")) if tree else {}
        if args.omp_threads != "default":
            env["OMP_NUM_THREADS"] = args.omp_threads
        for variant in args.variant or [""]:
            envs[(tree or "installed") + (f" {variant}" if variant else "")] = (env, shlex.split(variant))
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if args.py_spy and not os.access(spy, os.X_OK):
        print("py-spy not found: pip install py-spy", file=sys.stderr)
        return 2

    cfg_kw = dict(concurrency=args.concurrency, max_tokens=args.max_tokens, stream=args.stream,
                  prompt_words=args.prompt_words, num_prompts=args.num_prompts, ignore_eos=True,
                  request_rate=args.request_rate)
    results: dict[str, list] = {name: [] for name in envs}
    profile_text = ""
    print(f"load average before: {load_average()}", flush=True)
    try:
        for rnd in range(args.rounds):
            order = list(envs) if rnd % 2 == 0 else list(reversed(envs))
            for name in order:
                env, extra = envs[name]
                node = DpNode(model, args.dp, args.api, extra=args.server_arg + extra, env=env, log_dir=scratch)
                try:
                    node.start()
                    url = node.url
                    measure_sync(node, LoadConfig(url=url, duration=args.warmup, seed=1, **cfg_kw))  # warm caches, connections
                    # (seed=1: other prompts than the measurement's, which would otherwise hit the prefix cache)
                    recorder = None
                    last = rnd == args.rounds - 1 and name == order[-1]
                    if args.py_spy and last:
                        raw = args.py_spy_out or os.path.join(scratch, "api0.raw")
                        pid = node.api_processes()[0].pid
                        recorder = subprocess.Popen(
                            [spy, "record", "-p", str(pid), "-d", str(max(1, int(args.duration) - 1)), "-r", "200",
                             "-f", "raw", "-o", raw, "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    m = measure_sync(node, LoadConfig(url=url, duration=args.duration, warmup=0.5, **cfg_kw), name)
                    if recorder is not None:
                        recorder.wait(60)
                        if os.path.exists(raw):
                            profile_text = summarize_raw(raw, args.top)
                    results[name].append(m)
                    print(f"round {rnd + 1} {name}: {m.result.req_per_s:,.0f} req/s, "
                          f"API CPU {fmt(m.api_cpu_us_per_req, 0)} us/req, RSS {m.api_rss_mb} MB, "
                          f"errors {m.result.error_count}, load {m.loadavg}", flush=True)
                finally:
                    node.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    for name, ms in results.items():
        cpu = [m.api_cpu_us_per_req for m in ms if m.api_cpu_us_per_req]
        rps = [m.result.req_per_s for m in ms]
        rss = [max(m.api_rss_mb) for m in ms if m.api_rss_mb]
        rows.append([name, fmt(statistics.median(rps) if rps else None, 0),
                     fmt(statistics.median(cpu) if cpu else None, 0),
                     fmt(min(cpu) if cpu else None, 0), fmt(max(cpu) if cpu else None, 0),
                     fmt(max(rss) if rss else None, 1)])
    what = f"max_tokens={args.max_tokens}{' stream' if args.stream else ''}, c={args.concurrency}, dp{args.dp}/api{args.api}"
    if args.request_rate:
        what += f", paced at {args.request_rate:g} req/s"
    if args.json:
        print(json.dumps({name: [m.to_dict() for m in ms] for name, ms in results.items()}))
    else:
        print(f"\nAPI-server CPU per request ({what}; {args.rounds} round(s), median):")
        print(render(["code", "req/s", "CPU us/req", "min", "max", "RSS MB"], rows))
        if len(results) == 2:
            print(paired_ratio(results))
        if profile_text:
            print("\n" + profile_text)
    return 0


def paired_ratio(results: dict[str, list]) -> str:
    """The second arm's API CPU per request over the first's, round by round (the arms
    alternate, so a round's pair shared the machine's state): geometric mean, median and a
    bootstrap 90% interval of the mean."""
    (a, ma), (b, mb) = results.items()
    ratios = [y.api_cpu_us_per_req / x.api_cpu_us_per_req for x, y in zip(ma, mb)
              if x.api_cpu_us_per_req and y.api_cpu_us_per_req]
    if not ratios:
        return ""

    def gmean(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))

    rng = random.Random(1)
    boot = sorted(gmean(rng.choices(ratios, k=len(ratios))) for _ in range(10_000))
    return (f"\n{b} / {a}, API CPU per request, per round: {' '.join(f'{r:.3f}' for r in ratios)}\n"
            f"geometric mean {gmean(ratios):.3f}, median {statistics.median(ratios):.3f}, "
            f"bootstrap 90% interval {boot[500]:.3f}-{boot[9499]:.3f} ({len(ratios)} rounds)")


if __name__ == "__main__":
    sys.exit(main())
