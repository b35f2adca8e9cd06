"""Small pieces of the node hardening that need no running node: the open-file
limit, the API key's sources, the log filter that stops malformed requests flooding
the journal, and the one policy for undecodable wire messages (the integration side
is tests/integration/test_node_hardening.py)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import msgspec
import pytest
import structlog
from dpserve.daemons.cli.main import _api_keys
from dpserve.engine.common.codec import UNDECODABLE_LOG_INTERVAL_S, Codec
from dpserve.engine.common.logs import _FloodFilter
from dpserve.engine.common.protocol import LoadTable, PrefixRouted, RankLoad, TableChannel


def _api_key(opts: dict) -> str | None:
    return _api_keys(opts)["api_key"]  # (a tenants file: None, with tenants_file and tenant_keys)


def test_soft_fd_limit_is_raised_to_the_hard_limit():
    code = (
        "import resource; from dpserve.engine.common.procutil import raise_fd_limit;"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096));"
        "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "(4096, 4096) (4096, 4096)"


def test_api_key_comes_from_the_flag_or_the_first_line_of_a_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("s3cret\n# comment\n")
    assert _api_key({"api_key": "k", "api_key_file": None}) == "k"
    assert _api_key({"api_key": None, "api_key_file": str(path)}) == "s3cret"
    with pytest.raises(ValueError, match="not both"):
        _api_key({"api_key": "k", "api_key_file": str(path)})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        _api_key({"api_key": None, "api_key_file": str(tmp_path / "empty")})
    with pytest.raises(ValueError, match="cannot read"):
        _api_key({"api_key": None, "api_key_file": str(tmp_path / "missing")})


class BadHttp(Exception):
    """Shaped like aiohttp.http_exceptions.BadHttpMessage: a module under aiohttp and a 4xx code."""

    __module__ = "aiohttp.http_exceptions"
    code = 400


def _record(name: str, msg: str, exc: BaseException | None, level: int = logging.ERROR) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(name, level, __file__, 1, msg, ("10.0.0.9",) if "%s" in msg else (), exc_info)


def test_malformed_requests_become_one_info_line_per_window(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("dpserve.engine.common.logs.time.monotonic", lambda: clock[0])
    flt = _FloodFilter()
    passed = []
    for _ in range(500):
        rec = _record("aiohttp.server", "Error handling request from %s", BadHttp("400, message:\n  Invalid method"))
        if flt.filter(rec):
            passed.append(rec)
    assert len(passed) == 1
    first = passed[0]
    assert first.levelno == logging.INFO and first.exc_info is None
    assert "\n" not in first.getMessage() and "10.0.0.9" in first.getMessage() and "Invalid method" in first.getMessage()
    clock[0] += _FloodFilter.WINDOW_S
    rec = _record("aiohttp.server", "Error handling request from %s", BadHttp("again"))
    assert flt.filter(rec) and "(500 since the last such line" in rec.getMessage()
    # a real server error (500) is left alone, traceback and all
    boom = RuntimeError("boom")
    rec = _record("aiohttp.server", "Error handling request from %s", boom)
    assert flt.filter(rec) and rec.levelno == logging.ERROR and rec.exc_info[1] is boom


def test_undecodable_messages_are_counted_and_logged_rate_limited_never_raised(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("dpserve.engine.common.codec.time.monotonic", lambda: clock[0])
    codec = Codec(LoadTable, "load table")
    good = codec.encode(LoadTable(7, 2, [RankLoad(1, "inc", True)]))
    wrong_type = Codec(PrefixRouted).encode(PrefixRouted("api", []))  # valid msgpack, another message
    with structlog.testing.capture_logs() as logs:
        assert codec.decode_or_none(good).seq == 7
        dropped = [codec.decode_or_none(b, peer="p1") for b in (b"\xc1garbage", wrong_type, b"", good[:-1])]
        assert dropped == [None] * 4 and codec.num_undecodable == 4
        clock[0] += UNDECODABLE_LOG_INTERVAL_S  # a window later: one more line, with the running count
        assert codec.decode_or_none(b"\xff") is None
        assert codec.decode_or_none(good).seq == 7  # and the channel still works
    warned = [e for e in logs if e["event"] == "undecodable message dropped"]
    assert [(e["log_level"], e["channel"], e["num_undecodable"]) for e in warned] == [("warning", "load table", 1), ("warning", "load table", 5)]
    assert warned[0]["peer"] == "p1" and warned[0]["error"]
    with pytest.raises(msgspec.DecodeError):
        codec.decode(b"\xc1")  # decode() is for a caller's own bytes: it still raises


def test_the_supervisor_reads_the_table_channel_without_calling_prefix_news_undecodable():
    """The coordinator's PUB socket carries LoadTables and the API servers'
    PrefixRouted (cache-aware routing); the supervisor keeps only the tables."""
    import asyncio

    from dpserve.daemons.supervisor.events import TableSeen
    from dpserve.daemons.supervisor.producers import read_table

    enc = Codec(TableChannel)
    frames = [enc.encode(PrefixRouted("api-x", [(0, [1, 2])])), enc.encode(LoadTable(3, 1, [RankLoad(0, "i", True)]))]

    class Sub:
        async def recv(self):
            if not frames:
                raise asyncio.CancelledError
            return frames.pop(0)

    posted = []
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(read_table(Sub(), posted.append))
    assert [type(e) for e in posted] == [TableSeen] and posted[0].entries[0].rank == 0
    assert not [e for e in logs if e["event"] == "undecodable message dropped"]


# ------------------------------------------------------------------ start-up refusals and the supervisor's small verbs


def _serve(*args: str, timeout: float = 60, **dpserve_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPSERVE_")} | dpserve_env
    return subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "serve", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_a_key_no_client_can_send_is_refused_at_start_in_one_line(tmp_path):
    """The official client cannot send a non-ASCII key (httpx writes headers as ASCII),
    so a node started with one would answer every request 401: refused, exit 2."""
    import openai

    with openai.OpenAI(api_key="clé", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2) as client:
        with pytest.raises(UnicodeEncodeError):
            client.models.list()
    for bad in ("clé", "two words", "tab\there", "\u200bzero-width"):
        with pytest.raises(ValueError, match="printable ASCII"):
            _api_key({"api_key": bad, "api_key_file": None})
    (tmp_path / "key").write_text("schlüssel\n")
    with pytest.raises(ValueError, match=r"--api-key-file .*\(U\+00FC\)"):
        _api_key({"api_key": None, "api_key_file": str(tmp_path / "key")})
    assert _api_key({"api_key": "Ok-key_1.2~!", "api_key_file": None}) == "Ok-key_1.2~!"
    run = _serve(str(tmp_path), DPSERVE_API_KEY="clé")  # as a unit's environment file gives it
    errors = run.stderr.splitlines()  # stderr is that one line and nothing else
    assert run.returncode == 2 and len(errors) == 1 and errors[0].startswith("<3>"), run.stderr
    assert "U+00E9" in errors[0] and "printable ASCII" in errors[0] and "Traceback" not in run.stderr


def _model_copy(demo_model_dir: str, dest, without: str) -> str:
    shutil.copytree(demo_model_dir, dest)
    os.remove(os.path.join(dest, without))
    return str(dest)


def test_a_model_without_a_loadable_tokenizer_is_refused_before_any_child_starts(demo_model_dir, tmp_path):
    no_tok = _model_copy(demo_model_dir, tmp_path / "no-tokenizer", "tokenizer.json")
    t0 = time.monotonic()
    run = _serve(no_tok, "--port", "0", "--data-parallel-supervisor-port", "0")
    took = time.monotonic() - t0
    errors = run.stderr.splitlines()
    assert run.returncode == 2 and len(errors) == 1 and errors[0].startswith("<3>"), run.stderr
    assert os.path.join(no_tok, "tokenizer.json") in errors[0] and "Traceback" not in run.stderr
    assert "child started" not in run.stderr and "starting" not in run.stderr  # no engine began to load
    bad = _model_copy(demo_model_dir, tmp_path / "bad-tokenizer", "tokenizer.json")
    (tmp_path / "bad-tokenizer" / "tokenizer.json").write_text("{ not json")
    run = _serve(bad, "--port", "0", "--data-parallel-supervisor-port", "0")
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("<3>")]
    assert run.returncode == 2 and len(errors) == 1 and "cannot load" in errors[0] and "tokenizer.json" in errors[0], run.stderr
    no_cfg = _model_copy(demo_model_dir, tmp_path / "no-config", "config.json")
    run = _serve(no_cfg)
    assert run.returncode == 2 and "config.json" in run.stderr and "Traceback" not in run.stderr, run.stderr
    print(f"\nno tokenizer.json: exit 2 after {took:.1f} s")


def test_run_dirs_of_dead_supervisors_are_swept_and_nothing_else(tmp_path):
    from dpserve.daemons.supervisor.boot import RUN_DIR_PREFIX, sweep_run_dirs

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"{RUN_DIR_PREFIX}{gone.pid}-abcd1234"
    live = tmp_path / f"{RUN_DIR_PREFIX}{os.getppid()}-abcd1234"  # a process that runs
    others = [tmp_path / "dpserve-abcd1234", tmp_path / "dpserve-test-abcd1234", tmp_path / f"{RUN_DIR_PREFIX}{gone.pid}-x"]
    for path in (dead, live, *others):
        path.mkdir()
        (path / "supervisor.ctl").write_text("")
    link = tmp_path / f"{RUN_DIR_PREFIX}{gone.pid}-link0000"
    link.symlink_to(others[0])
    assert sweep_run_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and all(p.exists() for p in others) and link.is_symlink()


def test_a_sigkill_is_put_on_the_oom_killer_only_when_the_kernels_count_rose(tmp_path):
    from dpserve.engine.common.procutil import OomRecord, describe_exit

    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    record = OomRecord(str(events))
    assert not record.killed_since_last()  # the count it started from is no news
    events.write_text("low 0\nhigh 0\nmax 5\noom 3\noom_kill 3\noom_group_kill 0\n")
    assert [record.killed_since_last() for _ in range(3)] == [True, True, False]  # one per kill counted
    assert not OomRecord(None).killed_since_last() and not OomRecord(str(tmp_path / "none")).killed_since_last()
    assert describe_exit(-9, oom_killed=record.killed_since_last()) == "signal SIGKILL (not sent by dpserve)"
    own = OomRecord()  # this machine's own cgroup: found where the kernel offers it
    if os.path.exists("/sys/fs/cgroup/memory.events") or os.path.exists("/sys/fs/cgroup/memory/memory.oom_control"):
        assert own.path and isinstance(own.seen, int), own.path


def test_a_worker_that_never_heard_its_head_says_so_and_not_head_lost(tmp_path):
    from tests.unit.test_status_table import all_four, entry, make_sup, table

    sup = make_sup(tmp_path, role="worker", headless=True, data_parallel_start_rank=2)
    try:
        status, ready, line, screen = all_four(sup)
        assert not status["cluster"]["head_reached"] and not ready["head_connected"]
        assert status["reason"].startswith("the head has not been reached yet"), status["reason"]
        assert "head not reached yet" in line and "head not reached yet" in screen
        assert "LOST" not in line and "LOST" not in screen
        table(sup, [entry(r, True) for r in range(4)], at=100.0)
        assert sup.cluster.check_head(100.0 + sup.cluster.head_silence_s + 0.1, 0.0)  # then silent
        status, ready, line, screen = all_four(sup)
        assert status["cluster"]["head_reached"] and "HEAD LOST" in line and "HEAD LOST for" in screen
    finally:
        sup.zctx.destroy(linger=0)


_OOM_PROBE = """
import os, subprocess, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))  # this process and its children now live under the 64 MiB limit
from dpserve.engine.common.procutil import OomRecord, describe_exit
record = OomRecord()
for code in ("x = bytearray(256 << 20)\\nfor i in range(0, len(x), 4096): x[i] = 1",
             "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"):
    rc = subprocess.run([sys.executable, "-c", code]).returncode
    print(describe_exit(rc, oom_killed=rc == -9 and record.killed_since_last()))
"""


def _memory_cgroup_below_ours(name: str) -> str | None:
    """A new cgroup v1 memory group under this process's own, limited to 64 MiB (root only)."""
    line = next((ln for ln in open("/proc/self/cgroup").read().splitlines() if ":memory:" in ln), None)
    if os.geteuid() != 0 or line is None:
        return None
    path = f"/sys/fs/cgroup/memory{line.split(':', 2)[2].rstrip('/')}/{name}"
    try:
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(64 << 20))
    except OSError:
        return None
    return path


def test_a_real_oom_kill_is_named_and_a_plain_sigkill_beside_it_is_not():
    """The kernel's own record, read as the supervisor reads it: one child is killed by
    the OOM killer in a memory-limited cgroup, the next SIGKILLs itself."""
    from tests.support import skip_unless_required

    group = _memory_cgroup_below_ours(f"dpserve-oom-test-{os.getpid()}")
    if group is None:
        skip_unless_required("needs root and a writable cgroup v1 memory hierarchy")
    try:
        run = subprocess.run([sys.executable, "-c", _OOM_PROBE, group], capture_output=True, text=True, timeout=120)
        assert run.stdout.splitlines() == ["signal SIGKILL (killed by the OOM killer)", "signal SIGKILL (not sent by dpserve)"], run
    finally:
        for _ in range(50):  # the group empties once its last process is reaped
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)
