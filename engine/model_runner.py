"""Runs one packed forward over a step's scheduled tokens against the paged KV cache.

Knows tokens, positions, slots and tensors only: what runs in a step and
who gets a block is decided by the scheduler, sampling by the sampler. It
must never do per-token Python work beyond building the step's index
tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from dpserve.engine.attention import DecodeGroup, PrefillChunk, StepMetadata, step_metadata
from dpserve.engine.kv_cache import KVCache
from dpserve.engine.loader import LoadedModel
from dpserve.engine.sequence import Sequence

# Decodes of very different context lengths attend in separate batched calls
# when sharing one would pad more than this many (row x position) cells; one
# more call per layer costs about as much as attending over these.
DECODE_PAD_CELLS = 8192


def group_decodes(lengths: list[int], pad_cells: int = DECODE_PAD_CELLS) -> list[tuple[int, int]]:
    """Cut `lengths` (ascending) into [start, end) groups whose padding stays within pad_cells."""
    groups: list[tuple[int, int]] = []
    start = real = 0
    for i, length in enumerate(lengths):
        if i > start and (i - start + 1) * length - (real + length) > pad_cells:
            groups.append((start, i))
            start, real = i, 0
        real += length
    if start < len(lengths):
        groups.append((start, len(lengths)))
    return groups


class ModelRunner:
    """One forward per step: every scheduled token of every sequence, packed into one row.

    execute() takes the step's (sequence, number of new tokens) pairs, whose
    block tables already cover the new tokens, and returns the logits of the
    sequences that complete their known tokens this step (they get a sampled
    token), in the order of the returned list. Sequences that want prompt
    logprobs also get the logits of every prompt position their chunk ran,
    in `last_prompt_logits` (empty for every other step).
    """

    def __init__(self, loaded: LoadedModel, kv: KVCache) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.kv = kv
        self.block_size = kv.block_size
        params = inspect.signature(self.model.forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params
        self.decode_pad_cells = DECODE_PAD_CELLS
        # (sequence, first position, logits of positions first.. of its chunk that lie in the prompt)
        self.last_prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = []

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Sequence, int]], on_layer: Callable[[], None] | None = None
    ) -> tuple[torch.Tensor | None, list[Sequence]]:
        bs = self.block_size
        decodes = sorted((s for s, n in scheduled if n == 1), key=lambda s: s.num_computed_tokens)
        prefills = [(s, n) for s, n in scheduled if n > 1]

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []  # packed rows whose logits are sampled
        sampled: list[Sequence] = []

        # 1. Decodes first, ascending context length, so similar lengths are neighbours.
        lengths = []
        for seq in decodes:
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            lengths.append(pos + 1)
            if pos + 1 == seq.num_tokens:
                keep.append(len(input_ids) - 1)
                sampled.append(seq)
        groups = []
        for start, end in group_decodes(lengths, self.decode_pad_cells):
            width = -(-lengths[end - 1] // bs)
            flat: list[int] = []
            for seq in decodes[start:end]:
                table = seq.block_table[:width]
                flat.extend(table)
                flat.extend([0] * (width - len(table)))
            groups.append(
                DecodeGroup(
                    start,
                    end,
                    torch.tensor(flat, dtype=torch.long, device=self.device),
                    torch.tensor(lengths[start:end], dtype=torch.long, device=self.device),
                )
            )

        # 2. Prefill chunks after them, one causal block each.
        chunks = []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # (seq, first position, first kept row, rows)
        for seq, n in prefills:
            first = seq.num_computed_tokens
            start = len(input_ids)
            input_ids.extend(seq.token_ids[first : first + n])
            positions.extend(range(first, first + n))
            table = seq.block_table[: -(-(first + n) // bs)]
            slots.extend(table[p // bs] * bs + p % bs for p in range(first, first + n))
            chunks.append(PrefillChunk(start, start + n, first, torch.tensor(table, dtype=torch.long, device=self.device)))
            # Prompt logprobs: position p's logits score prompt token p + 1.
            wanted = min(first + n, seq.num_prompt_tokens - 1) - first
            if seq.prompt_logprobs is not None and wanted > 0 and first + wanted > len(seq.prompt_logprobs):
                prompt_rows.append((seq, first, len(keep), wanted))
                keep.extend(range(start, start + wanted))
            if first + n == seq.num_tokens:
                keep.append(len(input_ids) - 1)
                sampled.append(seq)

        meta = StepMetadata(
            self.kv,
            torch.tensor(slots, dtype=torch.long, device=self.device),
            groups,
            chunks,
            on_layer,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device).unsqueeze(0)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device).unsqueeze(0)
        kwargs = {}
        if self._has_logits_to_keep:
            # The lm_head over every packed position would be wasted work.
            kwargs["logits_to_keep"] = torch.tensor(keep or [0], dtype=torch.long, device=self.device)
        with step_metadata(meta):
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
        logits = out.logits[0]
        if not self._has_logits_to_keep:
            logits = logits[torch.tensor(keep, device=self.device)]
        self.last_prompt_logits = []
        if prompt_rows:
            # Split the kept rows: prompt positions go aside, the rest are sampled.
            is_prompt = torch.zeros(len(keep), dtype=torch.bool, device=self.device)
            for seq, first, row, count in prompt_rows:
                self.last_prompt_logits.append((seq, first, logits[row : row + count]))
                is_prompt[row : row + count] = True
            logits = logits[~is_prompt]
        if not sampled:
            return None, []
        return logits, sampled
