"""The state of one request inside the engine, from admission to its last token.

Owns token bookkeeping and the per-request RNG; it must never touch the KV
cache or the model (the model runner owns rows, the scheduler owns queues).
"""

from __future__ import annotations

import enum

import torch

from .protocol import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # in the scheduler's waiting queue, no KV rows yet
    RUNNING = enum.auto()  # owns one row of the model runner's batch
    FINISHED = enum.auto()  # done or aborted; owns nothing, about to be forgotten


class Sequence:
    """One request: its prompt, the tokens produced so far and how to sample more.

    Invariants: prompt_token_ids never changes; output_token_ids only grows,
    by exactly one token per engine step while RUNNING; `generator` is set
    iff params.seed is set, and only this sequence ever draws from it, so its
    samples do not depend on what else shares the batch.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "params",
        "arrival_time",
        "status",
        "generator",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            # Any int is a valid API seed; torch takes 64 bits, so wrap (-1 -> 2**64 - 1).
            self.generator.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still allowed by max_tokens (stop or EOS may end it sooner)."""
        return max(0, self.params.max_tokens - len(self.output_token_ids))

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_min_tokens(self) -> bool:
        """True while EOS and stop tokens are still forbidden by min_tokens."""
        return len(self.output_token_ids) < self.params.min_tokens
