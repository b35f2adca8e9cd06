"""Output text through a real node, for both tokenizer families (byte-level BPE and
SentencePiece-style Metaspace), streamed and whole, with stop strings.

The expected text is what transformers gives: its own tokenizer's
decode(prompt + output) minus decode(prompt), with the output ids from transformers'
greedy generate (which the engine reproduces token for token, see test_api).
A Metaspace decoder drops the space before a text's first token, so an answer
decoded alone loses its leading space ('world' for ' world').
"""

from __future__ import annotations

import pytest

from tests.server import DpServer

pytestmark = pytest.mark.slow

PROMPTS = ["Hello", "The quick brown fox", "data parallel serving with many ranks", "Water light music"]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def family(request, demo_model_dir, metaspace_model_dir):
    """(model dir, running DP=1 node, expected texts) for one tokenizer family."""
    model_dir = demo_model_dir if request.param == "bytelevel" else metaspace_model_dir
    expected = _expected_texts(model_dir)
    # float32 as the expected texts' generate(): --dtype auto is bfloat16 on CPUs with avx512_bf16
    srv = DpServer(model_dir, "--data-parallel-size", "1", "--api-server-count", "1", "--max-model-len", "256", "--dtype", "float32")
    try:
        srv.start()
        yield request.param, srv, expected
    finally:
        srv.stop()


def _expected_texts(model_dir: str) -> list[tuple[str, str]]:
    """(text as transformers continues the prompt, the output decoded alone) per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos
    texts = []
    for prompt in PROMPTS:
        ids = hf(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
        prompt_ids, output_ids = ids[0].tolist(), out[0, ids.shape[1]:].tolist()
        head = hf.decode(prompt_ids, skip_special_tokens=True)
        texts.append((hf.decode(prompt_ids + output_ids, skip_special_tokens=True)[len(head):],
                      hf.decode(output_ids, skip_special_tokens=True)))
    return texts


def _client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(client, prompt: str, stream: bool, stop: list[str] | None = None) -> tuple[str, str]:
    args = dict(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=stop,
                extra_body={"ignore_eos": True})
    if not stream:
        choice = client.completions.create(**args).choices[0]
        return choice.text, choice.finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


def test_premise_metaspace_answers_differ_from_their_lone_decode(family):
    """Without this the tests below could not tell prompt-aware decoding from lone decoding."""
    name, _, expected = family
    differs = [cont != alone for cont, alone in expected]
    assert any(differs) == (name == "metaspace"), expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_is_the_continuation_of_the_prompt(family, stream):
    _, srv, expected = family
    with _client(srv) as client:
        for prompt, (text, _) in zip(PROMPTS, expected):
            assert _complete(client, prompt, stream) == (text, "length"), prompt


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_across_token_boundaries_never_leak(family, stream):
    """A stop string taken from the middle of the expected text (so it spans tokens; for
    Metaspace it may start with the leading space only the prompt gives) cuts the text
    just before it, streamed and whole alike; a stop that never occurs changes nothing."""
    _, srv, expected = family
    with _client(srv) as client:
        for prompt, (text, _) in zip(PROMPTS, expected):
            for start in (0, len(text) // 3, len(text) // 2):
                stop = text[start:start + 3]
                if len(stop) < 3:
                    continue
                cut = text[:text.find(stop)]
                got, reason = _complete(client, prompt, stream, stop=[stop, "\u0000never"])
                assert (got, reason) == (cut, "stop"), (prompt, stop)
                assert stop not in got
            assert _complete(client, prompt, stream, stop=["\u0000never"]) == (text, "length")
