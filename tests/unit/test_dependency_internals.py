"""The undocumented parts of our dependencies that dpserve relies on, each checked by
name so that an upgrade which drops one fails here with a clear message (pyproject.toml
pins upper bounds; raise them only with this file green).

aiohttp: every use lives in daemons/aiohttp_compat.py (its docstring says what each
internal is and why); each has a test below, and the round trips run the real code
on loopback. transformers: every use lives in engine/hf_compat.py (registering the
paged attention, a module's layer_idx, the SDPA fallback outside an engine step, reading
a refused attention implementation from the error's text, undoing the `kernels` package's
dispatch around forwards); each has a test below.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket

import pytest
from aiohttp import web

AIOHTTP_HINT = "aiohttp changed an internal that dpserve uses (daemons/aiohttp_compat.py)"


class _Log:
    def warning(self, *args, **kwargs) -> None:
        pass


def test_aiohttp_defers_headers_through_the_class_switch_we_set():
    """aiohttp_compat.EventStream sets StreamResponse._send_headers_immediately = False so an
    SSE response's headers leave with its first event (one write, not two). aiohttp has
    no public switch; if it drops this one, ours silently does nothing."""
    assert getattr(web.StreamResponse, "_send_headers_immediately", None) is True, (
        f"{AIOHTTP_HINT}: StreamResponse._send_headers_immediately is gone")
    assert "self._send_headers_immediately" in inspect.getsource(web.StreamResponse), (
        f"{AIOHTTP_HINT}: StreamResponse no longer reads _send_headers_immediately")
    from dpserve.daemons.aiohttp_compat import EventStream

    assert EventStream._send_headers_immediately is False


def test_aiohttp_runner_hook_and_handler_slots_exist():
    """JsonErrorRunner overrides AppRunner._make_server; handler_subclass relies on
    RequestHandler's __slots__; answer_requests_with and cap_keepalive set two of them;
    json_error_handler_class overrides handle_error(request, status, exc, message)."""
    make_server = getattr(web.AppRunner, "_make_server", None)
    assert make_server is not None and inspect.iscoroutinefunction(make_server), (
        f"{AIOHTTP_HINT}: web.AppRunner._make_server is gone or no longer a coroutine")
    slots = getattr(web.RequestHandler, "__slots__", None)
    assert slots is not None, f"{AIOHTTP_HINT}: RequestHandler has no __slots__ (class swap relies on them)"
    for name in ("_request_handler", "_keepalive_timeout"):
        assert name in slots, f"{AIOHTTP_HINT}: RequestHandler.{name} is gone"
    params = list(inspect.signature(web.RequestHandler.handle_error).parameters)
    assert params[:5] == ["self", "request", "status", "exc", "message"], (
        f"{AIOHTTP_HINT}: RequestHandler.handle_error takes {params}")


def test_aiohttp_http_processing_error_carries_the_parser_message():
    """server.py shows HttpProcessingError.message in a 400 (aiohttp_compat re-exports it)."""
    from dpserve.daemons.aiohttp_compat import HttpProcessingError

    assert HttpProcessingError(message="bad line").message == "bad line", (
        f"{AIOHTTP_HINT}: aiohttp.http_exceptions.HttpProcessingError lost its message")


def _request(port: int, raw: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(raw)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def _serve(runner: web.AppRunner) -> int:
    """Start `runner` on a public SockSite over a loopback socket; its port."""
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    site = web.SockSite(runner, sock)
    await site.start()
    port = runner.addresses[0][1]  # the public way (health.py) to learn a bound port
    assert port == sock.getsockname()[1], f"{AIOHTTP_HINT}: runner.addresses does not list the site's socket"
    return port


def _ok_app() -> web.Application:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/ok", ok)
    return app


GET = b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def test_guarded_runner_caps_connections_and_answers_bad_http_in_json():
    """ApiAppRunner on a public SockSite: over the cap a request gets the guard's 503,
    a malformed request line gets OpenAI-style JSON, and under the cap it is served."""
    from dpserve.daemons.api.http_limits import ConnectionGuard
    from dpserve.daemons.api.server import ApiAppRunner

    async def main() -> None:
        guard = ConnectionGuard(1, 8, b'{"error": {"message": "busy"}}', _Log())
        runner = ApiAppRunner(_ok_app(), guard, access_log=None)
        port = await _serve(runner)
        try:
            assert await asyncio.to_thread(_request, port, GET) == (200, {"ok": True})
            status, body = await asyncio.to_thread(_request, port, b"NOT HTTP AT ALL\r\n\r\n")
            assert status == 400 and body["error"]["type"] == "invalid_request_error", body
            assert body["error"]["message"].startswith("Bad request: "), body  # HttpProcessingError.message
            holder = socket.create_connection(("127.0.0.1", port))  # takes the one slot
            try:
                for _ in range(100):
                    if guard.open:
                        break
                    await asyncio.sleep(0.01)
                assert await asyncio.to_thread(_request, port, GET) == (503, {"error": {"message": "busy"}})
                assert guard.num_rejected_total == 1
            finally:
                holder.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_adopted_connections_can_be_answered_elsewhere_and_capped():
    """answer_requests_with and cap_keepalive on each handler a JsonErrorRunner adopts:
    every request goes to the other handler, and an idle connection closes early."""
    from dpserve.daemons.aiohttp_compat import JsonErrorRunner, answer_requests_with, cap_keepalive

    async def elsewhere(request: web.BaseRequest) -> web.Response:
        return web.json_response({"elsewhere": True}, status=503)

    def adopt(handler: web.RequestHandler) -> None:
        answer_requests_with(handler, elsewhere)
        cap_keepalive(handler, 0.2)

    def answer(request, status, exc, message) -> web.Response:
        return web.json_response({"status": status}, status=status)

    async def main() -> None:
        runner = JsonErrorRunner(_ok_app(), answer, adopt, access_log=None, keepalive_timeout=30)
        port = await _serve(runner)
        try:
            assert await asyncio.to_thread(_request, port, GET) == (503, {"elsewhere": True})
            with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
                loop = asyncio.get_running_loop()
                started = loop.time()
                assert await asyncio.to_thread(idle.recv, 1) == b""  # closed by the server, not by us
                assert loop.time() - started < 10, f"{AIOHTTP_HINT}: _keepalive_timeout no longer closes an idle connection"
        finally:
            await runner.cleanup()

    asyncio.run(main())


TRANSFORMERS_HINT = "transformers changed an internal that the engine uses (engine/hf_compat.py)"


def _tiny_llama(num_layers: int = 3):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=num_layers,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def test_transformers_attention_registration():
    """hf_compat.register_attention makes the paged attention the one a model loaded under its name calls."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as exc:
        pytest.fail(f"{TRANSFORMERS_HINT}: {exc}")
    from dpserve.engine.attention import paged_attention, register

    name = register()
    assert ALL_ATTENTION_FUNCTIONS[name] is paged_attention, (
        f"{TRANSFORMERS_HINT}: AttentionInterface.register no longer makes {name!r} known to models")


def test_transformers_attention_modules_carry_their_layer_index():
    """hf_compat.layer_index: every attention call of a forward comes from a module whose
    index is its layer's, in order (the paged cache's tensors are found by it)."""
    import torch
    from dpserve.engine import hf_compat
    from transformers import AutoModelForCausalLM

    seen: list[int] = []

    def recording(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        try:
            seen.append(hf_compat.layer_index(module))
        except AttributeError as exc:
            pytest.fail(f"{TRANSFORMERS_HINT}: attention modules lost layer_idx ({exc})")
        return hf_compat.sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    hf_compat.register_attention("dpserve_test_recording", recording)
    model = AutoModelForCausalLM.from_config(_tiny_llama(3), attn_implementation="dpserve_test_recording")
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert seen == [0, 1, 2], f"{TRANSFORMERS_HINT}: layer_idx is not the layer's index: {seen}"


def test_transformers_decoder_blocks_and_attention_modules_are_found():
    """hf_compat.decoder_layers / attention_modules (the compiled decode compiles the repeated
    blocks and hands each attention module its cache): one block and one attention per layer."""
    from dpserve.engine import hf_compat
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_tiny_llama(3))
    blocks, attention = hf_compat.decoder_layers(model), hf_compat.attention_modules(model)
    assert len(blocks) == 3 and len({type(b) for b in blocks}) == 1, f"{TRANSFORMERS_HINT}: decoder blocks {blocks}"
    assert [hf_compat.layer_index(m) for m in attention] == [0, 1, 2], f"{TRANSFORMERS_HINT}: attention {attention}"
    assert all(any(m is a for a in b.modules()) for m, b in zip(attention, blocks)), TRANSFORMERS_HINT


def _kernels_code(model) -> list[str]:
    return sorted({type(m).__qualname__ for m in model.modules()
                   if getattr(type(m).forward, "__globals__", {}).get("__name__", "").startswith("kernels.")})


def test_transformers_models_run_their_own_forwards_not_the_kernels_dispatch():
    """hf_compat.without_hub_kernel_wrappers: with `kernels` installed (transformers 5.25 requires
    it), no module of a loaded model runs kernels' dispatch (the compiled decode could not save it),
    and the answers are the model's own."""
    import torch
    from dpserve.engine import hf_compat
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_llama(2), attn_implementation="sdpa").eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        hf_compat.without_hub_kernel_wrappers(model)
        after = model(input_ids=ids).logits
    assert _kernels_code(model) == [], f"{TRANSFORMERS_HINT}: kernels' dispatch still wraps {_kernels_code(model)}"
    assert torch.equal(before, after)


def test_kernels_use_kernelized_func_wrapper_is_recognised_and_undone():
    """The wrapper's shape as kernels builds it (its code under kernels.*, the original as
    __wrapped__), on a class of our own: recognised, put back on the class, same answer."""
    kernels = pytest.importorskip("kernels")
    import torch
    from dpserve.engine import hf_compat

    @kernels.use_kernel_forward_from_hub("DpserveTestDouble")
    def double(x):
        return 2 * x

    @kernels.use_kernelized_func(double)
    class Doubler(torch.nn.Module):
        def forward(self, x):
            return double(x) + 1

    model = torch.nn.Sequential(Doubler())
    assert _kernels_code(model) == ["test_kernels_use_kernelized_func_wrapper_is_recognised_and_undone.<locals>.Doubler"], (
        "kernels changed how use_kernelized_func wraps a forward (engine/hf_compat.py)")
    assert hf_compat.without_hub_kernel_wrappers(model) == [Doubler.__qualname__]
    assert _kernels_code(model) == [] and "_kernel_funcs" not in Doubler.forward.__code__.co_names
    assert model(torch.tensor([3.0])).item() == 7.0


def test_transformers_sdpa_fallback_is_causal_attention():
    """hf_compat.sdpa_attention (transformers.integrations.sdpa_attention) computes plain
    causal attention for an unpadded batch, as the paged path does outside a step."""
    import torch
    import torch.nn.functional as F
    from dpserve.engine import hf_compat

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    try:
        out, _ = hf_compat.sdpa_attention(module, q, k, v, None, 0.0, 8 ** -0.5)
    except (ImportError, TypeError) as exc:
        pytest.fail(f"{TRANSFORMERS_HINT}: {exc}")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8 ** -0.5).transpose(1, 2)
    assert torch.allclose(out, want, atol=1e-6), f"{TRANSFORMERS_HINT}: sdpa_attention_forward changed its result or layout"


def test_transformers_refusing_an_attention_implementation_is_recognised():
    """hf_compat.is_attention_refusal reads transformers' refusal from its text; the loader
    turns it into "this architecture does not route attention through the interface"."""
    from dpserve.engine import hf_compat
    from transformers import AutoModelForCausalLM

    with pytest.raises((ValueError, ImportError)) as info:
        AutoModelForCausalLM.from_config(_tiny_llama(1), attn_implementation="dpserve_no_such_attention")
    assert hf_compat.is_attention_refusal(info.value), f"{TRANSFORMERS_HINT}: the refusal now reads {info.value}"
    assert not hf_compat.is_attention_refusal(ValueError("config.json is not valid JSON"))


def test_tokenizers_decode_stream_takes_a_prefill_and_lists(tmp_path):
    """daemons/tokenizer.py primes DecodeStream with the prompt's tail (ids=...) and steps
    it with one id or a list (tokenizers 0.22+)."""
    from dpserve.engine.testing.demo_model import write_tokenizer
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tok = Tokenizer.from_file(write_tokenizer(str(tmp_path), "metaspace") + "/tokenizer.json")
    prompt, output = tok.encode("Hello").ids, tok.encode(" world and more", add_special_tokens=False).ids
    try:
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        assert stream.step(tok, output[0]) == " world"
        assert stream.step(tok, output[1:]) == tok.decode(prompt + output)[len("Hello world"):]
    except TypeError as exc:
        pytest.fail(f"tokenizers' DecodeStream lacks the prefill or list step dpserve uses: {exc}")
