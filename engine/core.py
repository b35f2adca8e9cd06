"""The engine core of one rank: requests in, one batched step at a time, tokens out.

Owns every request from add_request until its finishing RequestOutput (or
its abort). It must never do IO (sockets, zmq, network) and never import
dpserve.daemons: the engine process loop around it moves the bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from operator import attrgetter

import torch
from dpserve.engine.common.config import DEFAULT_BLOCK_SIZE, EngineConfig, resolve_max_model_len, resolve_token_budget
from dpserve.engine.common.grammar_limits import MAX_GRAMMAR_BYTES
from dpserve.engine.common.protocol import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    AddRequest,
    RequestOutput,
    TokenLogprobs,
)
from dpserve.engine.compiled import use_compiled_decode
from dpserve.engine.grammar import GrammarCompiler
from dpserve.engine.kv_cache import BlockManager, KVCache, plan_num_blocks
from dpserve.engine.kv_events import KVEventLog
from dpserve.engine.loader import LoadedModel, kv_shape, load_model
from dpserve.engine.logits_processors import token_logprobs
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.pausing import PausedRequests
from dpserve.engine.sampler import Sampler
from dpserve.engine.scheduler import Scheduler
from dpserve.engine.sequence import Sequence
from dpserve.engine.step_yield import GivingWay, StepYielded

MAX_INT32 = 2**31 - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries


class EngineCore:
    """Continuous batching with chunked prefill over a paged KV cache, for a local Hugging Face causal LM.

    Who owns a request: from add_request it sits in the scheduler's waiting
    queue; once admitted it is running and owns KV blocks (until preempted,
    when it waits again at the head of the queue, owning none); it is
    forgotten the moment its finishing output is returned by step() (or it
    is aborted). `_requests` holds exactly the waiting, running and parked
    ones (paused while waiting: engine/pausing.py), and the guided ones whose
    grammar is still compiling (`_compiling`, in no queue, owning nothing).

    Outputs: step() returns one RequestOutput per request that got a token.
    A request stopped by a token includes that token as the last of
    new_token_ids, whether it is one of its stop_token_ids (finish_reason
    "stop", stop_token_id set to it) or an EOS id (finish_reason "stop",
    stop_token_id None); the API server decides whether to show it.
    """

    on_progress: Callable[[], None] | None = None  # called from inside long steps (liveness)
    # Called from inside a step with its most urgent priority: True when a more urgent request
    # arrived (the rank loop peeks at its sockets), and the step gives way (priority policy only).
    yield_check: Callable[[int], bool] | None = None

    def __init__(self, config: EngineConfig) -> None:
        self._setup(config, load_model(config))

    @classmethod
    def from_loaded(cls, config: EngineConfig, loaded: LoadedModel) -> EngineCore:
        """An engine on an already loaded model (tests share one model between engines)."""
        engine = cls.__new__(cls)
        engine._setup(config, loaded)
        return engine

    def _setup(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.device = loaded.device
        self.dtype = loaded.dtype
        # From the config, not `loaded`, so engines sharing one loaded model may differ.
        self.max_model_len: int = resolve_max_model_len(loaded.model_dir, config.max_model_len)
        self.eos_token_ids: frozenset[int] = loaded.eos_token_ids
        self.vocab_size = loaded.vocab_size
        shape = kv_shape(loaded)
        block_size = config.block_size or DEFAULT_BLOCK_SIZE
        num_blocks = plan_num_blocks(
            shape,
            loaded.device,
            block_size=block_size,
            budget_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            num_local_ranks=config.num_local_ranks,
            max_useful_tokens=config.max_num_seqs * (self.max_model_len + block_size),
        )
        self.kv = KVCache(shape, num_blocks, block_size, loaded.device)
        caching = config.enable_prefix_caching is not False  # prefix caching: on unless turned off, as in vLLM
        self.kv_events = KVEventLog(block_size) if caching else None  # for the routers (engine/kv_events.py)
        self.blocks = BlockManager(num_blocks, block_size, enable_caching=caching, events=self.kv_events)
        self.kv_capacity_tokens = num_blocks * block_size
        budget, threshold = resolve_token_budget(config, loaded.device)
        self.scheduler = Scheduler(
            config.max_num_seqs,
            budget,
            self.blocks,
            long_prefill_token_threshold=threshold,
            chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
        )
        self.runner = ModelRunner(loaded, self.kv)
        if use_compiled_decode(config.enforce_eager, loaded):  # compiled (or loaded from its cache) before ready
            self.runner.enable_compiled_decode(config.max_num_seqs)
        generator = torch.Generator(device=loaded.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(loaded.eos_token_ids, generator)
        self._requests: dict[str, Sequence] = {}
        self.paused = PausedRequests(self.scheduler)
        self._last_step_ms = 0.0
        self.on_progress = None
        self.yield_check = None
        self.num_step_errors = 0
        self.giving_way = GivingWay(shape.num_layers)  # priority policy: a step may give way to a more urgent request
        # Grammars compile on a worker (engine/grammar.py): on the loop they cost heartbeats and
        # lost ranks. A guided request waits in `_compiling`, in no queue, until its matcher is ready.
        self.grammars = GrammarCompiler(config.model, self.vocab_size, self.eos_token_ids)
        self._compiling: dict[str, tuple[Sequence, Future]] = {}

    def describe(self) -> dict:
        """What the engine process logs once the model is loaded."""
        return {
            "engine": "native",
            "max_model_len": self.max_model_len,
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_tokens": self.kv_capacity_tokens,
            "kv_cache_gib": round(self.kv.num_bytes / 2**30, 2),
            "prefix_caching": self.blocks.enable_caching,
            "compiled_decode_s": round(self.runner.compiled.warm_s, 1) if self.runner.compiled else None,
        }

    # ------------------------------------------------------------ requests in

    def add_request(self, req: AddRequest) -> RequestOutput | None:
        """Queue `req`; or, if it can never run, return its finishing error output.

        Never raises for a bad request. A duplicate id is refused with an
        error output carrying that id; the request already running under it
        is not affected.
        """
        compiling = None
        try:
            error = self._validate(req)
            if error is None:
                seq = Sequence(req.request_id, req.prompt_token_ids, req.params, req.arrival_time, self.device,
                               req.num_prior_outputs)
                if req.params.guided_grammar is not None:
                    compiling = self.grammars.submit(req.params.guided_grammar)
        except Exception as e:  # a malformed request fails alone, never the engine loop
            error = f"invalid request: {e!r}"
        if error is not None:
            return RequestOutput(req.request_id, [], finish_reason=FINISH_ERROR, error=error)
        self._requests[seq.request_id] = seq
        if compiling is not None:
            self._compiling[seq.request_id] = (seq, compiling)
        else:
            self.scheduler.add(seq)
        return None

    def _validate(self, req: AddRequest) -> str | None:
        p, prior = req.params, req.num_prior_outputs
        prompt = req.prompt_token_ids[: len(req.prompt_token_ids) - prior] if prior > 0 else req.prompt_token_ids
        if req.request_id in self._requests:
            return f"duplicate request id {req.request_id!r}: a request with this id is still running"
        if not prompt:
            return "the prompt is empty: at least one token is needed"
        if not (1 <= p.max_tokens <= self.max_model_len) or not (0 <= prior < p.max_tokens):
            return f"max_tokens must be between 1 and {self.max_model_len} and above the {prior} prior outputs, got {p.max_tokens}"
        if len(prompt) + p.max_tokens > self.max_model_len:
            return (
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"({len(prompt)} tokens) plus max_tokens ({p.max_tokens}) needs {len(prompt) + p.max_tokens}"
            )
        if len(prompt) + p.max_tokens > self.kv_capacity_tokens:
            return (
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({p.max_tokens}) can never fit this rank's KV "
                f"cache of {self.kv_capacity_tokens} tokens (raise --kv-cache-memory-bytes or lower max_tokens)"
            )
        low, high = min(req.prompt_token_ids), max(req.prompt_token_ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            return f"prompt token id {bad} is out of range for the vocabulary of size {self.vocab_size}"
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            return f"temperature must be a finite number >= 0, got {p.temperature}"
        if not (0.0 < p.top_p <= 1.0):
            return f"top_p must be in (0, 1], got {p.top_p}"
        if not (-1 <= p.top_k <= MAX_INT32):
            return f"top_k must be -1, 0 (disabled) or a positive number up to {MAX_INT32}, got {p.top_k}"
        if not (0 <= p.min_tokens <= p.max_tokens):
            return f"min_tokens must be between 0 and max_tokens ({p.max_tokens}), got {p.min_tokens}"
        if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not (0 <= t <= MAX_INT32) for t in p.stop_token_ids):
            return f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, each between 0 and {MAX_INT32}"
        return self._validate_processors(p)

    def _validate_processors(self, p) -> str | None:
        """The sampling parameters beyond temperature/top-p/top-k, re-checked: the API server bounds them, but no
        value may ever reach the sampler that it cannot hold."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(p, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                return f"{name} must be between -2 and 2, got {value}"
        if not (math.isfinite(p.repetition_penalty) and 0.0 < p.repetition_penalty <= 100.0):
            return f"repetition_penalty must be in (0, 100], got {p.repetition_penalty}"
        if not (0.0 <= p.min_p <= 1.0):
            return f"min_p must be in [0, 1], got {p.min_p}"
        if len(p.logit_bias) > MAX_LOGIT_BIAS:
            return f"logit_bias takes at most {MAX_LOGIT_BIAS} entries"
        for token, bias in p.logit_bias:
            if not (0 <= token < self.vocab_size):
                return f"logit_bias token id {token} is out of range for the vocabulary of size {self.vocab_size}"
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                return f"logit_bias values must be between -100 and 100, got {bias}"
        if p.guided_grammar is not None and len(p.guided_grammar) > MAX_GRAMMAR_BYTES:
            return f"guided_grammar takes at most {MAX_GRAMMAR_BYTES} bytes"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(p, name)
            if value is not None and not (0 <= value <= self.vocab_size):  # the API server applies --max-logprobs
                return f"{name} must be between 0 and the vocabulary size {self.vocab_size}, got {value}"
        if len(p.logprob_token_ids) > self.vocab_size or any(not (0 <= t < self.vocab_size) for t in p.logprob_token_ids):
            return f"logprob_token_ids must be at most {self.vocab_size} ids of the vocabulary"
        return None

    def _admit_compiled(self) -> list[RequestOutput]:
        """Guided requests whose grammar compiled join the waiting queue with their own matcher; a grammar
        that failed fails its request. With nothing else to step, waits a few ms for a compile (no spin)."""
        ready, failed = self.grammars.take_ready(self._compiling, wait_s=0.0 if self.paused.has_work else 0.005)
        for seq in ready:
            self.scheduler.add(seq)
        for rid, _ in failed:
            del self._requests[rid]
        return [RequestOutput(rid, [], finish_reason=FINISH_ERROR, error=error) for rid, error in failed]

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Forget these requests now, freeing their slots and KV blocks; unknown ids are ignored."""
        leaving = {rid for rid in request_ids if rid in self._requests}
        if not leaving:
            return
        self.scheduler.remove(leaving)
        self.paused.forget(leaving)
        for rid in leaving:
            del self._requests[rid]
            self._compiling.pop(rid, None)

    def pause_requests(self, request_ids: Iterable[str]) -> None:
        """Stop stepping these requests until resumed (their client stopped reading); see engine/pausing.py."""
        self.paused.pause(request_ids, self._requests)

    def resume_requests(self, request_ids: Iterable[str]) -> None:
        self.paused.resume(request_ids)

    def has_unfinished(self) -> bool:
        """Whether step() has work: paused sequences alone are none (the loop may sleep)."""
        return self.paused.has_work or bool(self._compiling)

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule -> run -> sample -> postprocess.

        Every decoding request gains one token; prompts advance by a chunk,
        and one whose last chunk ran gets its first token. A failure inside
        the step fails the requests of this step, never the engine.
        """
        if self._compiling:  # 0. Guided requests whose grammar compiled join the queue.
            failed = self._admit_compiled()
            if failed:
                return failed  # the rest steps on the next call
        if not self.scheduler.has_unfinished:
            return []
        start = time.perf_counter()
        # 1. Schedule: who runs, how many tokens each; blocks are allocated. A paused
        # sequence that preemption sent back to the queue is parked first.
        self.paused.park_preempted()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        # 2. Run: one packed forward over every scheduled token.
        try:
            on_layer = self.giving_way.hook(scheduled, self.on_progress, self.yield_check, self.scheduler)
            logits, sampled = self.runner.execute(scheduled, on_layer)
        except StepYielded:  # dropped whole, redone after the urgent one's (step_yield.py)
            self.giving_way.gave_way(time.perf_counter() - start)
            return []
        except Exception as e:  # never the engine: the step's requests fail, the rank serves on
            self.num_step_errors += 1
            return self._fail([seq for seq, _ in scheduled], f"the engine could not run this request: {e!r}")
        self.giving_way.ran(self.scheduler.was_isolated, time.perf_counter() - start)
        for seq, n in scheduled:
            seq.num_computed_tokens += n
        self.scheduler.cache_computed_blocks(scheduled)
        # 3. Sample and postprocess.
        outputs: list[RequestOutput] = []
        if self.runner.last_prompt_logits:
            failed = self._score_prompts(self.runner.last_prompt_logits)
            if failed:
                outputs = self._fail(failed, "computing prompt logprobs failed for this request")
                rows = [i for i, s in enumerate(sampled) if s not in failed]
                sampled = [sampled[i] for i in rows]
                logits = logits[rows] if sampled else logits
        if sampled:
            tokens, logprobs, errors = self._sample(logits, sampled)
            outputs += self._postprocess(sampled, tokens, logprobs, errors)
        self._last_step_ms = (time.perf_counter() - start) * 1000.0
        return outputs

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int | None], list[TokenLogprobs | None] | None, dict[int, str]]:
        """One token (and logprobs, if asked) per row; a row whose sampling raises gets None and an error instead."""
        try:
            tokens, logprobs = self.sampler(logits, seqs)
            return tokens, logprobs, {}
        except Exception:
            pass
        tokens: list[int | None] = []
        logprobs: list[TokenLogprobs | None] = []
        errors: dict[int, str] = {}
        for i, seq in enumerate(seqs):
            try:
                token, row_logprobs = self.sampler(logits[i : i + 1], [seq])
                tokens.extend(token)
                logprobs.append(row_logprobs[0] if row_logprobs else None)
            except Exception as e:
                tokens.append(None)
                logprobs.append(None)
                errors[i] = f"sampling failed for this request: {e!r}"
        return tokens, logprobs, errors

    def _score_prompts(self, chunks: list[tuple[Sequence, int, torch.Tensor]]) -> list[Sequence]:
        """Append prompt logprobs for the positions these chunks ran (raw logits, as
        vLLM's prompt logprobs); returns the sequences for which that failed."""
        failed = []
        for seq, first, logits in chunks:
            try:
                done = len(seq.prompt_logprobs)
                skip = done - first  # positions already scored (a preempted sequence recomputes)
                if skip >= logits.shape[0]:
                    continue
                targets = seq.token_ids[first + 1 + max(skip, 0) : first + 1 + logits.shape[0]]
                rows = logits[max(skip, 0) :]
                k = seq.params.prompt_logprobs
                seq.prompt_logprobs.extend(token_logprobs(rows, targets, [k] * len(targets)))
            except Exception:
                failed.append(seq)
        return failed

    def _fail(self, seqs: list[Sequence], error: str) -> list[RequestOutput]:
        self.scheduler.remove({s.request_id for s in seqs})
        for seq in seqs:
            self._requests.pop(seq.request_id, None)
        return [RequestOutput(seq.request_id, [], finish_reason=FINISH_ERROR, error=error) for seq in seqs]

    def _postprocess(
        self,
        seqs: list[Sequence],
        tokens: list[int | None],
        logprobs: list[TokenLogprobs | None] | None,
        errors: dict[int, str],
    ) -> list[RequestOutput]:
        outputs = []
        done: list[Sequence] = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if token is None:
                outputs.append(RequestOutput(seq.request_id, [], finish_reason=FINISH_ERROR, error=errors[i]))
                done.append(seq)
                continue
            seq.token_ids.append(token)
            finish_reason, stop_token_id = self._check_finish(seq, token)
            error = None
            if seq.matcher is not None and finish_reason is None:
                # The grammar is complete (nothing may follow): the answer ends here. A
                # broken one fails the request: output past it may violate the constraint.
                seq.matcher.consume_token(token)
                if seq.matcher.is_error():
                    finish_reason, error = FINISH_ERROR, f"the grammar could not be followed: {seq.matcher.get_error()[:400]}"
                elif seq.matcher.is_stopped():
                    finish_reason = FINISH_STOP
            out = RequestOutput(seq.request_id, [] if error else [token], finish_reason, stop_token_id, error=error)
            if logprobs is not None and logprobs[i] is not None:
                out.logprobs = [logprobs[i]]
            if seq.num_output_tokens == 1:
                out.num_cached_tokens = max(0, seq.num_cached_tokens)
                out.queue_s = max(0.0, seq.t_scheduled - seq.t_received)
                if seq.prompt_logprobs is not None:
                    out.prompt_logprobs = seq.prompt_logprobs
            outputs.append(out)
            if finish_reason is not None:
                done.append(seq)
        if done:
            self.scheduler.finish(done)
            for seq in done:
                del self._requests[seq.request_id]
        return outputs

    def _check_finish(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """(finish_reason, stop_token_id) after `token` was appended to `seq`."""
        p = seq.params
        # The sampler forbids stop tokens before min_tokens; checking again keeps
        # the rule true even for ids it could not mask.
        may_stop = seq.num_output_tokens > p.min_tokens
        if may_stop and token in p.stop_token_ids:
            return FINISH_STOP, token
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            return FINISH_STOP, None
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FINISH_LENGTH, None
        return None, None

    # ------------------------------------------------------------ load

    # the scheduler's, as RankEngine reads them
    num_running = property(attrgetter("scheduler.num_running"))
    num_waiting = property(attrgetter("scheduler.num_waiting"))
    num_waiting_prefill_tokens = property(attrgetter("scheduler.num_waiting_prefill_tokens"))
    num_remaining_decode_tokens = property(attrgetter("scheduler.num_remaining_decode_tokens"))
    slot_usage = property(attrgetter("scheduler.slot_usage"))
    kv_usage = property(attrgetter("scheduler.kv_usage"), doc="Fraction of the rank's KV blocks in use (vLLM's kv_cache_usage_perc).")
    num_preemptions = property(attrgetter("scheduler.num_preemptions"))
    num_prefix_queries = property(attrgetter("scheduler.num_prefix_queries"),
                                  doc="Cumulative prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).")
    num_prefix_hits = property(attrgetter("scheduler.num_prefix_hits"), doc="Cumulative tokens of those found cached (vLLM's prefix_cache_hits).")

    @property
    def last_step_ms(self) -> float:
        """Wall time of the last step that did work, in milliseconds."""
        return self._last_step_ms
