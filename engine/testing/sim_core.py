"""The simulated model of one rank (engine/testing/sim.py's ranks): a FIFO waiting
queue and up to `max_num_seqs` running sequences behind the RankEngine interface,
stepping at configured prefill and decode speeds. A TEST AND BENCHMARK TOOL: no
model, meaningless token ids; it must never import torch or transformers."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dpserve.engine.common.protocol import FINISH_LENGTH, FINISH_STOP, AddRequest, RequestOutput
from dpserve.engine.interface import QueueCounts

if TYPE_CHECKING:
    from dpserve.engine.testing.sim import SimConfig


class _Seq:
    __slots__ = ("request_id", "prefill_left", "max_tokens", "num_generated", "stop_ids", "first")

    def __init__(self, req: AddRequest) -> None:
        self.request_id = req.request_id
        self.prefill_left = len(req.prompt_token_ids)
        self.max_tokens = req.params.max_tokens
        # A continuation goes on where it left off: output i is a function of the
        # prompt's first id and i alone, so a moved answer equals an unmoved one.
        self.num_generated = req.num_prior_outputs
        self.stop_ids = set(req.params.stop_token_ids)
        self.first = req.prompt_token_ids[0] if req.prompt_token_ids else 0


class SimCore(QueueCounts):
    """The simulated model of one rank, behind the RankEngine interface.

    Invariant: `by_id` holds exactly the sequences in `waiting` and `running`;
    each gets exactly one finishing output unless aborted.
    """

    on_progress = None  # a simulated step is never long
    yield_check = None  # nor given way

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.by_id: dict[str, _Seq] = {}
        self.paused: set[str] = set()  # ids in by_id that step() skips (their clients stopped reading)
        self.load_round = 0  # with vary_load, the usage the load reports carry changes with it

    def describe(self) -> dict:
        return {"engine": "simulated", "max_num_seqs": self.cfg.max_num_seqs}

    def add_request(self, req: AddRequest) -> RequestOutput | None:
        seq = _Seq(req)
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            seq = self.by_id.pop(rid, None)
            self.paused.discard(rid)
            if seq is None:
                continue
            if seq in self.running:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)

    def pause_requests(self, request_ids: Iterable[str]) -> None:
        """A paused sequence gets no decode step (it keeps its place) until resumed."""
        self.paused.update(rid for rid in request_ids if rid in self.by_id)

    def resume_requests(self, request_ids: Iterable[str]) -> None:
        self.paused.difference_update(request_ids)

    def has_unfinished(self) -> bool:
        return len(self.by_id) > len(self.paused)

    def step(self) -> list[RequestOutput]:
        """One simulated scheduler step: prefill within the budget, one token per running sequence."""
        cfg = self.cfg
        outs: list[RequestOutput] = []
        tokens = cfg.token_ids
        # 1. Decode: every sequence that already had its first token gets one more.
        still: list[_Seq] = []
        for seq in self.running:
            if seq.request_id in self.paused:
                still.append(seq)
                continue
            self._emit(seq, tokens[(seq.first + seq.num_generated) % len(tokens)], outs, still)
        self.running = still
        # 2. Prefill: FIFO within the token budget; a finished prefill yields the first token.
        budget = cfg.prefill_tokens_per_s * cfg.decode_step_ms / 1000
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            used = min(budget, seq.prefill_left)
            seq.prefill_left -= used
            budget -= used
            if seq.prefill_left > 0:
                break
            self.waiting.popleft()
            self._emit(seq, tokens[(seq.first + seq.num_generated) % len(tokens)], outs, self.running)
        return outs

    def _emit(self, seq: _Seq, token: int, outs: list[RequestOutput], keep: list[_Seq]) -> None:
        seq.num_generated += 1
        if token in seq.stop_ids:
            outs.append(RequestOutput(seq.request_id, [token], FINISH_STOP, stop_token_id=token))
        elif seq.num_generated >= seq.max_tokens:
            outs.append(RequestOutput(seq.request_id, [token], FINISH_LENGTH))
        else:
            keep.append(seq)
            outs.append(RequestOutput(seq.request_id, [token]))
            return
        del self.by_id[seq.request_id]
        self.paused.discard(seq.request_id)  # (one paused before its first token still prefills)

    # The load, as RankIO reports it.
    @property
    def num_waiting_prefill_tokens(self) -> int:
        return int(sum(s.prefill_left for s in self.waiting))

    @property
    def num_remaining_decode_tokens(self) -> int:
        """Tokens the running sequences may still produce (waiting ones are not counted)."""
        return sum(s.max_tokens - s.num_generated for s in self.running)

    @property
    def slot_usage(self) -> float:
        if self.cfg.vary_load:
            return (self.load_round % 100) / 100
        return len(self.running) / self.cfg.max_num_seqs

    @property
    def kv_usage(self) -> float:
        return self.slot_usage

    @property
    def last_step_ms(self) -> float:
        return self.cfg.decode_step_ms if self.running else 0.0

    num_preemptions = num_prefix_queries = num_prefix_hits = 0
