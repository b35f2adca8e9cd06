"""tests/utils.py for vLLM's OpenAI-entrypoint tests run against a chosen server (run.py lays it there).

vLLM's own tests/utils.py starts `vllm serve MODEL ARGS` in RemoteOpenAIServer. This one keeps
its interface (the constructor, url_for, url_root, get_client, get_async_client) and starts
either a dpserve node (VLLM_CONFORMANCE_TARGET=dpserve) or `vllm serve` (=vllm) on the local
demo model, which run.py put in a Hugging Face cache under every model name the tests use.
Arguments are translated the same way for both (see translate_args); it never edits a test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

TARGET = os.environ.get("VLLM_CONFORMANCE_TARGET", "dpserve")
MODEL_MAX_LEN = int(os.environ.get("VLLM_CONFORMANCE_MAX_LEN", "2048"))
# vLLM flags that take no value (the rest used by the vendored tests take one; --lora-modules takes many).
NO_VALUE = {
    "--enforce-eager", "--enable-lora", "--enable-auto-tool-choice", "--enable-prompt-tokens-details",
    "--no-enable-prefix-caching", "--enable-prefix-caching", "--enable-force-include-usage",
    "--return-tokens-as-token-ids", "--skip-tokenizer-init", "--enable-server-load-tracking",
    "--enable-tokenizer-info-endpoint", "--trust-remote-code", "--enable-chunked-prefill",
}
# Left out on both servers: LoRA (dpserve serves no adapters; the adapters are downloads) and GPU memory.
DROPPED = {"--enable-lora", "--lora-modules", "--max-lora-rank", "--max-cpu-loras", "--gpu-memory-utilization"}
# The dpserve flags with vLLM's name and meaning (dpserve serve --help); any other vLLM flag is dropped there.
DPSERVE_FLAGS = {
    "--dtype", "--max-model-len", "--max-num-seqs", "--enforce-eager", "--max-logprobs", "--seed",
    "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser", "--enable-server-load-tracking",
    "--enable-tokenizer-info-endpoint", "--enable-prefix-caching", "--api-key", "--served-model-name",
    "--return-tokens-as-token-ids", "--enable-force-include-usage",
}


def translate_args(args: list[str], target: str) -> tuple[list[str], list[str]]:
    """(the arguments for the target server, the ones left out), flag by flag."""
    kept, dropped, i = [], [], 0
    while i < len(args):
        flag = args[i]
        if flag.startswith("--") and "=" in flag:
            flag, value = flag.split("=", 1)
            values, i = [value], i + 1
        elif flag in NO_VALUE:
            values, i = [], i + 1
        elif flag == "--lora-modules":
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            values, i = args[i + 1:j], j
        else:
            values, i = args[i + 1:i + 2], i + 2
        if flag == "--max-model-len":
            values = [str(min(int(values[0]), MODEL_MAX_LEN))]  # the demo model's positions
        if flag == "--dtype" and values[0] in ("half", "float16"):
            values = ["bfloat16"]  # CPU
        if flag in DROPPED or (target == "dpserve" and flag not in DPSERVE_FLAGS):
            dropped += [flag, *values]
        else:
            kept += [flag, *values]
    return kept, dropped


def _open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(model: str) -> str:
    from huggingface_hub import snapshot_download

    return model if os.path.isdir(model) else snapshot_download(model)  # offline: run.py's cache


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict | None = None) -> None:
        args = list(vllm_serve_args)
        if auto_port:
            args += ["--port", str(_open_port())]
        if seed is not None:
            args += ["--seed", str(seed)]
        self.port = int(args[args.index("--port") + 1])
        args = [a for i, a in enumerate(args) if a != "--port" and (i == 0 or args[i - 1] != "--port")]
        self.host = "127.0.0.1"
        self.uds = None
        kept, dropped = translate_args(args, TARGET)
        print(f"[{TARGET}] {model}: args {kept}, left out {dropped}")
        self.log = tempfile.NamedTemporaryFile(prefix=f"conformance-{TARGET}-", suffix=".log", delete=False)
        env = {**os.environ, **(env_dict or {})}
        path = _resolve(model)
        if TARGET == "vllm":
            cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--distributed-executor-backend", "uni", *kept]
            env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
        else:
            cmd = [os.environ["DPSERVE_PYTHON"], "-m", "dpserve.daemons.cli.main", "serve", path,
                   "--served-model-name", model, "--host", "127.0.0.1", "--port", str(self.port), *kept]
            env["DPSERVE_DIE_WITH_PARENT"] = "1"
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_for_server(max_wait_seconds or float(os.environ.get("VLLM_CONFORMANCE_START_S", "600")))
        except BaseException:
            self._shutdown()
            raise

    def _wait_for_server(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{TARGET} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                with urllib.request.urlopen(self.url_for("health"), timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{TARGET} did not start within {timeout:.0f} s; log: {self.log.name}")

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        keep = os.environ.get("VLLM_CONFORMANCE_LOGS")
        if keep:
            shutil.copy(self.log.name, keep)

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        self._shutdown()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(part.strip("/") for part in parts if part)

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)
