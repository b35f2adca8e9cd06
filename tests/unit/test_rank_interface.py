"""Every engine the rank process can run implements RankEngine, verb for verb.

The check is structural and on the class (missing_verbs), so it needs neither
a model nor vLLM: VllmCore imports vLLM only when constructed. Where an
instance is cheap (the simulated core, the native core on the demo model),
isinstance against the runtime-checkable protocol is checked as well.
"""

from __future__ import annotations

from dpserve.engine.interface import RankEngine, missing_verbs


def test_missing_verbs_names_what_a_class_lacks():
    class Half:
        on_progress = None

        def step(self):
            return []

    missing = missing_verbs(Half)
    assert "add_request" in missing and "num_running" in missing and "kv_usage" in missing
    assert "step" not in missing and "on_progress" not in missing


def test_native_core_implements_rank_engine(loaded_demo_model):
    from dpserve.engine.common.config import EngineConfig
    from dpserve.engine.core import EngineCore

    assert missing_verbs(EngineCore) == []
    engine = EngineCore.from_loaded(EngineConfig(model=loaded_demo_model.model_dir, max_num_seqs=2), loaded_demo_model)
    assert isinstance(engine, RankEngine)


def test_vllm_core_implements_rank_engine():
    from dpserve.engine.backends.vllm.core import VllmCore

    assert missing_verbs(VllmCore) == []


def test_simulated_core_implements_rank_engine():
    from dpserve.engine.testing.sim import SimConfig, SimCore

    assert missing_verbs(SimCore) == []
    assert isinstance(SimCore(SimConfig(ranks=[0], coordinator_address="ipc:///nowhere", fingerprint="x")), RankEngine)


def test_simulated_core_steps_like_an_engine():
    """The sim's model behind the interface: prefill then one token a step, finishing at max_tokens."""
    from dpserve.engine.common.protocol import FINISH_LENGTH, AddRequest, SamplingParams
    from dpserve.engine.testing.sim import SimConfig, SimCore

    core = SimCore(SimConfig(ranks=[0], coordinator_address="ipc:///nowhere", fingerprint="x", prefill_tokens_per_s=1000.0))
    assert core.add_request(AddRequest("a", [70, 71, 72], SamplingParams(max_tokens=2), 0.0)) is None
    assert core.has_unfinished() and core.num_waiting == 1 and core.num_waiting_prefill_tokens == 3
    first = core.step()  # 10 tokens of prefill budget: the prompt finishes, its first token comes
    assert [(o.request_id, len(o.new_token_ids), o.finish_reason) for o in first] == [("a", 1, None)]
    assert core.num_running == 1 and core.num_remaining_decode_tokens == 1
    last = core.step()
    assert last[0].finish_reason == FINISH_LENGTH and not core.has_unfinished()
