"""Runs one packed forward over a step's scheduled tokens against the paged KV cache.

Knows tokens, positions, slots and tensors only: what runs in a step and
who gets a block is decided by the scheduler, sampling by the sampler. It
must never do per-token Python work beyond building the step's index
tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from dpserve.engine.attention import DecodeBatch, DecodeGroup, PrefillChunk, StepMetadata, step_metadata
from dpserve.engine.compiled import CompiledDecode, bind_kv, eager
from dpserve.engine.cuda_graphs import CudaGraphBackend, DecodeGraphs, GraphBackend, capture_sizes
from dpserve.engine.kv_cache import KVCache
from dpserve.engine.loader import LoadedModel
from dpserve.engine.sequence import Sequence

# Decodes of very different context lengths attend in separate batched calls
# when sharing one would pad more than this many (row x position) cells; one
# more call per layer costs about as much as attending over these.
DECODE_PAD_CELLS = 8192
# A step whose prefill chunks are short, or attend to little, runs through the compiled decode, each
# prompt token a row of its own (one query against its sequence's cache, as a decode): the eager
# forward's ~50 ms of per-op overhead a step goes, and the rows' attention costs ~60 ns per (row,
# position) cell a layer against SDPA's few. Measured on the 135M model in bf16, one thread
# (RESULTS, tenth round), CPU ms: a 70-token prompt alone 145 -> 115, four 442 -> 381, one of 200
# tokens (20k cells) 374 -> 355, one of 300 (45k) 528 -> 588, one of 512 (131k) 994 -> 1,179.
COMPILED_MAX_PREFILL_TOKENS = 64  # at most this many prefill tokens always (the per-row attention is small)
COMPILED_MAX_PREFILL_CELLS = 16_384  # or at most this many (row, position) cells among the prefill rows


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
        self.max_model_len = loaded.max_model_len
        self.compiled: CompiledDecode | None = None
        self.graphs: DecodeGraphs | None = None

    def enable_compiled_decode(self, max_num_seqs: int = 256) -> float:
        """Decode-only steps through the compiled forward from now on: CUDA graphs on a GPU
        (enable_decode_graphs), else the torch.compile'd blocks, compiled (or loaded from
        inductor's cache) by running dummy steps. Returns the seconds that took."""
        if self.device.type == "cuda":
            return self.enable_decode_graphs(CudaGraphBackend(), max_num_seqs)
        compiled = CompiledDecode(self.model, self.block_size)
        seconds = compiled.warm(lambda rows: self._dummy_decode(compiled, rows))
        self.compiled = compiled
        return seconds

    @torch.inference_mode()
    def enable_decode_graphs(self, backend: GraphBackend, max_num_seqs: int) -> float:
        """Decode-only steps of up to max_num_seqs rows replayed from graphs captured now
        (cuda_graphs.DecodeGraphs; any backend, so the bookkeeping is testable on a CPU).
        Captured over block 0's first slot, before any sequence owns a block."""
        max_blocks = -(-self.max_model_len // self.block_size)
        graphs = DecodeGraphs(self._graph_forward, capture_sizes(max_num_seqs), max_blocks, self.device, backend)
        bind_kv(self.model, self.kv)
        seconds = graphs.capture()
        self.graphs = graphs
        return seconds

    def _graph_forward(self, rows: int, input_ids, positions, slots, block_tables, lengths) -> torch.Tensor:
        """The model over `rows` decode rows read from DecodeGraphs' static buffers (no host sync)."""
        batch = DecodeBatch(block_tables, lengths, sdpa=True)
        kwargs = {"logits_to_keep": 0} if self._has_logits_to_keep else {}
        with step_metadata(StepMetadata(self.kv, slots, [], [], None, batch)), eager():
            out = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False, **kwargs)
        return out.logits[0]

    @torch.inference_mode()
    def _dummy_decode(self, compiled: CompiledDecode, rows: int) -> None:
        """A decode step of `rows` rows at position 0 of block 0 (before any sequence owns a block:
        what it writes there is finite, as the cache's invariant wants, and overwritten before it is read)."""
        zeros = torch.zeros(rows, dtype=torch.long, device=self.device)
        compiled.bind_kv(self.kv)
        tables = zeros.view(rows, 1).expand(rows, 2).contiguous()
        ones = torch.ones_like(zeros)
        with step_metadata(StepMetadata(self.kv, zeros, [], [], None, DecodeBatch(tables, ones))):
            compiled(zeros.view(1, rows), zeros.view(1, rows), compiled.step(zeros, tables, ones))

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Sequence, int]], on_layer: Callable[[], None] | None = None
    ) -> tuple[torch.Tensor | None, list[Sequence]]:
        decodes = sorted((s for s, n in scheduled if n == 1), key=lambda s: s.num_computed_tokens)
        prefills = [(s, n) for s, n in scheduled if n > 1]
        step = _PackedStep()
        if self.compiled is not None and self._compiled_can_take(prefills):
            return self._execute_compiled(decodes, prefills, step, on_layer)
        if self.graphs is not None and decodes and not prefills:
            width = -(-(decodes[-1].num_computed_tokens + 1) // self.block_size)
            if self.graphs.can_run(len(decodes), width):
                return self._execute_graphs(decodes, step, width)
        # 1. Decodes first, ascending context length, so similar lengths are neighbours.
        groups = self._pack_decodes(decodes, step)
        # 2. Prefill chunks after them, one causal block each.
        chunks = self._pack_prefills(prefills, step)
        # 3. One forward over the packed row.
        meta = StepMetadata(self.kv, self._long(step.slots), groups, chunks, on_layer)
        logits = self._forward(step, meta)
        # 4. Prompt positions' logits go aside; the rest are sampled.
        self.last_prompt_logits = []
        if step.prompt_rows:
            is_prompt = torch.zeros(len(step.keep), dtype=torch.bool, device=self.device)
            for seq, first, row, count in step.prompt_rows:
                self.last_prompt_logits.append((seq, first, logits[row : row + count]))
                is_prompt[row : row + count] = True
            logits = logits[~is_prompt]
        if not step.sampled:
            return None, []
        return logits, step.sampled

    def _compiled_can_take(self, prefills: list[tuple[Sequence, int]]) -> bool:
        """Whether the step's prefill chunks may run as rows of the compiled decode: few tokens, or
        few (row, position) cells for their rows to attend over, and no prompt logprobs (those want
        every chunk position's logits)."""
        if any(seq.prompt_logprobs is not None for seq, _ in prefills):
            return False
        if sum(n for _, n in prefills) <= COMPILED_MAX_PREFILL_TOKENS:
            return True
        # chunk of n from position f: rows attend over f + 1 ... f + n positions
        cells = sum(n * seq.num_computed_tokens + n * (n + 1) // 2 for seq, n in prefills)
        return cells <= COMPILED_MAX_PREFILL_CELLS

    def _execute_compiled(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]], step: _PackedStep,
                          on_layer: Callable[[], None] | None = None) -> tuple[torch.Tensor, list[Sequence]]:
        """A step through the compiled forward, attention reading the cache in place: the decodes,
        then each prefill chunk's tokens as rows of their own (position p attends to its sequence's
        first p + 1 cached positions; every row's key and value are written before any row attends)."""
        lengths = self._pack_decode_rows(decodes, step)
        tables = [seq.block_table for seq in decodes]
        bs = self.block_size
        for seq, n in prefills:
            first = seq.num_computed_tokens
            for pos in range(first, first + n):
                step.input_ids.append(seq.token_ids[pos])
                step.positions.append(pos)
                step.slots.append(seq.block_table[pos // bs] * bs + pos % bs)
                lengths.append(pos + 1)
                tables.append(seq.block_table)
            if first + n == seq.num_tokens:
                step.keep.append(len(step.input_ids) - 1)
                step.sampled.append(seq)
        # At least 2 blocks: a width of 1 would be a specialization of its own (another compile).
        width = max(2, -(-max(lengths) // bs))
        tables = [table[:width] + [0] * (width - min(width, len(table))) for table in tables]
        if len(lengths) == 1:
            self._pad_single_row(step, tables, lengths)
        self.last_prompt_logits = []
        self.compiled.bind_kv(self.kv)
        slots, tables, lengths = self._long(step.slots), self._long(tables), self._long(lengths)
        # a padding row, or a prompt token whose logits nobody samples: the lm_head skips it
        keep = self._long(step.keep) if len(step.keep) != len(step.input_ids) else None
        # The step also as step_metadata's global: the path a model whose layers do not pass the
        # decode keyword argument on to attention falls back to (eagerly, still in place).
        with step_metadata(StepMetadata(self.kv, slots, [], [], None, DecodeBatch(tables, lengths))):
            logits = self.compiled(self._long(step.input_ids).unsqueeze(0), self._long(step.positions).unsqueeze(0),
                                   self.compiled.step(slots, tables, lengths), keep, on_layer)
        return logits, step.sampled

    def _execute_graphs(self, decodes: list[Sequence], step: _PackedStep, width: int) -> tuple[torch.Tensor, list[Sequence]]:
        """A decode-only step replayed from the captured graph of its padded size."""
        lengths = self._pack_decode_rows(decodes, step)
        tables = [seq.block_table[:width] + [0] * (width - min(width, len(seq.block_table))) for seq in decodes]
        self.last_prompt_logits = []
        logits = self.graphs.run(self._long(step.input_ids), self._long(step.positions), self._long(step.slots),
                                 self._long(tables), self._long(lengths))
        if len(step.keep) != len(step.input_ids):  # a prompt's one-token chunk that is not its last
            logits = logits[self._long(step.keep)]
        return logits, step.sampled

    def _pad_single_row(self, step: _PackedStep, tables: list[list[int]], lengths: list[int]) -> None:
        """A batch of one runs as two rows (the compiled code is for batches of 2 and more:
        batch 1 would be a compile of its own). The second row repeats the first; it writes
        its key and value to the sequence's next slot, which is past its length (masked)
        and overwritten when the sequence gets there, or, at a block's last slot, to the
        same slot with the same values. Its logits are dropped (step.keep)."""
        slot = step.slots[0]
        pad_slot = slot + 1 if (slot + 1) % self.block_size else slot
        step.input_ids.append(step.input_ids[0])
        step.positions.append(step.positions[0])
        step.slots.append(pad_slot)
        tables.append(tables[0])
        lengths.append(lengths[0])

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _pack_decodes(self, decodes: list[Sequence], step: _PackedStep) -> list[DecodeGroup]:
        """One row per decoding sequence; batched attention groups of similar length."""
        bs = self.block_size
        lengths = self._pack_decode_rows(decodes, step)
        groups = []
        for start, end in group_decodes(lengths, self.decode_pad_cells):
            width = -(-lengths[end - 1] // bs)
            flat: list[int] = []
            for seq in decodes[start:end]:
                table = seq.block_table[:width]
                flat.extend(table)
                flat.extend([0] * (width - len(table)))
            groups.append(DecodeGroup(start, end, self._long(flat), self._long(lengths[start:end])))
        return groups

    def _pack_decode_rows(self, decodes: list[Sequence], step: _PackedStep) -> list[int]:
        """One row per decoding sequence (ascending context); returns their context lengths."""
        bs = self.block_size
        lengths = []
        for seq in decodes:
            pos = seq.num_computed_tokens
            step.input_ids.append(seq.token_ids[pos])
            step.positions.append(pos)
            step.slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            lengths.append(pos + 1)
            if pos + 1 == seq.num_tokens:
                step.keep.append(len(step.input_ids) - 1)
                step.sampled.append(seq)
        return lengths

    def _pack_prefills(self, prefills: list[tuple[Sequence, int]], step: _PackedStep) -> list[PrefillChunk]:
        """n rows per prefilling sequence; the rows whose logits are kept (prompt logprobs, the last)."""
        bs = self.block_size
        chunks = []
        for seq, n in prefills:
            first = seq.num_computed_tokens
            start = len(step.input_ids)
            step.input_ids.extend(seq.token_ids[first : first + n])
            step.positions.extend(range(first, first + n))
            table = seq.block_table[: -(-(first + n) // bs)]
            step.slots.extend(table[p // bs] * bs + p % bs for p in range(first, first + n))
            chunks.append(PrefillChunk(start, start + n, first, self._long(table)))
            # Prompt logprobs: position p's logits score prompt token p + 1.
            wanted = min(first + n, seq.num_prompt_tokens - 1) - first
            if seq.prompt_logprobs is not None and wanted > 0 and first + wanted > len(seq.prompt_logprobs):
                step.prompt_rows.append((seq, first, len(step.keep), wanted))
                step.keep.extend(range(start, start + wanted))
            if first + n == seq.num_tokens:
                step.keep.append(len(step.input_ids) - 1)
                step.sampled.append(seq)
        return chunks

    def _forward(self, step: _PackedStep, meta: StepMetadata) -> torch.Tensor:
        """The model over the packed row; the logits of the kept rows, in order."""
        ids = self._long(step.input_ids).unsqueeze(0)
        pos = self._long(step.positions).unsqueeze(0)
        kwargs = {}
        if self._has_logits_to_keep:
            # The lm_head over every packed position would be wasted work.
            kwargs["logits_to_keep"] = self._long(step.keep or [0])
        with step_metadata(meta), eager():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
        logits = out.logits[0]
        if not self._has_logits_to_keep:
            logits = logits[torch.tensor(step.keep, device=self.device)]
        return logits


@dataclass(slots=True)
class _PackedStep:
    """The step's packed row as it is built: one entry per scheduled token, in row order."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)  # packed rows whose logits are kept
    sampled: list[Sequence] = field(default_factory=list)  # who gets a token, in the order of the kept rows
    prompt_rows: list[tuple[Sequence, int, int, int]] = field(default_factory=list)  # (seq, first position, first kept row, rows)
