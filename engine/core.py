"""The engine core of one rank: requests in, one batched step at a time, tokens out.

Owns every request from add_request until its finishing RequestOutput (or
its abort). It must never do IO (sockets, zmq, network) and never import
dpserve.daemons: the engine process loop around it moves the bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch

from .config import EngineConfig, resolve_max_model_len
from .loader import LoadedModel, load_model
from .model_runner import ModelRunner
from .protocol import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    AddRequest,
    RequestOutput,
)
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import Sequence


class EngineCore:
    """Continuous batching over a local Hugging Face causal LM.

    Who owns a request: from add_request it sits in the scheduler's waiting
    queue; once admitted it owns one row of the running batch; it is
    forgotten the moment its finishing output is returned by step() (or it
    is aborted). `_requests` holds exactly the waiting and running ones.

    Outputs: step() returns one RequestOutput per request that got a token.
    A request stopped by a token includes that token as the last of
    new_token_ids, whether it is one of its stop_token_ids (finish_reason
    "stop", stop_token_id set to it) or an EOS id (finish_reason "stop",
    stop_token_id None); the API server decides whether to show it.
    """

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
        # From the config, not `loaded`, so engines sharing one loaded model may differ.
        self.max_model_len: int = resolve_max_model_len(loaded.model_dir, config.max_model_len)
        self.eos_token_ids: frozenset[int] = loaded.eos_token_ids
        self.vocab_size = loaded.vocab_size
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(loaded)
        generator = torch.Generator(device=loaded.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(loaded.eos_token_ids, generator)
        self._requests: dict[str, Sequence] = {}
        self._last_step_ms = 0.0

    # ------------------------------------------------------------ requests in

    def add_request(self, req: AddRequest) -> RequestOutput | None:
        """Queue `req`; or, if it can never run, return its finishing error output.

        Never raises for a bad request. A duplicate id is refused with an
        error output carrying that id; the request already running under it
        is not affected.
        """
        try:
            error = self._validate(req)
            if error is None:
                seq = Sequence(req.request_id, req.prompt_token_ids, req.params, req.arrival_time, self.device)
        except Exception as e:  # a malformed request fails alone, never the engine loop
            error = f"invalid request: {e!r}"
        if error is not None:
            return RequestOutput(req.request_id, [], finish_reason=FINISH_ERROR, error=error)
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return None

    def _validate(self, req: AddRequest) -> str | None:
        prompt, p = req.prompt_token_ids, req.params
        if req.request_id in self._requests:
            return f"duplicate request id {req.request_id!r}: a request with this id is still running"
        if not prompt:
            return "the prompt is empty: at least one token is needed"
        if p.max_tokens < 1:
            return f"max_tokens must be at least 1, got {p.max_tokens}"
        if len(prompt) + p.max_tokens > self.max_model_len:
            return (
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"({len(prompt)} tokens) plus max_tokens ({p.max_tokens}) needs {len(prompt) + p.max_tokens}"
            )
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            return f"prompt token id {bad} is out of range for the vocabulary of size {self.vocab_size}"
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            return f"temperature must be a finite number >= 0, got {p.temperature}"
        if not (0.0 < p.top_p <= 1.0):
            return f"top_p must be in (0, 1], got {p.top_p}"
        if p.top_k < -1:
            return f"top_k must be -1, 0 (disabled) or positive, got {p.top_k}"
        if not (0 <= p.min_tokens <= p.max_tokens):
            return f"min_tokens must be between 0 and max_tokens ({p.max_tokens}), got {p.min_tokens}"
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Forget these requests now, freeing their slots and KV rows; unknown ids are ignored."""
        leaving = {rid for rid in request_ids if rid in self._requests}
        if not leaving:
            return
        self.scheduler.remove_waiting(leaving)
        self.runner.keep_rows(self.scheduler.remove_running(leaving))
        for rid in leaving:
            del self._requests[rid]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One engine iteration: every running request gains exactly one token."""
        if not self.scheduler.has_unfinished:
            return []
        start = time.perf_counter()

        # 1. Schedule: admit from the waiting queue and prefill the newcomers,
        #    one forward per group of similar lengths; their first token comes
        #    from these logits.
        num_decoding = self.scheduler.num_running
        groups = self.scheduler.admit()
        prefills = [self.runner.prefill([seq.prompt_token_ids for seq in group]) for group in groups]

        # 2. Run: one decode forward over the sequences that were already
        #    running, then the newcomers join the batch behind them, group by
        #    group, so the logits rows below line up with scheduler.running.
        running = self.scheduler.running
        logits = []
        if num_decoding:
            logits.append(self.runner.decode([seq.last_token_id for seq in running[:num_decoding]]))
        if prefills:
            self.runner.append(*(kv for _, kv in prefills))
            logits.extend(group_logits for group_logits, _ in prefills)
        tokens = self.sampler(torch.cat(logits) if len(logits) > 1 else logits[0], running)

        # 3. Postprocess: record tokens, finish requests, free their rows; then let
        #    the runner regroup its length buckets, and follow its new row order.
        outputs = self._postprocess(running, tokens)
        perm = self.runner.consolidate()
        if perm is not None:
            self.scheduler.reorder_running(perm)
        self._last_step_ms = (time.perf_counter() - start) * 1000.0
        return outputs

    def _postprocess(self, running: list[Sequence], tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        leaving: set[str] = set()
        for seq, token in zip(running, tokens):
            seq.output_token_ids.append(token)
            finish_reason, stop_token_id = self._check_finish(seq, token)
            outputs.append(RequestOutput(seq.request_id, [token], finish_reason, stop_token_id))
            if finish_reason is not None:
                leaving.add(seq.request_id)
        if leaving:
            self.runner.keep_rows(self.scheduler.remove_running(leaving))
            for rid in leaving:
                del self._requests[rid]
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

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_waiting_prefill_tokens(self) -> int:
        return self.scheduler.num_waiting_prefill_tokens

    @property
    def num_remaining_decode_tokens(self) -> int:
        return self.scheduler.num_remaining_decode_tokens

    @property
    def slot_usage(self) -> float:
        return self.scheduler.slot_usage

    @property
    def last_step_ms(self) -> float:
        """Wall time of the last step that did work, in milliseconds."""
        return self._last_step_ms
