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

from .loader import LoadedModel


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

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class ModelRunner:
    """Prefill and decode forwards over one growing, shrinking KVBatch.

    Invariant: `batch` row i belongs to the caller's i-th running sequence;
    the caller keeps that true by appending prefilled rows at the end
    (`append`) and naming the survivors when sequences leave (`keep_rows`).
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.device = loaded.device
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache; accept either.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self.batch: KVBatch | None = None

    @property
    def num_rows(self) -> int:
        return 0 if self.batch is None else self.batch.num_rows

    @property
    def num_columns(self) -> int:
        return 0 if self.batch is None else self.batch.num_columns

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

        cache = DynamicCache()
        attention_mask = attention_mask.to(self.device)
        logits = self._forward(
            input_ids.to(self.device), attention_mask, position_ids.to(self.device), cache
        )
        return logits, KVBatch(cache, attention_mask, lengths.to(self.device))

    @torch.inference_mode()
    def decode(self, input_ids: list[int]) -> torch.Tensor:
        """One forward of one new token per row; returns logits [B, vocab]."""
        batch = self.batch
        assert batch is not None and len(input_ids) == batch.num_rows, (len(input_ids), self.num_rows)
        ones = batch.attention_mask.new_ones((batch.num_rows, 1))
        batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
        position_ids = batch.lengths.unsqueeze(1)  # cumsum(mask) - 1 at the new column
        tokens = torch.tensor(input_ids, dtype=torch.long).unsqueeze(1).to(self.device)
        logits = self._forward(tokens, batch.attention_mask, position_ids, batch.cache)
        batch.lengths = batch.lengths + 1
        return logits

    @torch.inference_mode()
    def append(self, new: KVBatch) -> None:
        """Add prefilled rows after the running ones, padding the narrower side on the left."""
        old = self.batch
        if old is None:
            self.batch = new
            return
        width = max(old.num_columns, new.num_columns)
        layers = [
            tuple(torch.cat([_left_pad(a, width, 2), _left_pad(b, width, 2)], dim=0) for a, b in zip(ao, bo))
            for ao, bo in zip(old.layers(), new.layers())
        ]
        mask = torch.cat([_left_pad(old.attention_mask, width, 1), _left_pad(new.attention_mask, width, 1)])
        self.batch = KVBatch(DynamicCache(ddp_cache_data=layers), mask, torch.cat([old.lengths, new.lengths]))

    @torch.inference_mode()
    def keep_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order) and drop columns now padding in every row."""
        batch = self.batch
        if batch is None or rows == list(range(batch.num_rows)):
            return
        if not rows:
            self.batch = None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        lengths = batch.lengths.index_select(0, index)
        start = batch.num_columns - int(lengths.max())  # rows are right-aligned
        layers = [(k[index, :, start:], v[index, :, start:]) for k, v in batch.layers()]
        mask = batch.attention_mask[index, start:]
        self.batch = KVBatch(DynamicCache(ddp_cache_data=layers), mask, lengths)
