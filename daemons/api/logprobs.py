"""Logprobs: the engine's numbers kept per request, and rendered as OpenAI and vLLM show them.

Completions get OpenAI's legacy arrays (tokens, token_logprobs, top_logprobs,
text_offset), chat gets `content` entries with bytes, and prompt_logprobs takes
vLLM's shape. A token is shown as that one token decoded, specials included.
Pure functions over a tokenizer: nothing here sends or waits.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from dpserve.daemons.api.request_state import RequestState
from dpserve.daemons.api.tokenizer import TextTokenizer
from dpserve.engine.common.protocol import RequestOutput, TokenLogprobs


class ScoredRequestState(RequestState):
    """A RequestState that also keeps the logprobs the engine sends, and counts its outputs."""

    __slots__ = ("logprobs", "prompt_logprobs", "num_outputs")

    def __init__(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(request_id, prompt_tokens, max_tokens)
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.num_outputs = 0

    def push(self, out: RequestOutput) -> None:
        # (engine_client delivers every output through RequestState.push)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_outputs += 1
        super().push(out)

    def take_logprobs(self) -> list[TokenLogprobs]:
        got, self.logprobs = self.logprobs, []
        return got

    async def wait_first_output(self) -> None:
        while not self.num_outputs and not self.is_finished:
            self.event.clear()
            await self.event.wait()


class TokenTexts:
    """Each token's text as shown in logprobs, decoded once per tokenizer, mode and id.

    With skip_special (the request's skip_special_tokens) a special token shows as "",
    as it is left out of the text, so echoed text and text_offset agree; with as_ids
    (vLLM's return_tokens_as_token_ids) every token shows as "token_id:N"."""

    _by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = False, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.as_ids = as_ids
        modes = self._by_tokenizer.get(tokenizer)
        if modes is None:
            modes = self._by_tokenizer[tokenizer] = {}
        self.texts: dict[int, str] = modes.setdefault((skip_special, as_ids), {})

    @property
    def with_specials(self) -> TokenTexts:
        """The same, special tokens shown by their text (an echoed prompt's positions, as its text)."""
        if not self.skip_special:
            return self
        return TokenTexts(self.tokenizer, False, self.as_ids)

    def __getitem__(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            if self.as_ids:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode((token_id,), skip_special_tokens=self.skip_special)
            self.texts[token_id] = text
        return text


class Echoed:
    """A position of an echoed prompt: vLLM shows its token with special tokens' text, as
    the echoed text (the prompt's decode) has it, so tokens and text_offset agree with the text."""

    __slots__ = ("pos",)

    def __init__(self, pos: TokenLogprobs | int) -> None:
        self.pos = pos


def chat_logprobs(texts: TokenTexts, positions: Sequence[TokenLogprobs | int], num_top: int) -> dict:
    """Chat's logprobs object: one `content` entry per generated token."""
    content = []
    for pos in positions:
        if isinstance(pos, int):
            continue
        token = texts[pos.token_id]
        # vLLM's order: the chosen token first, then the top ones; num_top entries in all
        ranked = {pos.token_id: pos.logprob, **{i: lp for i, lp in zip(pos.top_ids, pos.top_logprobs) if i != pos.token_id}}
        tops = [
            {"token": (t := texts[i]), "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))}
            for i, lp in list(ranked.items())[:num_top]
        ]
        content.append({"token": token, "logprob": pos.logprob, "bytes": list(token.encode("utf-8", "replace")), "top_logprobs": tops})
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, positions: Sequence[TokenLogprobs | int], num_top: int,
                        offset: int) -> tuple[dict, int]:
    """Completions' logprobs object for these positions, and the text offset after them.
    An int position (an echoed prompt's first token) has no logprob: null. An Echoed
    position shows special tokens by their text."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for pos in positions:
        names = texts
        if type(pos) is Echoed:
            pos, names = pos.pos, texts.with_specials
        token_id = pos if isinstance(pos, int) else pos.token_id
        token = names[token_id]
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if isinstance(pos, int):
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(pos.logprob)
        # vLLM's dict: the chosen token first (even outside the top), then the top alternatives
        tops = {token: pos.logprob}
        for i, lp in zip(pos.top_ids[:num_top], pos.top_logprobs):
            tops.setdefault(names[i], lp)
        top_logprobs.append(tops)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}, offset


def prompt_logprobs(texts: TokenTexts, positions: Sequence[TokenLogprobs] | None) -> list:
    """vLLM's prompt_logprobs: null for the first token, then {id: {logprob, rank, decoded_token}}."""
    out: list = [None]
    for pos in positions or ():
        entry = {str(pos.token_id): {"logprob": pos.logprob, "rank": pos.rank, "decoded_token": texts[pos.token_id]}}
        for rank, (i, lp) in enumerate(zip(pos.top_ids, pos.top_logprobs), start=1):
            entry.setdefault(str(i), {"logprob": lp, "rank": rank, "decoded_token": texts[i]})
        out.append(entry)
    return out
