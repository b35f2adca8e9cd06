"""Runs the model's forward on the running batch and owns that batch's KV cache.

Knows rows, tokens and tensors only: which request owns a row, when a
request may start and when it ends are decided by the caller (the engine
core). It must never sample, and never do per-token Python work.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .loader import LoadedModel

_SPARE_COLUMNS = 64  # room to decode into before a layer's buffer must grow


class KVLayer(DynamicLayer):
    """One layer's keys and values in a buffer with spare columns.

    transformers' DynamicLayer concatenates the whole cache on every token
    (a copy of B x T per layer per step, the largest cost of a decode step
    once a long prompt is in the batch). Here a decode step writes its one
    new column in place; the buffer grows by half when full (amortized),
    and dropping rows or leading pad columns moves no more than the rows
    that shift up.

    Invariant: `keys`/`values` are the views [:rows, :, start:end] of the
    buffers; columns beyond `end` are spare.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.rows = self.start = self.end = 0

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, spare: int = _SPARE_COLUMNS) -> KVLayer:
        layer = cls()
        layer._fresh([(keys, values)], keys.shape[2], spare)
        return layer

    @classmethod
    def stacked(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], spare: int = _SPARE_COLUMNS) -> KVLayer:
        """Rows of several caches one after another, right-aligned to the widest (left pad = zeros)."""
        layer = cls()
        layer._fresh(parts, max(k.shape[2] for k, _ in parts), spare)
        return layer

    def _fresh(self, parts: list[tuple[torch.Tensor, torch.Tensor]], width: int, spare: int) -> None:
        first = parts[0][0]
        rows = sum(k.shape[0] for k, _ in parts)
        _, heads, _, dim = first.shape
        kbuf = first.new_zeros((rows, heads, width + spare, dim))
        vbuf = first.new_zeros((rows, heads, width + spare, dim))
        row = 0
        for k, v in parts:
            n, t = k.shape[0], k.shape[2]
            kbuf[row : row + n, :, width - t : width].copy_(k)
            vbuf[row : row + n, :, width - t : width].copy_(v)
            row += n
        self.kbuf, self.vbuf = kbuf, vbuf
        self.rows, self.start, self.end = rows, 0, width
        self.device = first.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.kbuf[: self.rows, :, self.start : self.end]
        self.values = self.vbuf[: self.rows, :, self.start : self.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:  # a prefill: keep exactly what came, plus spare columns
            self._fresh([(key_states, value_states)], key_states.shape[2], _SPARE_COLUMNS)
            return self.keys, self.values
        n = key_states.shape[2]
        if self.end + n > self.kbuf.shape[2]:
            width = self.end - self.start
            self._fresh([(self.keys, self.values)], width, max(_SPARE_COLUMNS, width // 2) + n)
        self.kbuf[: self.rows, :, self.end : self.end + n].copy_(key_states)
        self.vbuf[: self.rows, :, self.end : self.end + n].copy_(value_states)
        self.end += n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.start

    def keep(self, rows: list[int], drop_columns: int) -> None:
        """Keep `rows` (increasing) in place, moving each up to its new index, and
        drop `drop_columns` leading columns (padding in every kept row)."""
        self.start += drop_columns
        for new, old in enumerate(rows):
            if new != old:
                self.kbuf[new, :, self.start : self.end].copy_(self.kbuf[old, :, self.start : self.end])
                self.vbuf[new, :, self.start : self.end].copy_(self.vbuf[old, :, self.start : self.end])
        self.rows = len(rows)
        self._views()


def _new_cache(layers: list[KVLayer] | None = None) -> DynamicCache:
    """A DynamicCache whose layers are KVLayers (created on the prefill's first update)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = KVLayer
    if layers is not None:
        cache.layers = layers
    return cache


@dataclass(slots=True)
class KVBatch:
    """A left-padded batch of KV caches.

    Invariants: every tensor has the same B rows, and row i of each belongs
    to the same sequence; rows are right-aligned: row i's real tokens fill
    the last lengths[i] columns of attention_mask (1 there, 0 before) and
    of every layer's keys/values [B, kv_heads, T, head_dim]. Pad columns
    hold zeros and are never attended to.
    """

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, T] long
    lengths: torch.Tensor  # [B] long, real tokens per row (= next position id)

    @property
    def num_rows(self) -> int:
        return self.attention_mask.shape[0]

    @property
    def num_columns(self) -> int:
        return self.attention_mask.shape[1]

    @property
    def kv_layers(self) -> list[KVLayer]:
        return self.cache.layers


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


# One more decode forward costs about as much as attending over this many
# (row x column) cells of padding (measured on CPU with the demo model: ~2 ms
# of fixed cost per forward against ~0.2 us per padded cell). Buckets whose
# merge would pad less than this are merged.
FORWARD_COST_CELLS = 8192


def _merge(parts: list[KVBatch]) -> KVBatch:
    """One KVBatch holding the rows of `parts` in order, right-aligned to the widest."""
    width = max(p.num_columns for p in parts)
    layers = [KVLayer.stacked([(layer.keys, layer.values) for layer in per_part]) for per_part in zip(*(p.kv_layers for p in parts))]
    mask = torch.cat([_left_pad(p.attention_mask, width, 1) for p in parts])
    return KVBatch(_new_cache(layers), mask, torch.cat([p.lengths for p in parts]))


class ModelRunner:
    """Prefill and decode forwards over the running rows, kept in length buckets.

    The running rows live in one or more KVBatches ("buckets"): rows of
    similar length share one left-padded batch and one forward. A 1,800-token
    sequence decoding among sixteen 30-token ones would otherwise make every
    step attend over 17 x 1,800 cells instead of 16 x 30 + 1,800 (~3.5x the
    step time). Usually there is one bucket; a second appears only while its
    rows differ enough in length that a forward of their own is cheaper.

    Invariant: the concatenation of the buckets' rows, in order, is the
    caller's running list: row i belongs to the caller's i-th running
    sequence. The caller keeps it true by appending prefilled rows at the end
    (`append`), naming the survivors when sequences leave (`keep_rows`) and
    applying the permutation `consolidate` returns.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.device = loaded.device
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache; accept either.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self.buckets: list[KVBatch] = []
        self.forward_cost_cells = FORWARD_COST_CELLS

    @property
    def num_rows(self) -> int:
        return sum(b.num_rows for b in self.buckets)

    @property
    def num_columns(self) -> int:
        """Columns of the widest bucket."""
        return max((b.num_columns for b in self.buckets), default=0)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """Logits of the last position, [B, vocab]; `cache` grows in place."""
        kwargs = {self._cache_kwarg: cache}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1  # the lm_head over every prompt position is wasted work
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, KVBatch]:
        """One left-padded forward over `prompts`: last-position logits [n, vocab]
        and their caches, not yet part of the running batch (see `append`)."""
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        width = int(lengths.max())
        columns = torch.arange(width).unsqueeze(0)
        attention_mask = (columns >= (width - lengths).unsqueeze(1)).long()
        input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
        input_ids[attention_mask.bool()] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        # Positions as generate() computes them for left padding: pads get 0.
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)

        cache = _new_cache()
        attention_mask = attention_mask.to(self.device)
        logits = self._forward(
            input_ids.to(self.device), attention_mask, position_ids.to(self.device), cache
        )
        return logits, KVBatch(cache, attention_mask, lengths.to(self.device))

    @torch.inference_mode()
    def decode(self, input_ids: list[int]) -> torch.Tensor:
        """One new token per row, one forward per bucket; returns logits [B, vocab]."""
        assert len(input_ids) == self.num_rows, (len(input_ids), self.num_rows)
        logits = []
        start = 0
        for batch in self.buckets:
            n = batch.num_rows
            logits.append(self._decode_bucket(batch, input_ids[start : start + n]))
            start += n
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _decode_bucket(self, batch: KVBatch, input_ids: list[int]) -> torch.Tensor:
        ones = batch.attention_mask.new_ones((batch.num_rows, 1))
        batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
        position_ids = batch.lengths.unsqueeze(1)  # cumsum(mask) - 1 at the new column
        tokens = torch.tensor(input_ids, dtype=torch.long).unsqueeze(1).to(self.device)
        logits = self._forward(tokens, batch.attention_mask, position_ids, batch.cache)
        batch.lengths = batch.lengths + 1
        return logits

    def append(self, *new: KVBatch) -> None:
        """Add prefilled rows after the running ones, each KVBatch as a bucket of its own
        (no copy here; `consolidate` merges what is worth merging)."""
        self.buckets.extend(new)

    @torch.inference_mode()
    def keep_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (increasing, global) and drop columns now padding in every row."""
        if rows == list(range(self.num_rows)):
            return
        assert all(a < b for a, b in zip(rows, rows[1:])), rows
        kept: list[KVBatch] = []
        start = i = 0
        for batch in self.buckets:
            n = batch.num_rows
            local = []
            while i < len(rows) and rows[i] < start + n:
                local.append(rows[i] - start)
                i += 1
            start += n
            if local:
                self._keep_in_bucket(batch, local)
                kept.append(batch)
        self.buckets = kept

    def _keep_in_bucket(self, batch: KVBatch, rows: list[int]) -> None:
        if rows == list(range(batch.num_rows)):
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        lengths = batch.lengths.index_select(0, index)
        drop = batch.num_columns - int(lengths.max())  # rows are right-aligned
        for layer in batch.kv_layers:
            layer.keep(rows, drop)
        batch.attention_mask = batch.attention_mask[index, drop:]
        batch.lengths = lengths

    @torch.inference_mode()
    def consolidate(self) -> list[int] | None:
        """Regroup the buckets by width and merge neighbours whose merge costs less
        padding than a forward (FORWARD_COST_CELLS). Returns the new row order as
        a permutation of the old rows (new row i = old row perm[i]), or None when
        the order did not change; the caller must reorder its running list alike."""
        if len(self.buckets) <= 1:
            return None
        starts = []
        start = 0
        for batch in self.buckets:
            starts.append(start)
            start += batch.num_rows
        order = sorted(range(len(self.buckets)), key=lambda k: self.buckets[k].num_columns)
        groups: list[list[int]] = []
        rows = cells = 0
        for k in order:
            batch = self.buckets[k]
            n, width = batch.num_rows, batch.num_columns  # sorted: the widest so far
            if groups and (rows + n) * width <= cells + n * width + len(groups[-1]) * self.forward_cost_cells:
                groups[-1].append(k)
                rows, cells = rows + n, cells + n * width
            else:
                groups.append([k])
                rows, cells = n, n * width
        perm = [starts[k] + r for k in (k for g in groups for k in g) for r in range(self.buckets[k].num_rows)]
        merged = [self.buckets[g[0]] if len(g) == 1 else _merge([self.buckets[k] for k in g]) for g in groups]
        changed = perm != list(range(len(perm)))
        self.buckets = merged
        return perm if changed else None
