"""Decides which sequences run: a FIFO waiting queue and the running list.

Owns admission (slots and the prefill token budget) and the load counters.
It must never touch tensors: the running list's order is the model
runner's row order, and the engine core keeps the two in step.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence, SequenceStatus

# A prefill group's padded tokens (rows x its longest prompt) stay within this
# factor of its real tokens, unless every prompt in it is at most PAD_FREE_WIDTH
# tokens long (padding those costs less than another forward would).
PAD_SLACK = 1.25
PAD_FREE_WIDTH = 64


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

    def admit(self) -> list[list[Sequence]]:
        """Move the head of the waiting queue to the end of `running`, in prefill groups.

        Admits in FIFO order while a slot is free and this step's prompt
        tokens stay within max_num_batched_tokens; the first one always goes,
        so a prompt longer than the budget still runs. Never skips ahead: a
        long prompt at the head is not starved by short ones behind it.

        The admitted prompts are then grouped by length, each group one
        left-padded prefill forward: sorted by length, a group is cut where
        the next prompt would pad it beyond PAD_SLACK x its real tokens. A
        1,800-token prompt padded together with three 20-token ones costs
        about 5x its own prefill; prefilled apart, about 1.1x. `running` is
        extended group after group, so its tail lines up with the prefills.
        """
        admitted: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            if admitted and tokens + seq.num_prompt_tokens > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            self._num_waiting_prefill_tokens -= seq.num_prompt_tokens
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            tokens += seq.num_prompt_tokens
        groups = group_for_prefill(admitted)
        for group in groups:
            self.running.extend(group)
        return groups

    def reorder_running(self, perm: list[int]) -> None:
        """New running[i] = old running[perm[i]] (the model runner moved its rows so)."""
        assert sorted(perm) == list(range(len(self.running))), perm
        self.running = [self.running[i] for i in perm]

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


def group_for_prefill(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Split sequences into prefill groups with bounded padding (see Scheduler.admit)."""
    groups: list[list[Sequence]] = []
    group: list[Sequence] = []
    real = 0
    for seq in sorted(seqs, key=lambda s: s.num_prompt_tokens):
        width = seq.num_prompt_tokens  # sorted: the newcomer is the longest
        if group and width > PAD_FREE_WIDTH and width * (len(group) + 1) > PAD_SLACK * (real + width):
            groups.append(group)
            group, real = [], 0
        group.append(seq)
        real += width
    if group:
        groups.append(group)
    return groups
