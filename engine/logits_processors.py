"""Per-row logits processors with vLLM's semantics, and log-probabilities.

Owns logit_bias, repetition / frequency / presence penalties, min_p and the
logprobs a request asks for. Each function touches only the rows it is given
(those whose request asks for it), so a batch of plain requests pays nothing;
none of them may loop over the vocabulary in Python.
"""

from __future__ import annotations

import torch
from dpserve.engine.common.protocol import TokenLogprobs
from dpserve.engine.sequence import Sequence

# JSON has no -inf: a token the processors forbade reports this, as vLLM's server does.
LOGPROB_FLOOR = -9999.0


def apply_bias_and_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """In place, for each row in `rows`: add logit_bias, then vLLM's penalties.

    repetition_penalty (prompt and output tokens): a seen token's positive logit
    is divided by it, a negative one multiplied. frequency_penalty subtracts
    penalty x count of the token in the output; presence_penalty subtracts the
    penalty once if the token is in the output at all.
    """
    vocab = logits.shape[1]
    device = logits.device
    for row in rows:
        p = seqs[row].params
        line = logits[row]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=line.dtype, device=device)
            line.index_add_(0, ids, bias)
        if p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty:
            continue
        output = torch.tensor(seqs[row].output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(line.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(seqs[row].prompt_token_ids, dtype=torch.long, device=device)] = True
            penalized = torch.where(line > 0, line / p.repetition_penalty, line * p.repetition_penalty)
            line.copy_(torch.where(seen, penalized, line))
        if p.frequency_penalty:
            line.sub_(counts * p.frequency_penalty)
        if p.presence_penalty:
            line.sub_((counts > 0).to(line.dtype) * p.presence_penalty)


def apply_min_p(scaled: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place on temperature-scaled logits: drop tokens whose probability is below
    min_p x the most likely token's (vLLM's min_p); rows with min_p 0 are untouched."""
    min_p = torch.tensor([s.params.min_p for s in seqs], dtype=scaled.dtype, device=scaled.device)
    probs = scaled.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    scaled.masked_fill_(probs < threshold, float("-inf"))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int],
                   explicit: list[tuple[int, ...]] | None = None) -> list[TokenLogprobs]:
    """Log-softmax of each row of `logits`: the given token's logprob and rank, and the top num_top[i].

    A row with explicit[i] (vLLM's logprob_token_ids) gets those ids' logprobs, in their
    order, in place of the top ones. Ties among the top alternatives come in no particular order.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(token_ids, dtype=torch.long, device=lp.device).unsqueeze(1)
    chosen_lp = lp.gather(1, chosen)
    ranks = (lp > chosen_lp).sum(dim=1).add_(1).tolist()
    chosen_list = chosen_lp.squeeze(1).clamp_(min=LOGPROB_FLOOR).tolist()
    k = max((n for i, n in enumerate(num_top) if not (explicit and explicit[i])), default=0)
    if k:
        top_lp, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1)
        top_lp_list = top_lp.clamp_(min=LOGPROB_FLOOR).tolist()
        top_id_list = top_ids.tolist()
    out = []
    for i, (token, n) in enumerate(zip(token_ids, num_top)):
        if explicit and explicit[i]:
            ids = list(explicit[i])
            picked = lp[i].index_select(0, torch.tensor(ids, dtype=torch.long, device=lp.device))
            out.append(TokenLogprobs(token, chosen_list[i], ranks[i], ids, picked.clamp_(min=LOGPROB_FLOOR).tolist()))
        elif n:
            out.append(TokenLogprobs(token, chosen_list[i], ranks[i], top_id_list[i][:n], top_lp_list[i][:n]))
        else:
            out.append(TokenLogprobs(token, chosen_list[i], ranks[i], [], []))
    return out


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """In place: forbid every token the row's grammar (Sequence.matcher) does not allow next.

    llguidance fills one 32-bit word per 32 tokens; the words are unpacked here
    in eager torch. Raises ValueError when a row's matcher is in error (the
    sampler's caller then fails that row alone). (llguidance.torch's own apply is torch.compile'd: its first
    call ran the C++ compiler for seconds inside the engine's loop, and a rank
    missed its heartbeats.)
    """
    import llguidance.torch as llg

    vocab = logits.shape[1]
    bitmask = llg.allocate_token_bitmask(len(rows), vocab)
    for k, row in enumerate(rows):
        matcher = seqs[row].matcher
        llg.fill_next_token_bitmask(matcher, bitmask, k)
        if matcher.is_error():  # never sample past a broken grammar: the row's request fails (engine.core)
            raise ValueError(f"the grammar could not be followed: {matcher.get_error()[:400]}")
    allowed = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    masked = logits[index]
    masked.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits[index] = masked
