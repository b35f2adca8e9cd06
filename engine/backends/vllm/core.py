"""vLLM's engine as a dpserve rank: `--engine vllm`.

One rank process runs vLLM's `LLMEngine` in-process (no engine-core
subprocess, no vLLM API server) behind the RankEngine interface, so the
engine process, the protocol and everything around it (API servers, router,
coordinator, supervisor, probes, multi-node) are unchanged. The API servers
keep tokenizing and detokenizing; vLLM sees token ids in and gives token ids
out (detokenize=False, DELTA outputs).

The vLLM surface used, all public (see VLLM_SUPPORTED for the versions tested):
`EngineArgs`, `LLMEngine.from_engine_args(args, stat_loggers=...)`,
`add_request(id, tokens_input(ids), SamplingParams, arrival_time)`, `step()`,
`abort_request(ids)`, `SamplingParams`, `StructuredOutputsParams`,
`RequestOutputKind.DELTA`, and a custom `StatLoggerBase` for the scheduler's
running / waiting counts and KV usage. A vLLM upgrade that renames any of
these fails the rank at start with a clear message, never mid-request.

Nothing here imports vllm at module level; the translation of dpserve's
configuration and parameters into vLLM's is args.py, plain Python.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from dpserve.engine.backends.vllm.args import (
    INSTALL_HINT,
    VllmConfigError,
    check_vllm_version,
    cpu_bind,
    engine_args_kwargs,
    local_devices,
    sampling_kwargs,
    structured_outputs_kwargs,
    to_token_logprobs,
    visible_gpus,
    vllm_version,
)
from dpserve.engine.backends.vllm.kv_events import VllmKVEvents, events_config
from dpserve.engine.common.config import EngineConfig, resolve_max_model_len
from dpserve.engine.common.protocol import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, AddRequest, RequestOutput
from dpserve.engine.kv_events import KVEventLog
from dpserve.engine.memory import available_memory_bytes

# A step longer than STEP_POLL_S reports progress (load, heartbeat) every STEP_POLL_S
# while it runs, for at most STEP_LIVENESS_S: a 2,048-token step of a 135M model
# takes seconds on 2 CPU cores, far past a 10 s probe budget; a deadlock still ends
# in silence. DPSERVE_VLLM_STEP_LIVENESS_S changes the bound.
STEP_POLL_S = 0.25
STEP_LIVENESS_S = float(os.environ.get("DPSERVE_VLLM_STEP_LIVENESS_S", "300"))


def _place(config: EngineConfig) -> bool:
    """Set the environment vLLM reads at import for this rank's devices and cores; True if on GPUs."""
    visible = visible_gpus()
    on_gpu = bool(visible) and config.device != "cpu"
    if on_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(local_devices(config.local_rank, config.tensor_parallel_size, visible))
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(config.local_rank))
    # In-process engine core: no busy-polling engine-core process beside the rank.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return on_gpu


def _checked_kwargs(config: EngineConfig, max_model_len: int, on_gpu: bool, engine_args_class: type) -> dict:
    """EngineArgs keyword arguments, refused (VllmConfigError) where vLLM would not take them."""
    kw = engine_args_kwargs(config, max_model_len, on_gpu, available_memory_bytes())
    if "disable_log_stats" in config.engine_args:
        raise VllmConfigError("--engine-arg disable_log_stats: dpserve's load reports are vLLM's scheduler stats; it cannot be set")
    # vLLM's CPU build lets VLLM_CPU_KVCACHE_SPACE (GiB) override kv_cache_memory_bytes:
    # --kv-cache-memory-bytes wins when given, else an operator's variable beats the auto budget.
    if not on_gpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        if config.kv_cache_memory_bytes:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        else:
            kw.pop("kv_cache_memory_bytes", None)
    known = {f.name for f in dataclasses.fields(engine_args_class)}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise VllmConfigError(f"vLLM's EngineArgs has no field {', '.join(unknown)} (--engine-arg KEY=VALUE takes EngineArgs fields)")
    return kw


def _stat_logger(base: type, core: VllmCore) -> type:
    """A vLLM StatLoggerBase subclass that hands the scheduler's view after every step
    (running, waiting, KV usage, preemptions, prefix-cache counts) to `core`."""

    class _Stats(base):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                core._stats = scheduler_stats
                prefix = getattr(scheduler_stats, "prefix_cache_stats", None)  # this step's, reset by vLLM
                if prefix is not None:
                    core._prefix_queries += prefix.queries
                    core._prefix_hits += prefix.hits
            if iteration_stats is not None:
                core._preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)

        def log_engine_initialized(self) -> None:
            pass

    return _Stats


class VllmCore:
    """vLLM's LLMEngine as a RankEngine (see engine/rank/process.py for the loop around it).

    Bookkeeping: `_reqs[request_id]` = [prompt tokens, max_tokens, tokens so
    far] for every request vLLM holds, so load reports (outstanding prompt and
    decode tokens) need no vLLM internals; running/waiting counts and KV usage
    come from the scheduler's stats of the last step.
    """

    # Called while a step runs (the engine process's load report and heartbeat, as
    # the native engine calls it after every layer): vLLM has no hook inside a
    # step, so the step runs on a worker thread and this thread calls it while
    # waiting, up to STEP_LIVENESS_S; a step stuck longer goes silent and the
    # rank is replaced. Sockets stay on this thread.
    on_progress: Callable[[], None] | None = None
    yield_check: Callable[[int], bool] | None = None  # never called: vLLM's steps do not give way

    def __init__(self, config: EngineConfig, log=None) -> None:
        problem = check_vllm_version(vllm_version())
        if problem:
            raise VllmConfigError(problem)
        self.config = config
        on_gpu = _place(config)
        try:
            # tokens_input: an already rendered token prompt (public in 0.31-0.33); a raw
            # TokensPrompt dict goes through the renderer path vLLM deprecates
            from vllm import EngineArgs, LLMEngine
            from vllm import SamplingParams as VSamplingParams
            from vllm.inputs import tokens_input
            from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
            from vllm.v1.metrics.loggers import StatLoggerBase
        except ImportError as exc:
            raise VllmConfigError(f"vLLM's public API is not where dpserve expects it ({exc}); {INSTALL_HINT}") from exc
        self._SamplingParams = VSamplingParams
        self._tokens_input = tokens_input
        self._Structured = StructuredOutputsParams
        self._delta = RequestOutputKind.DELTA
        self.max_model_len = resolve_max_model_len(config.model, config.max_model_len)
        kw = _checked_kwargs(config, self.max_model_len, on_gpu, EngineArgs)
        self._stats = None
        self._preemptions = 0
        self._prefix_queries = 0  # prompt tokens looked up in vLLM's prefix cache, cumulative
        self._prefix_hits = 0
        events = None
        if config.enable_prefix_caching is not False and "kv_events_config" not in kw:  # vLLM's own KV events (issue 29)
            from vllm.config import KVEventsConfig

            events = events_config(config.rank)
            kw["kv_events_config"] = KVEventsConfig(**events)
        try:
            args = EngineArgs(**kw)
        except (TypeError, ValueError) as exc:
            raise VllmConfigError(f"vLLM refused the engine arguments: {exc}") from exc
        self.engine = LLMEngine.from_engine_args(args, stat_loggers=[_stat_logger(StatLoggerBase, self)])
        vcfg = self.engine.vllm_config
        self.dtype = str(vcfg.model_config.dtype)
        cache = vcfg.cache_config
        self.block_size = cache.block_size
        self.kv_events = KVEventLog(self.block_size) if events else None  # what the rank's KVPublisher sends
        self._kv_sub = VllmKVEvents(events["endpoint"], self.kv_events) if events else None
        self.kv_capacity_tokens = (cache.num_gpu_blocks or 0) * self.block_size
        self.kv_bytes = int(cache.kv_cache_memory_bytes or kw.get("kv_cache_memory_bytes") or 0)
        self.vllm_version = vllm_version()
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="vllm-step")
        self._reqs: dict[str, list[int]] = {}
        self._prompt_ids: dict[str, list[int]] = {}  # only for requests with prompt logprobs
        self._k: dict[str, tuple[int, int, tuple]] = {}  # (logprobs, prompt_logprobs, logprob_token_ids) asked for, where either is
        self._unstarted_tokens = 0  # prompt tokens of requests without a first token yet
        self._remaining = 0  # answer tokens still to come, at most
        self._last_step_ms = 0.0
        self._paused: set[str] = set()  # ids in _reqs whose outputs are held, not sent
        self._held: dict[str, list[RequestOutput]] = {}
        self._released: list[RequestOutput] = []  # held outputs of resumed requests, for the next step()

    def describe(self) -> dict:
        return {
            "engine": "vllm",
            "vllm_version": self.vllm_version,
            "max_model_len": self.max_model_len,
            "dtype": self.dtype.removeprefix("torch."),
            "kv_cache_tokens": self.kv_capacity_tokens,
            "kv_cache_gib": round(self.kv_bytes / 2**30, 2),
        }

    # ------------------------------------------------------------ requests in

    def add_request(self, req: AddRequest) -> RequestOutput | None:
        """Queue `req`; or, if vLLM refuses it, its finishing error output. Never raises."""
        rid, p = req.request_id, req.params
        if rid in self._reqs:
            return RequestOutput(rid, [], finish_reason=FINISH_ERROR, error=f"duplicate request id {rid!r}")
        try:
            kw = sampling_kwargs(p, req.num_prior_outputs)
            if p.guided_grammar is not None:
                kw["structured_outputs"] = self._Structured(**structured_outputs_kwargs(p.guided_grammar))
            params = self._SamplingParams(**kw, output_kind=self._delta)
            self.engine.add_request(rid, self._tokens_input(list(req.prompt_token_ids)), params, arrival_time=req.arrival_time,
                                    priority=p.priority)
        except Exception as e:  # vLLM's validation (or anything else): this request fails alone
            # vLLM may have recorded the request before refusing it (0.32/0.33 do for some
            # checks): forget it there too, or it would count as unfinished for good.
            try:
                self.engine.abort_request([rid])
            except Exception:
                pass
            return RequestOutput(rid, [], finish_reason=FINISH_ERROR, error=f"invalid request: {e}")
        n = len(req.prompt_token_ids)
        self._reqs[rid] = [n, kw["max_tokens"], 0]
        if p.prompt_logprobs is not None:
            self._prompt_ids[rid] = list(req.prompt_token_ids)
        if p.logprobs is not None or p.prompt_logprobs is not None:
            self._k[rid] = (p.logprobs or 0, p.prompt_logprobs or 0, p.logprob_token_ids)
        self._unstarted_tokens += n
        self._remaining += kw["max_tokens"]
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._reqs]
        if ids:
            self.engine.abort_request(ids)
            for rid in ids:
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._paused.discard(rid)
        self._held.pop(rid, None)
        prompt, max_tokens, done = self._reqs.pop(rid)
        self._prompt_ids.pop(rid, None)
        self._k.pop(rid, None)
        if done == 0:
            self._unstarted_tokens -= prompt
        self._remaining -= max(0, max_tokens - done)

    # vLLM has no per-request pause. Emulated: a paused request's outputs are held here
    # (not sent), and vLLM is not stepped while every request it holds is paused; a
    # request that keeps running beside others is bounded by its max_tokens and ended
    # by the API server's --stream-write-timeout-s (an abort), as with the native engine.
    def pause_requests(self, request_ids: Iterable[str]) -> None:
        self._paused.update(rid for rid in request_ids if rid in self._reqs)

    def resume_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._paused.discard(rid)
            self._released += self._held.pop(rid, ())

    def has_unfinished(self) -> bool:
        return len(self._reqs) > len(self._paused) or bool(self._released)

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One vLLM step, its outputs as dpserve's. vLLM's own failures propagate:
        its engine is not usable after them, and the rank's death (announced to
        every API server) is how the requests in flight learn of it."""
        start = time.perf_counter()
        outputs, self._released = self._released, []
        if len(self._reqs) == len(self._paused):
            return outputs  # only resumed outputs to hand over: vLLM is not stepped
        for out in self._run_step(start):
            state = self._reqs.get(out.request_id)
            if state is None:
                continue  # aborted while the step ran
            held = self._held.get(out.request_id, []) if out.request_id in self._paused else None
            try:
                converted = self._convert(out, state)  # (a finish forgets the request, its held outputs with it)
                if held is not None and converted.finish_reason is None:
                    self._held.setdefault(out.request_id, held).append(converted)
                else:
                    outputs += [*(held or ()), converted]
            except Exception as e:  # a conversion problem fails this request, not the rank
                self.engine.abort_request([out.request_id])
                outputs.append(RequestOutput(out.request_id, [], finish_reason=FINISH_ERROR, error=f"engine output could not be read: {e!r}"))
                self._forget(out.request_id)
        self._last_step_ms = (time.perf_counter() - start) * 1000.0
        if self._kv_sub is not None:
            self._kv_sub.drain()  # what vLLM's publisher thread sent so far (this step's, or the last's)
        return outputs

    def kv_sync(self) -> None:
        """Before a snapshot: what vLLM's publisher sent so far, into the log (engine/kv_events.py)."""
        self._kv_sub.drain()

    def _run_step(self, start: float) -> list:
        """engine.step() on the worker thread; liveness from here while it runs."""
        future = self._stepper.submit(self.engine.step)
        try:
            return future.result(STEP_POLL_S)
        except FutureTimeout:
            pass
        while True:  # a long step (a big prefill chunk on a slow CPU): busy, not dead
            if self.on_progress is not None and time.perf_counter() - start < STEP_LIVENESS_S:
                self.on_progress()
            try:
                return future.result(STEP_POLL_S)
            except FutureTimeout:
                continue

    def _convert(self, out, state: list[int]) -> RequestOutput:
        rid = out.request_id
        choice = out.outputs[0] if out.outputs else None
        tokens = list(choice.token_ids) if choice is not None else []
        if tokens:
            if state[2] == 0:
                self._unstarted_tokens -= state[0]
            state[2] += len(tokens)
            self._remaining -= len(tokens)
        reason = choice.finish_reason if choice is not None else None
        stop_token = None
        if out.finished:
            if reason == "stop":
                stop = choice.stop_reason
                stop_token = stop if isinstance(stop, int) else None
                reason = FINISH_STOP
            elif reason == "length":
                reason = FINISH_LENGTH
            else:
                reason = FINISH_ERROR if reason is None else reason
        else:
            reason = None
        result = RequestOutput(rid, tokens, reason, stop_token)
        if tokens and state[2] == len(tokens):
            result.num_cached_tokens = out.num_cached_tokens or 0  # with the first token, as the native engine
        if reason == FINISH_ERROR:
            result.error = "vLLM ended the request without a reason"
        k, prompt_k, listed = self._k.get(rid, (0, 0, ()))
        if choice is not None and choice.logprobs and tokens:
            result.logprobs = [to_token_logprobs(t, entries, k, listed) for t, entries in zip(tokens, choice.logprobs[-len(tokens):])]
        if out.prompt_logprobs and rid in self._prompt_ids:
            ids = self._prompt_ids.pop(rid)
            result.prompt_logprobs = [to_token_logprobs(t, entries or {}, prompt_k) for t, entries in zip(ids[1:], out.prompt_logprobs[1:])]
        if reason is not None:
            self._forget(rid)
        return result

    # ------------------------------------------------------------ load

    @property
    def num_running(self) -> int:
        running = self._stats.num_running_reqs if self._stats is not None else 0
        return min(running, len(self._reqs))

    @property
    def num_waiting(self) -> int:
        return len(self._reqs) - self.num_running

    @property
    def num_waiting_prefill_tokens(self) -> int:
        return self._unstarted_tokens

    @property
    def num_remaining_decode_tokens(self) -> int:
        return self._remaining

    @property
    def slot_usage(self) -> float:
        return self.num_running / self.config.max_num_seqs

    @property
    def kv_usage(self) -> float:
        return float(self._stats.kv_cache_usage) if self._stats is not None else 0.0

    @property
    def num_preemptions(self) -> int:
        return self._preemptions

    @property
    def num_prefix_queries(self) -> int:
        return self._prefix_queries

    @property
    def num_prefix_hits(self) -> int:
        return self._prefix_hits

    @property
    def last_step_ms(self) -> float:
        return self._last_step_ms
