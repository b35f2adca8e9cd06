"""The CUDA-graph decode (engine/cuda_graphs.py): capture sizes, padding, buffers, and the paged SDPA attention.

On a CPU the graphs are "replayed" by EagerReplayBackend (the captured function
runs again over the same static buffers), so everything but the CUDA graph
itself is checked here: greedy answers through the graph path must equal the
eager engine's and generate()'s in fp32. The tests that capture real CUDA
graphs skip without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from dpserve.engine.common.config import EngineConfig
from dpserve.engine.core import EngineCore
from dpserve.engine.cuda_graphs import DecodeGraphs, EagerReplayBackend, capture_sizes, padded_batch_size
from dpserve.engine.loader import resolve_device
from dpserve.engine.paged_attention import paged_decode, paged_sdpa_decode

from tests.unit import test_engine
from tests.unit.test_engine import Collector, add, engine_shape, random_prompt, request
from tests.unit.test_paged_attention import BS, CASES, D, make_case, padded
from tests.unit.test_paged_attention import reference as attention_reference

reference = test_engine.reference
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
pytestmark = pytest.mark.timeout(300)


def test_capture_sizes_follow_vllms_defaults():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # a full step of max_num_seqs still replays
    assert capture_sizes(1) == [1]
    big = capture_sizes(1024)
    assert big[-1] == 512 and big[big.index(256) + 1] == 272  # every 16 past 256, capped at 512


def test_padded_batch_size():
    sizes = capture_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert padded_batch_size(65, sizes) is None
    with pytest.raises(ValueError):
        padded_batch_size(0, sizes)


@pytest.mark.parametrize("lengths,shared", CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_paged_sdpa_decode_matches_reference(lengths, shared, window):
    query, k_cache, v_cache, tables = make_case(lengths, seed=len(lengths) * 5 + (window or 0), shared=shared)
    lens = torch.tensor(lengths)
    got = paged_sdpa_decode(query, k_cache, v_cache, padded(tables, 8), lens, BS, D**-0.5, window)
    torch.testing.assert_close(got, attention_reference(query, k_cache, v_cache, tables, lengths, D**-0.5, window))
    torch.testing.assert_close(got, paged_decode(query, k_cache, v_cache, padded(tables), lens, BS, D**-0.5, window))


def test_decode_graphs_pad_copy_and_slice():
    """A step of 3 rows replays the size-4 graph: the 4th row repeats the 3rd, block tables are
    zero-padded to the static width, and only the 3 real rows come back."""
    seen = []

    def forward(rows, ids, pos, slots, tables, lengths):
        seen.append((rows, ids.tolist(), pos.tolist(), slots.tolist(), tables.tolist(), lengths.tolist()))
        return (ids * 10 + pos).float().unsqueeze(1).repeat(1, 2)

    graphs = DecodeGraphs(forward, [1, 2, 4], max_blocks=3, device=torch.device("cpu"), backend=EagerReplayBackend())
    graphs.capture()
    assert [s[0] for s in seen] == [4, 2, 1]  # largest first
    seen.clear()
    out = graphs.run(torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3]), torch.tensor([11, 12, 13]),
                     torch.tensor([[1], [2], [3]]), torch.tensor([2, 3, 4]))
    assert seen == [(4, [5, 6, 7, 7], [1, 2, 3, 3], [11, 12, 13, 13], [[1, 0, 0], [2, 0, 0], [3, 0, 0], [3, 0, 0]], [2, 3, 4, 4])]
    assert out.tolist() == [[51.0, 51.0], [62.0, 62.0], [73.0, 73.0]]
    assert graphs.num_replays == 1
    assert graphs.can_run(4, 3) and not graphs.can_run(5, 3) and not graphs.can_run(2, 4)
    with pytest.raises(ValueError):
        graphs.run(*(torch.zeros(5, dtype=torch.long),) * 3, torch.zeros(5, 1, dtype=torch.long), torch.ones(5, dtype=torch.long))


def graph_engine(loaded, max_num_seqs: int = 8, **overrides) -> EngineCore:
    config = EngineConfig(model=loaded.model_dir, device=str(loaded.device), dtype="float32", enforce_eager=True,
                          max_num_seqs=max_num_seqs, **overrides)
    engine = EngineCore.from_loaded(config, loaded)
    engine.runner.enable_decode_graphs(EagerReplayBackend(), max_num_seqs)
    return engine


def test_graph_decode_equals_eager_and_generate(loaded_demo_model, reference):
    """Continuous batching (batch sizes 1-8 as requests finish, padded to 1, 2, 4, 8) and preemption."""
    lengths, budgets = [1, 5, 23, 12, 40, 7, 3, 18], [6, 20, 9, 16, 10, 24, 13, 7]
    reqs = [request(f"r{i}", random_prompt(i, n), max_tokens=m) for i, (n, m) in enumerate(zip(lengths, budgets))]
    got = []
    for graphs in (False, True):
        config = EngineConfig(model=loaded_demo_model.model_dir, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=8)
        engine = graph_engine(loaded_demo_model) if graphs else EngineCore.from_loaded(config, loaded_demo_model)
        add(engine, *reqs)
        got.append(Collector().run(engine))
    assert engine.runner.graphs.num_replays > 0
    assert got[1].tokens == got[0].tokens and got[1].finish == got[0].finish
    for r in reqs:
        assert got[1].tokens[r.request_id] == reference(r.prompt_token_ids, r.params.max_tokens), r.request_id


def test_graph_decode_under_preemption_and_prefix_hits(loaded_demo_model, reference):
    budget = 192 * engine_shape(loaded_demo_model).bytes_per_token  # 12 blocks of 16
    engine = graph_engine(loaded_demo_model, kv_cache_memory_bytes=budget, enable_prefix_caching=True)
    shared = random_prompt(400, 32)
    reqs = [request(f"p{i}", shared + random_prompt(300 + i, 3 + 3 * i), max_tokens=30, ignore_eos=True) for i in range(4)]
    add(engine, *reqs)
    got = Collector().run(engine)
    assert engine.num_preemptions > 0 and engine.num_prefix_hits > 0
    for r in reqs:
        assert got.tokens[r.request_id] == reference(r.prompt_token_ids, 30), r.request_id


def test_device_cuda_without_a_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        assert resolve_device("cuda", 3).index == 3 % torch.cuda.device_count()
        return
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda", 0)
    assert resolve_device("auto", 1) == torch.device("cpu")


@needs_cuda
def test_cuda_graphs_equal_eager_on_the_gpu(demo_model_dir, reference):
    """Real CUDA graphs (CudaGraphBackend via enable_compiled_decode), fp32, greedy."""
    from dpserve.engine.loader import load_model

    loaded = load_model(EngineConfig(model=demo_model_dir, device="cuda", dtype="float32"))
    config = EngineConfig(model=demo_model_dir, device="cuda", dtype="float32", max_num_seqs=8)
    engine = EngineCore.from_loaded(config, loaded)  # the default on CUDA: graphs captured at start
    assert engine.runner.graphs is not None
    reqs = [request(f"g{i}", random_prompt(500 + i, 4 + 5 * i), max_tokens=12) for i in range(5)]
    add(engine, *reqs)
    got = Collector().run(engine)
    assert engine.runner.graphs.num_replays > 0
    for r in reqs:
        assert got.tokens[r.request_id] == reference(r.prompt_token_ids, 12), r.request_id
