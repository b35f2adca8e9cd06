"""Decides what runs in each step: which sequences, how many tokens each, and who is preempted.

Owns the waiting queue, the running list, the per-step token budget and the
calls into the block manager. It must never touch tensors: the model runner
turns a schedule into a forward.
"""

from __future__ import annotations

import math
import os
import time
from bisect import bisect_right
from collections import deque

from dpserve.engine.common.config import SCHEDULING_POLICIES
from dpserve.engine.interface import QueueCounts
from dpserve.engine.kv_cache import BlockManager
from dpserve.engine.sequence import Sequence, SequenceStatus

# Admission keeps this share of the KV blocks free for the running sequences
# to decode into, so a newcomer is not admitted only to be preempted at once.
ADMIT_WATERMARK = 0.01
POLICIES = SCHEDULING_POLICIES  # vLLM's --scheduling-policy: fcfs, or priority (lower `priority` first, then arrival)
# Priority policy: a waiting request more urgent than some running one gets the next step without
# the less urgent ones (issue 28; DPSERVE_ISOLATE_URGENT=0 turns it off, for benchmarks' A/B).
ISOLATE_URGENT = os.environ.get("DPSERVE_ISOLATE_URGENT", "1") != "0"
# Urgent steps in a row at most (then a plain one: the less urgent always advance); 1: the rule before 2026-12-05.
URGENT_IN_A_ROW = max(1, int(os.environ.get("DPSERVE_URGENT_IN_A_ROW", "2")))
# An urgent step also when the most urgent waiting request is more urgent than other waiting ones, none running
# less urgent (a flood's onset into free places); DPSERVE_URGENT_OVER_WAITING=0: only over running ones (before 2026-12-05).
URGENT_OVER_WAITING = os.environ.get("DPSERVE_URGENT_OVER_WAITING", "1") != "0"
# Among equal priorities, preempt one past its first token first (DPSERVE_STARTED_FIRST=0: vLLM's latest first).
STARTED_FIRST = os.environ.get("DPSERVE_STARTED_FIRST", "1") != "0"


def _order(seq: Sequence) -> tuple[int, float]:
    """A sequence's place under the priority policy (vLLM's (priority, arrival_time))."""
    return seq.params.priority, seq.arrival_time


def _victim_order(seq: Sequence) -> tuple[int, bool, float]:
    """Priority policy's preemption order, the greatest preempted first: the least urgent, then
    among equals one that already has its first token (preempting it delays its next tokens;
    preempting one still in its prefill delays its first, which a fair share promises soonest:
    issue 28), then the latest. vLLM takes the least urgent, then the latest."""
    return seq.params.priority, STARTED_FIRST and seq.num_output_tokens > 0, seq.arrival_time


class Scheduler(QueueCounts):
    """Chunked prefill under a token budget, paged KV admission, preemption by recompute.

    Invariants: `waiting` holds WAITING sequences; under fcfs a preempted one
    ahead of every newcomer, otherwise in arrival order; under the priority
    policy sorted by (priority, arrival_time), preempted ones included, equal
    keys in the order they were added. `running` holds RUNNING sequences in
    admission order (the oldest first), each owning the blocks of its
    block_table; a request id is in at most one of them.

    A step (schedule()) gives, in this order and within max_num_batched_tokens:
    1. every running sequence that decodes one token (they never starve
       behind a long prompt);
    2. running sequences still prefilling a chunk each, oldest first;
    3. waiting sequences, in order, while a slot, budget and blocks remain.
    While any sequence decodes in the step, a prefill chunk is at most
    long_prefill_token_threshold tokens, so one long prompt cannot stall the
    streams beside it; alone, a prompt takes the whole budget. When a running
    sequence needs a block and none is free, the most recently admitted
    sequence is preempted: its blocks are freed and it waits at the head of
    the queue to be recomputed from its prompt and outputs so far.

    Priority policy (vLLM's): the victim of a running sequence's block shortage
    is the running sequence last in (priority, arrival_time) order (among equal
    priorities, one past its first token before one in its prefill); prefill
    chunks go in that order; and a waiting sequence that finds no slot or not
    enough blocks preempts running ones of a strictly lower priority (larger
    number), last first, when that makes room (vLLM v0's priority preemption:
    a waiting request never displaces one of its own priority, so there is no
    ping-pong). Urgent steps: when the most urgent waiting sequence is more
    urgent than some running one (or, none such running, than some waiting
    one), that step leaves out the running sequences
    less urgent than it (they keep their slots and blocks) and admits no
    waiting one less urgent than it, so its prefill neither waits behind nor
    shares a step with bulk work; at most two such steps in a row (one for a
    request that came during the first: it no longer waits for a whole bulk
    step; see _urgent for the second's guard), so the bulk runs at least
    every third step.

    Prefix caching (when the block manager has it on): on admission a
    sequence attaches the cached blocks that hold the leading full blocks of
    its tokens and starts computing after them, never past its last token
    (a step must compute it to produce logits). A sequence that wants prompt
    logprobs attaches nothing (it needs every position's logits) but still
    registers its blocks. After every step, cache_computed_blocks registers
    the blocks that filled (engine.core calls it). A preempted sequence
    re-admitted later finds whatever of its own blocks survived eviction.
    One prompt computation: a waiting sequence whose next uncached block a
    running prefill is computing right now (same key) is held in place, and
    later sequences may pass it, until that block is cached; so n copies of a
    prompt (or concurrent requests sharing a prefix) compute it once.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        blocks: BlockManager,
        long_prefill_token_threshold: int = 0,
        chunked_prefill: bool = True,
        policy: str = "fcfs",
        isolate_urgent: bool = ISOLATE_URGENT,
        urgent_in_a_row: int = URGENT_IN_A_ROW,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.is_priority = policy == "priority"
        self.isolate_urgent = isolate_urgent and self.is_priority
        self.urgent_in_a_row = urgent_in_a_row
        self._isolated_run = 0  # urgent steps since the last plain one
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # vLLM's prefix-cache counters, in tokens: looked up at admission, and found cached.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # Waiting sequences have nothing computed (preemption resets them), so
        # their prefill work is their whole length: kept as a running total,
        # read with every load report, whatever the queue's length.
        self._num_waiting_tokens = 0
        self._watermark = int(blocks.num_blocks * ADMIT_WATERMARK)
        # Running sequences not to step (their client stopped reading); the engine core
        # keeps it, and keeps paused sequences out of `waiting`.
        self.paused: set[str] = set()

    # ------------------------------------------------------------ counters

    @property
    def num_waiting_prefill_tokens(self) -> int:
        """Tokens still to prefill: the waiting queue's and running sequences' unfinished prompts."""
        return self._num_waiting_tokens + sum(s.num_uncomputed_tokens for s in self.running if s.is_prefilling)

    @property
    def num_remaining_decode_tokens(self) -> int:
        return sum(seq.num_remaining_tokens for seq in self.running)

    @property
    def slot_usage(self) -> float:
        return len(self.running) / self.max_num_seqs

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.is_priority:
            self.waiting.insert(bisect_right(self.waiting, _order(seq), key=_order), seq)
        else:
            self.waiting.append(seq)
        self._num_waiting_tokens += seq.num_tokens

    def remove(self, leaving: set[str]) -> None:
        """Forget these sequences wherever they are, freeing their blocks."""
        if any(s.request_id in leaving for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not self._drop(s, leaving))
            self._num_waiting_tokens = sum(s.num_tokens for s in self.waiting)
        if any(s.request_id in leaving for s in self.running):
            self.running = [s for s in self.running if not self._drop(s, leaving)]

    def _drop(self, seq: Sequence, leaving: set[str]) -> bool:
        if seq.request_id not in leaving:
            return False
        self.blocks.release(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        return True

    # ------------------------------------------------------------ the schedule

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's (sequence, new tokens) pairs; block tables already cover them."""
        scheduled: dict[str, tuple[Sequence, int]] = {}
        urgent = self._urgent()
        preempted, decoding, prefilling = self._schedule_running(scheduled, urgent)
        if not preempted:
            self._schedule_waiting(scheduled, decoding, prefilling, urgent)
        isolated = urgent < math.inf
        if isolated and not scheduled:  # (the urgent one did not fit after all: a plain step)
            isolated = False
            preempted, decoding, prefilling = self._schedule_running(scheduled, math.inf)
            if not preempted:
                self._schedule_waiting(scheduled, decoding, prefilling)
        self._isolated_run = self._isolated_run + 1 if isolated else 0
        return list(scheduled.values())

    @property
    def was_isolated(self) -> bool:
        """The last step left out less urgent running sequences (an urgent step)."""
        return self._isolated_run > 0

    def _urgent(self) -> float:
        """Urgent steps: the most urgent waiting priority when it is more urgent than some running
        sequence's (this step leaves the less urgent out) or, none such running, than some waiting one's
        (this step admits none of them: a flood's onset into free places would share the urgent prefill's
        step, 7 prefills in 0.59 s in a trace) and a place is left that one of them would take (a full
        batch's step is a plain one: it may give way and pays the bulk's time back), else inf;
        at most `urgent_in_a_row` in a row, and one after another only when all it leaves out before
        their first token are of the least urgent priority running (the bulk's): one of a priority
        between, a quiet tenant's burst under the fair shares' urgency levels, is left out of one
        urgent step at most before its first token."""
        if not self.isolate_urgent or self._isolated_run >= self.urgent_in_a_row or not self.waiting:
            return math.inf
        head = self.waiting[0].params.priority
        left_out = [s for s in self.running if s.params.priority > head]
        if not left_out:  # (the queue is in priority order: its last is its least urgent)
            if not URGENT_OVER_WAITING or self.waiting[-1].params.priority <= head:
                return math.inf
            # only with a place the less urgent would take (the last free place's request, in queue
            # order, is one of them): a full batch admits none either way
            free = self.max_num_seqs - len(self.running)
            return head if free > 0 and self.waiting[min(free, len(self.waiting)) - 1].params.priority > head else math.inf
        if self._isolated_run:
            bulk = max(s.params.priority for s in left_out)
            if any(s.num_output_tokens == 0 and s.params.priority < bulk for s in left_out):
                return math.inf
        return head

    def _schedule_running(self, scheduled: dict[str, tuple[Sequence, int]], urgent: float = math.inf) -> tuple[bool, bool, bool]:
        """1-2. Running sequences: decodes first, then prefill chunks, oldest first (under the
        priority policy, in priority order), less urgent than `urgent` left out (urgent steps).
        Returns (preempted, decoding, prefilling)."""
        budget = self.max_num_batched_tokens
        preempted = decoding = prefilling = False
        chunks = [s for s in self.running if s.is_prefilling]
        if self.is_priority:
            chunks.sort(key=_order)
        for seq in [s for s in self.running if not s.is_prefilling] + chunks:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.request_id in self.paused or seq.params.priority > urgent:
                continue  # preempted earlier in this loop, paused or left out (keeps its slot and blocks)
            n = self._chunk(seq, budget, decoding, prefilling)
            if n == 0:
                continue
            while not self.blocks.can_grow(seq.block_table, seq.num_computed_tokens + n):
                victim = max(self.running, key=_victim_order) if self.is_priority else self.running[-1]
                self._preempt(victim, scheduled)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.blocks.grow(seq.block_table, seq.num_computed_tokens + n)
            scheduled[seq.request_id] = (seq, n)
            budget -= n
            decoding = decoding or n == 1
            prefilling = prefilling or n > 1
        return preempted, decoding, prefilling

    def _schedule_waiting(self, scheduled: dict[str, tuple[Sequence, int]], decoding: bool, prefilling: bool,
                          urgent: float = math.inf) -> None:
        """3. Admit from the waiting queue, in order, never past a sequence that does not fit
        (under the priority policy, after preempting lower priorities for it where that makes room),
        nor past one less urgent than `urgent` (urgent steps: the queue is in priority order);
        one whose next prefix block a prefill is computing now waits in place (held)."""
        budget = self.max_num_batched_tokens - sum(n for _, n in scheduled.values())
        in_flight = self._blocks_in_flight() if self.waiting else set()
        i = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if seq.params.priority > urgent:
                break
            if seq.request_id in self.paused:
                i += 1  # a paused victim of this step's preemption: parked before the next
                continue
            hits = self._cached_prefix(seq)
            if self._is_held(seq, len(hits), in_flight):
                i += 1
                continue
            if len(self.running) >= self.max_num_seqs:
                if not (self.is_priority and self._preempt_for(seq, 0, scheduled)):
                    break
                budget = self.max_num_batched_tokens - sum(n for _, n in scheduled.values())
                continue  # try seq again: the victims' blocks may have been its cached prefix
            seq.num_computed_tokens = len(hits) * self.blocks.block_size
            n = self._chunk(seq, budget, decoding, prefilling)
            missing = self.blocks.blocks_for(seq.num_computed_tokens + n) - len(hits)
            reserve = self._watermark if self.running else 0
            # Attaching an evictable cached block takes it out of what is free.
            short = missing - (self.blocks.num_free_blocks - self.blocks.num_evictable(hits) - reserve)
            if n == 0 or short > 0:
                seq.num_computed_tokens = 0  # waiting sequences own nothing
                if n and self.is_priority and self._preempt_for(seq, short, scheduled):
                    budget = self.max_num_batched_tokens - sum(n for _, n in scheduled.values())
                    continue  # try seq again, with the room made
                break
            del self.waiting[i]
            self._admit(seq, hits, n)
            self._add_in_flight(seq, in_flight)
            scheduled[seq.request_id] = (seq, n)
            budget -= n
            decoding = decoding or n == 1
            prefilling = prefilling or n > 1

    def _admit(self, seq: Sequence, hits: list[int], n: int) -> None:
        """seq (out of `waiting`) runs from now, its cached prefix attached and blocks for n tokens grown."""
        self._num_waiting_tokens -= seq.num_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.blocks.attach(seq.block_table, hits)
        seq.num_registered_blocks = len(hits)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.t_scheduled = time.monotonic()  # its first schedule: the engine's queue time ends (queue_s)
        if self.blocks.enable_caching and seq.params.prompt_logprobs is None:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += seq.num_computed_tokens
        self.blocks.grow(seq.block_table, seq.num_computed_tokens + n)

    def _preempt_for(self, seq: Sequence, blocks_short: int, scheduled: dict[str, tuple[Sequence, int]]) -> bool:
        """Priority policy: preempt running sequences of a strictly lower priority than waiting `seq`,
        last in order first, until a slot is free and `blocks_short` more blocks are; whether any was.
        Preempts none unless all of them together could make that room. Each call that returns True
        leaves fewer such sequences running, so the caller's retries end."""
        victims = sorted((s for s in self.running if s.params.priority > seq.params.priority), key=_victim_order)
        slots_short = len(self.running) + 1 - self.max_num_seqs
        if not victims or slots_short > len(victims) or blocks_short > sum(len(v.block_table) for v in victims):
            return False  # the block count is an upper bound: a block another sequence shares frees nothing
        while victims and (slots_short > 0 or blocks_short > 0):
            victim = victims.pop()
            free = self.blocks.num_free_blocks
            self._preempt(victim, scheduled)
            slots_short -= 1
            blocks_short -= self.blocks.num_free_blocks - free
        return True

    # ------------------------------------------------------------ one prompt computation

    def _blocks_in_flight(self) -> set[bytes]:
        """Keys of the full prompt blocks that running prefills have yet to compute."""
        in_flight: set[bytes] = set()
        if self.blocks.enable_caching:
            for seq in self.running:
                if seq.is_prefilling:
                    self._add_in_flight(seq, in_flight)
        return in_flight

    def _add_in_flight(self, seq: Sequence, in_flight: set[bytes]) -> None:
        if not self.blocks.enable_caching:
            return
        bs = self.blocks.block_size
        full = seq.num_prompt_tokens // bs
        self.blocks.extend_hashes(seq.block_hashes, seq.token_ids, full * bs)
        in_flight.update(seq.block_hashes[seq.num_computed_tokens // bs : full])

    def _is_held(self, seq: Sequence, num_hits: int, in_flight: set[bytes]) -> bool:
        """Whether seq's first uncached block is being computed by a running prefill:
        then seq waits (in place) for it to be cached instead of computing it again.
        Never for good: the set is rebuilt every step from the running prefills, so a
        holder that finishes, is aborted or preempted releases it, and one that runs
        on caches the block, which seq then attaches."""
        if not in_flight or seq.params.prompt_logprobs is not None:
            return False
        max_blocks = (seq.num_tokens - 1) // self.blocks.block_size
        return num_hits < max_blocks and seq.block_hashes[num_hits] in in_flight

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks seq may start from (counted in the prefix-cache
        statistics only when it is admitted; see schedule)."""
        if not self.blocks.enable_caching or seq.params.prompt_logprobs is not None:
            return []
        blocks = self.blocks
        blocks.extend_hashes(seq.block_hashes, seq.token_ids, seq.num_tokens)
        # Never the block of the last token: it must run to give logits.
        return blocks.match(seq.block_hashes, seq.token_ids, (seq.num_tokens - 1) // blocks.block_size)

    def cache_computed_blocks(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After a step advanced num_computed_tokens: register every block that is now full and computed."""
        blocks = self.blocks
        if not blocks.enable_caching:
            return
        bs = blocks.block_size
        for seq, _ in scheduled:
            full = seq.num_computed_tokens // bs
            if full <= seq.num_registered_blocks or seq.status is not SequenceStatus.RUNNING:
                continue
            blocks.extend_hashes(seq.block_hashes, seq.token_ids, full * bs)
            for i in range(seq.num_registered_blocks, full):
                blocks.register(seq.block_table[i], seq.block_hashes[i], seq.token_ids[i * bs : (i + 1) * bs],
                                seq.block_hashes[i - 1] if i else None)
            seq.num_registered_blocks = full

    def _chunk(self, seq: Sequence, budget: int, decoding: bool, prefilling: bool) -> int:
        """How many of seq's uncomputed tokens this step takes (0: none fit)."""
        want = seq.num_uncomputed_tokens
        if want == 1:
            return 1
        if not self.chunked_prefill:
            # Whole prompts only; one over the budget still runs, as the step's only prefill.
            return want if want <= budget or not prefilling else 0
        n = min(want, budget)
        return min(n, self.long_prefill_token_threshold) if decoding else n

    def _preempt(self, seq: Sequence, scheduled: dict[str, tuple[Sequence, int]]) -> None:
        """Free seq's blocks and put it back in the queue (fcfs: at its head), to recompute from scratch."""
        self.running.remove(seq)
        scheduled.pop(seq.request_id, None)
        self.blocks.release(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.is_priority:
            self.waiting.insert(bisect_right(self.waiting, _order(seq), key=_order), seq)
        else:
            self.waiting.appendleft(seq)
        self._num_waiting_tokens += seq.num_tokens

    def finish(self, seqs: list[Sequence]) -> None:
        """These running sequences are done: free their blocks and slots."""
        leaving = {s.request_id for s in seqs}
        self.running = [s for s in self.running if s.request_id not in leaving]
        for seq in seqs:
            self.blocks.release(seq.block_table)
            seq.status = SequenceStatus.FINISHED
