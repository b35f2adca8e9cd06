"""Picks the next token of every running sequence from one [B, vocab] logits tensor.

Owns temperature / top-k / top-p / min_p / seeded sampling, min_tokens
suppression, and the order in which logits processors apply (vLLM's:
min_tokens -> grammar -> logit_bias -> penalties -> temperature -> min_p -> top-k/top-p).
It must never look at anything but the logits and each row's Sequence, and
never loop over rows except the few that carry their own seed or processors.
"""

from __future__ import annotations

import torch
from dpserve.engine.common.protocol import TokenLogprobs, seed_for
from dpserve.engine.logits_processors import apply_bias_and_penalties, apply_grammar, apply_min_p, token_logprobs
from dpserve.engine.sequence import Sequence

# Top-p alone looks for its nucleus among this many of a row's most likely tokens first.
CANDIDATES = 256
# The draw's running sum goes block by block (inverse_transform).
BLOCK = 256


class Sampler:
    """Batched sampling; greedy rows are exactly argmax of the (processed) logits.

    Unseeded rows draw from one engine-wide generator (seeded from the
    engine config, so a restarted engine replays the same choices); seeded
    rows draw only from their own Sequence.generator.

    Logprobs (for rows that ask) are the log-softmax of the logits after
    min_tokens, logit_bias, penalties and temperature (greedy rows: none),
    before min_p / top-k / top-p truncation, so every alternative has a
    finite value (the distribution the request's processors define).
    """

    def __init__(self, eos_token_ids: frozenset[int], generator: torch.Generator) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.generator = generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token id per row of logits (seqs[i] owns row i), and per row its
        TokenLogprobs or None (the list is None when no row asked)."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        # Upcast like generate() does: bf16 logits would tie too often.
        logits = logits.float()
        copied = False
        if any(s.needs_min_tokens for s in seqs):
            logits = self._suppress_stops(logits.clone(), seqs)
            copied = True
        processed = [i for i, s in enumerate(seqs) if s.has_processors]
        if processed:
            if not copied:
                logits = logits.clone()
            guided = [i for i in processed if seqs[i].matcher is not None]
            if guided:
                apply_grammar(logits, seqs, guided)
            apply_bias_and_penalties(logits, seqs, processed)
        params = [s.params for s in seqs]
        if all(p.is_greedy for p in params):
            tokens = logits.argmax(dim=-1).tolist()
            return tokens, self._logprobs(logits, seqs, tokens)

        device = logits.device
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                             dtype=logits.dtype, device=device)
        scaled = logits / temps.unsqueeze(1)
        logprob_source = scaled

        if any(p.min_p > 0 and not p.is_greedy for p in params):
            scaled = scaled.clone()
            apply_min_p(scaled, seqs)
        truncated = [i for i, p in enumerate(params) if not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0)]
        if truncated:
            picked = torch.zeros(len(seqs), dtype=torch.long, device=device)
            cut = set(truncated)
            plain = [i for i, p in enumerate(params) if not p.is_greedy and i not in cut]
            if plain:
                picked[plain] = self._draw(scaled[plain].softmax(dim=-1), [seqs[i] for i in plain])
            rows = scaled if len(truncated) == len(seqs) else scaled[truncated]
            picked[truncated] = self._draw_truncated(rows, [seqs[i] for i in truncated])
        else:
            picked = self._draw(scaled.softmax(dim=-1), seqs)

        # top_k = 1 is the greedy token exactly (topk orders ties as it likes, argmax by lowest id)
        if any(p.is_greedy or p.top_k == 1 for p in params):
            greedy = torch.tensor([p.is_greedy or p.top_k == 1 for p in params], device=device)
            picked = torch.where(greedy, logits.argmax(dim=-1), picked)
        tokens = picked.tolist()
        return tokens, self._logprobs(logprob_source, seqs, tokens)

    @staticmethod
    def _logprobs(source: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprobs | None] | None:
        """TokenLogprobs for the rows whose request asks; greedy rows' temperature divides by 1."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return None
        found = token_logprobs(
            source[torch.tensor(rows, device=source.device)],
            [tokens[i] for i in rows],
            [seqs[i].params.logprobs for i in rows],
            [seqs[i].params.logprob_token_ids for i in rows],
        )
        out: list[TokenLogprobs | None] = [None] * len(seqs)
        for i, lp in zip(rows, found):
            out[i] = lp
        return out

    def _draw_truncated(self, scaled: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Draw each row among its top_k tokens, then among the most likely ones that cover top_p
        (vLLM's order: top-p renormalises over the top-k set; the most likely token always stays).

        Only the candidates are sorted: a row's top_k, or for top_p alone its CANDIDATES most likely
        tokens, found by topk (a stable sort of a 49k vocabulary costs 2.4-5 ms a row on a CPU, the
        whole draw with top_k 50 ~0.1 ms: benchmarks/RESULTS.md, issue 26 ninth round). A nucleus wider than the candidates
        looks among 16x as many, then sorts the whole row; a row whose most likely token is too
        unlikely for the nucleus to fit (a flat distribution) starts there. Candidates are in
        descending order, so the draw picks what a draw over the fully sorted row would."""
        vocab = scaled.shape[1]
        params = [s.params for s in seqs]
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        wanted = max(k if p.top_k > 0 else min(CANDIDATES, k) for k, p in zip(ks, params))
        whole = torch.tensor([p.top_k == 0 or k >= vocab for p, k in zip(params, ks)], device=scaled.device)
        lse = scaled.logsumexp(dim=-1) if bool(whole.any()) else None
        if lse is not None and wanted < vocab:
            # No token is likelier than the row's most likely one: a nucleus needs at least
            # top_p / p_max of them (a flat row goes straight to the full sort).
            top_p = torch.tensor([p.top_p if w else 0.0 for p, w in zip(params, whole.tolist())], device=scaled.device)
            ratio = (top_p / (scaled.amax(dim=-1) - lse).exp()).nan_to_num(nan=vocab, posinf=vocab)
            needed = int(ratio.max().clamp(max=vocab).ceil())
            while wanted < needed:
                wanted = wanted * 16 if wanted * 16 <= vocab // 4 else vocab
        while True:
            if wanted < vocab:
                values, ids = scaled.topk(wanted, dim=-1)
            else:
                # Stable: among equal logits the lowest id first, as argmax orders them.
                values, ids = scaled.sort(dim=-1, descending=True, stable=True)
            kept, short = self._truncate(values, params, ks, whole, lse, wanted < vocab)
            if short is None:
                break
            # The next width can hold a short row's nucleus only if its mass so far plus that many
            # more tokens, none likelier than its least likely candidate, passes top_p.
            mass, least, top_p = short
            wider = wanted * 16
            if wider > vocab // 4 or bool((mass + (wider - wanted) * least <= top_p).any()):
                wider = vocab
            wanted = wider
        return ids.gather(1, self._draw(kept, seqs).unsqueeze(1)).squeeze(1)

    @staticmethod
    def _truncate(values: torch.Tensor, params: list, ks: list[int], whole: torch.Tensor, lse: torch.Tensor | None,
                  partial: bool):
        """Probabilities (not normalised) over the sorted candidate `values`, zero beyond each row's
        top_k and top_p; and None when the candidates held every token a row could keep, else the
        short rows' (mass of the candidates, least likely candidate's probability, top_p).
        `whole`: the rows normalised over the whole row (no top_k), whose logsumexp `lse` holds;
        `partial`: the candidates are not the whole row (some tokens were left out)."""
        width = values.shape[1]
        if min(ks) < width:
            position = torch.arange(width, device=values.device).unsqueeze(0)
            values = values.masked_fill(position >= torch.tensor(ks, device=values.device).unsqueeze(1), float("-inf"))
        # Normalised over the row's top-k set, or over the whole row when it has no top_k.
        if lse is None:
            norm = values.logsumexp(dim=-1)
        elif bool(whole.all()):
            norm = lse
        else:
            norm = torch.where(whole, lse, values.logsumexp(dim=-1))
        probs = (values - norm.unsqueeze(1)).exp()
        if all(p.top_p >= 1.0 for p in params):
            return probs, None
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
        before = probs.cumsum(dim=-1) - probs
        short = None
        if partial and lse is not None:
            # The first token left out is dropped when the candidates already cover top_p.
            mass = before[:, -1] + probs[:, -1]
            rows = whole & (top_p < 1.0) & ~(mass > top_p)
            if bool(rows.any()):
                short = (mass[rows], probs[rows, -1], top_p[rows])
        return probs.masked_fill(before > top_p.unsqueeze(1), 0.0), short

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Sample one column per row by inverse transform: the first column whose cumulative
        probability passes u x the row's total, for u uniform in [0, 1).

        Exactly multinomial sampling, and one uniform a row, so a seeded row draws a single
        number from its own generator. (The exponential race it replaced drew one Exp(1) a
        column: ~1.2 ms a row over a 49k vocabulary on a CPU, 13x this; benchmarks/RESULTS.md,
        issue 26 eighth round.) The running sum is float64, so rounding cannot move mass
        between tokens, and a zero-probability column (a token the grammar, min_p, top-k or
        top-p ruled out) has zero width: it is never picked, and the check below keeps that
        true whatever the arithmetic does.
        """
        u = torch.rand((probs.shape[0], 1), generator=self.generator, dtype=torch.float64, device=probs.device)
        for row, seq in enumerate(seqs):
            if seq.generator is not None and not seq.params.is_greedy:
                # Position-derived, not a running stream: a continuation on another rank
                # draws what this one would have (Sequence docstring).
                seq.generator.manual_seed(seed_for(seq.params.seed, seq.num_output_tokens))
                u[row] = torch.rand(1, generator=seq.generator, dtype=torch.float64, device=probs.device)
        picked = inverse_transform(probs, u)
        ruled_out = probs.gather(1, picked.unsqueeze(1)).squeeze(1) <= 0
        if bool(ruled_out.any()):
            picked = torch.where(ruled_out, probs.argmax(dim=-1), picked)
        return picked

    def _suppress_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Forbid EOS and stop tokens in rows that have not reached min_tokens yet."""
        rows: list[int] = []
        cols: list[int] = []
        for row, seq in enumerate(seqs):
            if not seq.needs_min_tokens:
                continue
            banned = set(seq.params.stop_token_ids)
            if not seq.params.ignore_eos:
                banned.update(self.eos_token_ids)
            for token in banned:
                if 0 <= token < logits.shape[1]:
                    rows.append(row)
                    cols.append(token)
        if rows:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the first column whose running sum of `probs` (>= 0, any total) passes u x the total.

    In two levels, so the float64 running sum covers BLOCK columns, not the vocabulary: the sums of
    blocks of BLOCK columns (float64, a vectorised reduction), their running sum to find the block,
    then the running sum inside that block alone. (A float64 cumsum of a 49k row is sequential and
    cost ~350 us a row on a CPU, most of a plain draw: benchmarks/RESULTS.md, issue 26 ninth round.)
    Only the order of the float64 additions differs from one running sum over the row."""
    rows, width = probs.shape
    full = width // BLOCK * BLOCK
    parts = []
    if full:
        parts.append(probs[:, :full].reshape(rows, -1, BLOCK).sum(dim=-1, dtype=torch.float64))
    if full < width:
        parts.append(probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64))
    block_cdf = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).cumsum(dim=-1)
    target = u * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * BLOCK + torch.arange(BLOCK, device=probs.device)
    inside = probs.gather(1, cols.clamp(max=width - 1)).masked_fill(cols >= width, 0.0).cumsum(dim=-1, dtype=torch.float64)
    offset = torch.searchsorted(inside, target - before, right=True).clamp_(max=BLOCK - 1)
    return (block * BLOCK + offset).squeeze(1).clamp_(max=width - 1)

