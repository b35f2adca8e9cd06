"""Decides which sequences run: a FIFO waiting queue and the running list.

Owns admission (slots and the prefill token budget) and the load counters.
It must never touch tensors: the running list's order is the model
runner's row order, and the engine core keeps the two in step.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence, SequenceStatus


class Scheduler:
    """Invariants: `waiting` holds WAITING sequences in arrival order; `running`
    holds RUNNING sequences, and between engine steps running[i] owns KV row
    i (within a step, admitted sequences get their rows once prefilled and
    merged, always at the end); a request id is in
    at most one of them; finished sequences are in neither. The counters
    are kept incrementally so reading them costs nothing per step.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._num_waiting_prefill_tokens = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_prefill_tokens(self) -> int:
        return self._num_waiting_prefill_tokens

    @property
    def num_remaining_decode_tokens(self) -> int:
        # O(running) on read; read a few times a second for load reports, not per token.
        return sum(seq.num_remaining_tokens for seq in self.running)

    @property
    def slot_usage(self) -> float:
        return len(self.running) / self.max_num_seqs

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._num_waiting_prefill_tokens += seq.num_prompt_tokens

    def admit(self) -> list[Sequence]:
        """Move the head of the waiting queue to the end of `running`.

        Admits in FIFO order while a slot is free and the padded prefill
        batch (rows x longest prompt, what the forward really computes)
        stays within max_num_batched_tokens. The first one always goes, so a
        prompt longer than the budget still runs, alone. Never skips ahead:
        a long prompt at the head is not starved by short ones behind it.
        """
        admitted: list[Sequence] = []
        longest = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            width = max(longest, seq.num_prompt_tokens)
            if admitted and width * (len(admitted) + 1) > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            self._num_waiting_prefill_tokens -= seq.num_prompt_tokens
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            longest = width
        self.running.extend(admitted)
        return admitted

    def remove_running(self, leaving: set[str]) -> list[int]:
        """Drop running sequences whose ids are in `leaving`; returns the rows
        that stay (old row numbers, in order) for ModelRunner.keep_rows."""
        kept_rows = [row for row, seq in enumerate(self.running) if seq.request_id not in leaving]
        for seq in self.running:
            if seq.request_id in leaving:
                seq.status = SequenceStatus.FINISHED
        self.running = [self.running[row] for row in kept_rows]
        return kept_rows

    def remove_waiting(self, leaving: set[str]) -> None:
        if not any(seq.request_id in leaving for seq in self.waiting):
            return
        kept = deque()
        for seq in self.waiting:
            if seq.request_id in leaving:
                seq.status = SequenceStatus.FINISHED
                self._num_waiting_prefill_tokens -= seq.num_prompt_tokens
            else:
                kept.append(seq)
        self.waiting = kept
