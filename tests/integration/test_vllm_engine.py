"""`--engine vllm`: vLLM's engine in each rank, dpserve's node around it.

Served at DP 2 / 2 API servers from the vLLM venv (`make setup-vllm`; CI
builds it), checked with the official openai client the way the native
engine is: greedy answers equal `vllm serve`'s for the same model and
settings (completions and chat, streamed and not), stop strings, logprobs and
structured output pass through, pins land on their rank, a client that leaves
aborts its request on the rank, and a SIGKILLed rank is restarted by the
supervisor and answers as before, while the other rank serves meanwhile.

Skips with the reason where no vLLM venv exists (DPSERVE_REQUIRE_VLLM=1 makes
that a failure, as in CI).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from tests.server import DpServer, http_get, pid_alive, wait_until
from tests.support import vllm_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# Like with like: vLLM's own server and dpserve's vLLM ranks get the same engine settings.
SETTINGS = ["--max-model-len", "512", "--dtype", "bfloat16"]
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
START_TIMEOUT_S = 600  # vLLM compiles the model on its first start on a machine (minutes on 2 cores)

PROMPTS = ["Hi", "The quick brown fox", "data parallel serving with many ranks " * 4, "0123456789"]
CHATS = [[{"role": "user", "content": "hello"}], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is DP?"}]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(base: str):
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def _answers(base: str) -> dict:
    """Greedy answers (text, finish reason) one request at a time, so batching cannot matter."""
    client = _client(base)
    out = {}
    for i, prompt in enumerate(PROMPTS):
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=16, temperature=0)
        out[f"cmpl{i}"] = (r.choices[0].text, r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens)
    for i, messages in enumerate(CHATS):
        r = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0)
        out[f"chat{i}"] = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens)
    client.close()
    return out


@pytest.fixture(scope="module")
def venv() -> str:
    return vllm_venv()


@pytest.fixture(scope="module")
def vllm_reference(venv, demo_model_dir) -> dict:
    """`vllm serve` on the same model and settings: its greedy answers, then it is stopped."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [os.path.join(venv, "bin", "vllm"), "serve", demo_model_dir, "--served-model-name", "demo", "--host", "127.0.0.1",
         "--port", str(port), "--distributed-executor-backend", "uni", "--seed", "0", *SETTINGS],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        def up():
            assert proc.poll() is None, f"vllm serve exited {proc.returncode}: {open(log.name, errors='replace').read()[-3000:]}"
            try:
                return http_get(base + "/health", 2)[0] == 200
            except OSError:
                return False

        wait_until(up, START_TIMEOUT_S, 0.5, "vllm serve")
        return _answers(base)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
        log.close()
        os.unlink(log.name)


@pytest.fixture(scope="module")
def node(venv, demo_model_dir, vllm_reference):
    srv = DpServer(
        demo_model_dir, "--engine", "vllm", "--data-parallel-size", "2", "--api-server-count", "2", *SETTINGS,
        "--kv-cache-memory-bytes", str(1 << 30),
        # vLLM's first step after a restart can be slow on 2 busy cores: probes are lenient
        "--dp-supervisor-probe-interval-s", "2", "--dp-supervisor-probe-failure-threshold", "5",
        python=os.path.join(venv, "bin", "python"), env=VLLM_ENV,
    )
    try:
        srv.start(wait_ready=False)
        srv.wait_ready(START_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()
        for pid in srv.child_pids:
            assert not pid_alive(pid), f"child {pid} outlived the node"


def test_ranks_run_vllm_and_report_it(node):
    log = node.log()
    assert log.count("engine=vllm") >= 2 and "vllm_version=0.3" in log, log[-3000:]
    for rank in (0, 1):
        child = node.child(f"engine-dp{rank}")
        assert child["state"] == "ready" and "kv_cache_usage_perc" in child


def test_greedy_answers_equal_vllm_serve(node, vllm_reference):
    got = _answers(node.url)
    assert got == vllm_reference


def test_streaming_stop_strings_logprobs_and_structured_output(node, vllm_reference):
    client = _client(node.url)
    text = vllm_reference["cmpl1"][0]
    # streamed, the same text as the non-streamed answer
    chunks = client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    # a stop string cuts the text before it
    cut = text[3:6]
    if cut:
        r = client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[cut])
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(cut)]
    # logprobs: one entry per token, the chosen token among its top alternatives under greedy
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(top) >= 2 for top in lp.top_logprobs)
    assert all(lp.token_logprobs[i] == max(top.values()) for i, top in enumerate(lp.top_logprobs))
    # structured output: JSON that parses, and a choice from the list
    r = client.completions.create(model="demo", prompt="{", max_tokens=24, temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].text)
    r = client.completions.create(model="demo", prompt="yes or no?", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    client.close()


def test_pins_land_on_their_rank(node):
    for rank in (0, 1):
        before = node.rank_finished()
        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps({"model": "demo", "prompt": "pin", "max_tokens": 2}),
                         {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("X-data-parallel-rank") == str(rank), resp.read()
            resp.read()
            conn.close()
        wait_until(lambda r=rank, b=before: node.rank_finished().get(r, 0) - b.get(r, 0) >= 3, 10, what=f"rank {rank}'s counter")


def _aborted(node, rank: int) -> float:
    for line in http_get(node.url + "/metrics")[1].decode().splitlines():
        if line.startswith(f'dpserve_rank_requests_aborted_total{{rank="{rank}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_leaves_aborts_its_request_on_the_rank(node):
    before = _aborted(node, 0)
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
    body = json.dumps({"model": "demo", "prompt": "go on", "max_tokens": 400, "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "X-data-parallel-rank": "0"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: _aborted(node, 0) > before, 15, 0.1, "rank 0 to report the aborted request")
    wait_until(lambda: node.child("engine-dp0").get("running", 0) == 0, 15, 0.1, "rank 0 to be idle")


def test_a_killed_rank_is_restarted_and_answers_as_before(node, vllm_reference):
    old = node.child("engine-dp0")
    os.kill(old["pid"], signal.SIGKILL)
    # once the node knows (a request already routed to rank 0 gets a fast 503, as with
    # the native engine), the other rank serves meanwhile: nothing hangs
    wait_until(lambda: node.child("engine-dp0")["state"] != "ready", 15, 0.05, "the node to notice rank 0's death")
    client = _client(node.url)
    started = time.monotonic()
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == vllm_reference["cmpl0"][:2]
    assert time.monotonic() - started < 60
    wait_until(lambda: (c := node.child("engine-dp0"))["pid"] != old["pid"] and c["state"] == "ready", START_TIMEOUT_S, 0.5, "rank 0 back")
    assert node.child("engine-dp0")["restarts"] == old["restarts"] + 1
    node.refresh_child_pids()
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"model": "demo", "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0}),
                 {"Content-Type": "application/json", "X-data-parallel-rank": "0"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, body
    assert body["choices"][0]["text"] == vllm_reference["cmpl2"][0]
    client.close()


def test_multi_node_head_and_headless_worker_with_vllm_ranks(venv, demo_model_dir, vllm_reference, tmp_path):
    """A head and a headless worker on loopback, one vLLM rank each, authenticated: both
    ranks serve through the head's API server and answer as `vllm serve`. A worker that
    runs the native engine is refused by the head (every rank runs the same engine): exit 2."""
    from tests.integration.test_cluster_ports import Node
    from tests.server import free_port_run

    key = tmp_path / "dp.key"
    key.write_bytes(os.urandom(32).hex().encode())
    key.chmod(0o600)
    rpc = free_port_run(4)
    python = os.path.join(venv, "bin", "python")
    common = [*SETTINGS, "--dp-supervisor-probe-interval-s", "2", "--dp-supervisor-probe-timeout-s", "2",
              "--dp-supervisor-probe-failure-threshold", "5"]
    vllm = ["--engine", "vllm", "--kv-cache-memory-bytes", str(512 << 20), *common]
    started = []
    try:
        head = Node(tmp_path, "head", "head", demo_model_dir, str(key), rpc, *vllm, python=python, env=VLLM_ENV)
        started.append(head)
        native = Node(tmp_path, "native", "worker", demo_model_dir, str(key), rpc, "--headless", "--data-parallel-start-rank", "1",
                      *common, python=python)
        started.append(native)
        rc = native.wait_exit(300)
        assert rc == 2 and "fingerprint" in native.log(), native.log()[-3000:]

        worker = Node(tmp_path, "worker", "worker", demo_model_dir, str(key), rpc, "--headless", "--data-parallel-start-rank", "1",
                      *vllm, python=python, env=VLLM_ENV)
        started.append(worker)
        health = head.health()

        def ready():
            for n in (head, worker):
                assert n.proc.poll() is None, n.log()[-3000:]
            try:
                return http_get(health + "/readyz", 2)[0] == 200 and json.loads(http_get(health + "/status")[1])["cluster"]["ranks_routable"] == 2
            except (OSError, KeyError, ValueError):
                return False

        wait_until(ready, START_TIMEOUT_S, 0.5, "both vLLM ranks in the cluster")
        port = json.loads(head.ports_file.read_text())["port"]
        for rank in (0, 1):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/completions", json.dumps({"model": "demo", "prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0}),
                         {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
            resp = conn.getresponse()
            body = json.loads(resp.read())
            conn.close()
            assert resp.status == 200 and resp.getheader("X-data-parallel-rank") == str(rank), body
            assert body["choices"][0]["text"] == vllm_reference["cmpl3"][0]
    finally:
        for n in reversed(started):
            n.stop()


def test_a_stream_whose_vllm_rank_is_killed_ends_as_the_uninterrupted_answer(node):
    """Migration with vLLM ranks (issue 25): greedy, the answering rank SIGKILLed after 12
    tokens; vLLM on the other rank prefills prompt + those tokens and the text equals the
    uninterrupted answer."""
    from tests.integration.test_migration import stream_killing_its_rank

    payload = {"model": "demo", "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    client = _client(node.url)
    want = client.completions.create(**{k: v for k, v in payload.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    client.close()
    text, finish, tokens, rank = stream_killing_its_rank(node, payload, after_events=12)
    assert (text, finish, tokens) == (want.choices[0].text, "length", 40)
    wait_until(lambda: node.child(f"engine-dp{rank}")["state"] == "ready", START_TIMEOUT_S, 0.5, f"rank {rank} back")
    node.refresh_child_pids()
