"""The request field `priority` with the official openai client, per --scheduling-policy (vLLM's):
under fcfs (the default) a nonzero priority is a 400 naming it; under priority it is taken on
completions and chat, and a more urgent request passes the requests queued before it (with one
sequence slot, it preempts the one running). With --engine vllm, the priority and the policy
reach vLLM's own scheduler (checked on its engine, in the vLLM venv)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from tests.server import DpServer, wait_until
from tests.support import REPO, vllm_venv

pytestmark = pytest.mark.slow

ARGS = ("--data-parallel-size", "1", "--api-server-count", "1", "--max-model-len", "512", "--dtype", "float32")


def _client(server: DpServer):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def fcfs(demo_model_dir):
    with DpServer(demo_model_dir, *ARGS).start() as srv:
        yield srv


def test_fcfs_takes_priority_zero_and_refuses_any_other(fcfs):
    import openai

    with _client(fcfs) as client:
        r = client.completions.create(model="demo", prompt="hi", max_tokens=2, extra_body={"priority": 0})
        assert r.choices[0].finish_reason in ("stop", "length")
        for priority in (1, -1):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                               extra_body={"priority": priority})
            assert err.value.body["param"] == "priority"
            assert "--scheduling-policy priority" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="demo", prompt="hi", max_tokens=2, extra_body={"priority": 2**63})
        assert "priority" in str(err.value.body)


@pytest.fixture(scope="module")
def prioritized(demo_model_dir):
    # the demo model's whole context: the first batch request must still run when the urgent one comes
    with DpServer(demo_model_dir, *ARGS, "--scheduling-policy", "priority", "--max-num-seqs", "1", "--max-model-len", "2048").start() as srv:
        yield srv


def test_priority_is_taken_and_an_urgent_request_passes_the_queue(prioritized):
    finished: dict[str, float] = {}
    started = threading.Event()

    def low(i: int) -> None:
        with _client(prioritized) as client:
            # the first runs ~1,900 steps (seconds, however fast the machine: at 300 it could end
            # within the 0.3 s below on a quiet one); the others only need to wait behind it
            stream = client.completions.create(model="demo", prompt=f"batch job {i}", max_tokens=1900 if i == 0 else 300, stream=True,
                                               extra_body={"priority": 5, "ignore_eos": True})
            for _ in stream:
                if i == 0:
                    started.set()
        finished[f"low{i}"] = time.monotonic()

    threads = [threading.Thread(target=low, args=(i,)) for i in range(4)]
    threads[0].start()
    assert started.wait(60), "the first batch request never streamed"
    for t in threads[1:]:
        t.start()
    time.sleep(0.3)  # the three queue behind the first (one sequence slot)
    with _client(prioritized) as client:
        chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "now"}], max_tokens=4,
                                              extra_body={"priority": -1, "ignore_eos": True})
        finished["urgent"] = time.monotonic()
        assert chat.usage.completion_tokens == 4
    for t in threads:
        t.join(120)
    wait_until(lambda: len(finished) == 5, 10, what="every request finished")
    order = sorted(finished, key=finished.get)
    assert order[0] == "urgent", f"the urgent request waited for the batch: {order}"

    def preempted() -> bool:  # the rank's count, as its load reports carry it (a second or so late)
        lines = [line for line in prioritized.metrics().splitlines() if line.startswith("vllm:num_preemptions")]
        return any(float(line.rsplit(" ", 1)[1]) >= 1 for line in lines)

    wait_until(preempted, 10, what="the running batch request preempted for the urgent one")


# One slot; four batch requests, then an urgent one: the order vLLM's engine finishes them in.
VLLM_CHECK = """
import sys, time
from dpserve.engine.backends.vllm.core import VllmCore
from dpserve.engine.common.config import EngineConfig
from dpserve.engine.common.protocol import AddRequest, SamplingParams
model, policy = sys.argv[1], sys.argv[2]
core = VllmCore(EngineConfig(model=model, engine="vllm", max_num_seqs=1, max_model_len=256, dtype="float32",
                             scheduling_policy=policy, engine_args={"enforce_eager": "true"}))
urgent = policy == "priority"
low = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, priority=5 if urgent else 0)
high = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, priority=-1 if urgent else 0)
now = time.time()
for i in range(4):
    assert core.add_request(AddRequest(f"low{i}", [5, 6, 7, 8], low, now + i)) is None
core.step()
assert core.add_request(AddRequest("high", [5, 6, 7, 9], high, now + 10)) is None
done = []
while core.has_unfinished():
    done += [out.request_id for out in core.step() if out.finish_reason]
print("ORDER", ",".join(done))
"""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("policy, order", [
    ("priority", "low0,high,low1,low2,low3"),  # vLLM queues by priority; it preempts only for KV blocks
    ("fcfs", "low0,low1,low2,low3,high"),
])
def test_vllm_engine_gets_the_priority_and_the_policy(demo_model_dir, policy, order):
    python = os.path.join(vllm_venv(), "bin", "python")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([python, "-c", VLLM_CHECK, demo_model_dir, policy], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=840)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"ORDER {order}" in run.stdout
