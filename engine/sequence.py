"""The state of one request inside the engine, from arrival to its last token.

Owns token bookkeeping, its KV block table and its per-request RNG; it must
never touch tensors of the model (the model runner does) nor the queues (the
scheduler does).
"""

from __future__ import annotations

import enum
import time

import torch
from dpserve.engine.common.protocol import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # in the scheduler's waiting queue; owns no KV blocks
    RUNNING = enum.auto()  # scheduled every step; owns the blocks in block_table
    FINISHED = enum.auto()  # done or aborted; owns nothing, about to be forgotten


class Sequence:
    """One request: its tokens, how far the KV cache has computed them, how to sample more.

    Invariants:
    - token_ids = prompt + outputs; prompt never changes, outputs only grow,
      by at most one token per engine step.
    - num_computed_tokens <= len(token_ids): the KV cache holds keys and
      values of token_ids[:num_computed_tokens], in the slots named by
      block_table (position p lives in block block_table[p // block_size]).
      A preempted sequence drops its blocks and starts again from 0
      (recompute): its outputs so far are kept and prefilled with the prompt.
    - Prefix caching: block_hashes[i] is the key (kv_cache.hash_block chain)
      of full block i of token_ids, computed as far as needed; the first
      num_registered_blocks blocks of block_table are registered in (or
      were attached from) the block manager's cache. num_cached_tokens is
      -1 until the first admission, then how many prompt tokens that
      admission found cached (what the first output reports).
    - A new token is sampled exactly when a step computes the last of token_ids.
    - `generator` is set iff params.seed is set, and only this sequence draws
      from it, so its samples do not depend on what else shares the batch. Its
      state before the draw of output position p is a function of (seed, p) alone
      (seed_for), so the same request moved to another rank mid-answer (a
      continuation) draws the same tokens as it would have where it started.
    """

    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_table",
        "params",
        "arrival_time",
        "status",
        "generator",
        "num_preemptions",
        "has_processors",
        "prompt_logprobs",
        "matcher",
        "block_hashes",
        "num_registered_blocks",
        "num_cached_tokens",
        "t_received",
        "t_scheduled",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        device: torch.device | str = "cpu",
        num_prior_outputs: int = 0,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        # A continuation's last num_prior_outputs ids are outputs it produced on another
        # rank: outputs here too (uncomputed, like a preempted sequence's history).
        self.num_prompt_tokens = len(self.token_ids) - num_prior_outputs
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.params = params
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        # Computed once: the sampler asks every step, for every row.
        self.has_processors = params.has_processors
        # Logprobs of prompt tokens 1.. as their chunks run; only with params.prompt_logprobs.
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
        # The grammar's state (an llguidance LLMatcher) with params.guided_grammar; set by the engine core.
        self.matcher = None
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens = -1
        # Monotonic times of its receipt and first schedule: the first output reports the wait (queue_s).
        self.t_received = time.monotonic()
        self.t_scheduled = 0.0
        # Reseeded before every draw from (seed, output position): see seeded_position.
        self.generator: torch.Generator | None = torch.Generator(device=device) if params.seed is not None else None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last token is uncomputed (a prompt, or a preempted sequence's history)."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still allowed by max_tokens (stop or EOS may end it sooner)."""
        return max(0, self.params.max_tokens - self.num_output_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_min_tokens(self) -> bool:
        """True while EOS and stop tokens are still forbidden by min_tokens."""
        return self.num_output_tokens < self.params.min_tokens

