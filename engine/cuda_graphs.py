"""Decode steps replayed from CUDA graphs captured at a fixed set of padded batch sizes (vLLM's design).

Owns the capture sizes, the static input buffers a graph reads, the padding of
a step up to the next captured size, and the capture itself (largest first,
one shared memory pool). Must never decide what runs nor allocate KV memory:
it replays the model over a decode-only step the model runner packed.

The graph backend is a seam: CudaGraphBackend captures and replays real CUDA
graphs; EagerReplayBackend "replays" by running the captured function again on
the same static buffers, which makes every piece of bookkeeping here (padding,
buffer copies, output slicing) testable on a CPU against the eager engine.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

log = logging.getLogger(__name__)

# The largest batch captured by default: vLLM's max_cudagraph_capture_size default.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """vLLM's default cudagraph_capture_sizes: 1, 2, 4, then every 8 up to 256, then every 16,
    capped by the largest batch a step can hold; ascending. A step larger than the last runs eagerly."""
    cap = max(1, min(max_num_seqs, max_size))
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
    kept = [s for s in sizes if s < cap]
    return [*kept, cap]  # a full step of max_num_seqs rows still replays


def padded_batch_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_rows` rows (sizes ascending), or None when none does."""
    if num_rows < 1:
        raise ValueError(f"a decode step has at least one row, got {num_rows}")
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Run `fn` (reading and writing only static tensors) so that it can be replayed;
        returns (replay, output): replay() recomputes `output` in place from the buffers' current values."""


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture, warmed on a side stream first; all graphs share one memory pool."""

    def __init__(self, warmup_runs: int = 2) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.warmup_runs = warmup_runs

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_runs):  # lazy inits (cuBLAS handles, workspace) stay out of the graph
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph.replay, output


class EagerReplayBackend:
    """No graph: replay() runs `fn` again and copies its result into the captured output.
    The same contract as a CUDA graph (inputs only through the static buffers), on any device."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        output = fn().clone()

        def replay() -> None:
            output.copy_(fn())

        return replay, output


class DecodeGraphs:
    """The decode forward captured once per size in `sizes`, over static buffers of the largest.

    run() copies a step's rows into the buffers, pads the rest of its size class by
    repeating the last real row (same token, position, slot, block table and length:
    the padding writes the same key and value to the same slot, and is never a
    sequence's own, masked, future slot), replays, and returns the real rows' logits.
    `forward(rows, input_ids, positions, slots, block_tables, lengths)` is the model's
    decode forward over the first `rows` rows of those buffers; it must not sync with the host.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], sizes: list[int], max_blocks: int,
                 device: torch.device, backend: GraphBackend) -> None:
        self.forward = forward
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        self.backend = backend
        biggest = self.sizes[-1]
        longs = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(biggest, **longs)
        self.positions = torch.zeros(biggest, **longs)
        self.slots = torch.zeros(biggest, **longs)
        self.block_tables = torch.zeros(biggest, max_blocks, **longs)
        self.lengths = torch.ones(biggest, **longs)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.capture_s = 0.0
        self.num_replays = 0

    def capture(self) -> float:
        """Capture every size, largest first (later, smaller graphs reuse its pool); seconds taken."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._graphs[size] = self.backend.capture(lambda size=size: self._forward(size))
        self.capture_s = time.perf_counter() - start
        log.info("decode graphs captured at %d batch sizes (1-%d) in %.1f s", len(self.sizes), self.sizes[-1], self.capture_s)
        return self.capture_s

    def _forward(self, size: int) -> torch.Tensor:
        return self.forward(size, self.input_ids[:size], self.positions[:size], self.slots[:size],
                            self.block_tables[:size], self.lengths[:size])

    def can_run(self, num_rows: int, num_blocks: int) -> bool:
        """Whether a step of this many rows, the longest needing `num_blocks` blocks, fits a captured graph."""
        return num_blocks <= self.max_blocks and padded_batch_size(num_rows, self.sizes) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of a decode step of `rows` rows (block_tables [rows, <= max_blocks])."""
        rows, width = block_tables.shape
        size = padded_batch_size(rows, self.sizes)
        if size is None or width > self.max_blocks:
            raise ValueError(f"no captured graph for {rows} rows of {width} blocks")
        replay, output = self._graphs[size]
        for buf, value in ((self.input_ids, input_ids), (self.positions, positions), (self.slots, slots),
                           (self.lengths, lengths)):
            buf[:rows].copy_(value, non_blocking=True)
            buf[rows:size].copy_(value[-1:].expand(size - rows), non_blocking=True)
        self.block_tables[:rows, :width].copy_(block_tables, non_blocking=True)
        self.block_tables[:rows, width:].zero_()
        self.block_tables[rows:size].copy_(self.block_tables[rows - 1 : rows].expand(size - rows, -1))
        replay()
        self.num_replays += 1
        return output[:rows]
