"""The engines, and the rank process that runs one.

Top level: the native engine (core.py drives sequence, kv_cache, scheduler,
model_runner, attention, sampler, logits_processors, loader; hf_compat.py
holds its every use of transformers' internals), interface.py, the
RankEngine protocol every engine implements, and memory.py, the KV budget
rule both engines size a CPU cache by. rank/ is the
rank process around any engine; backends/vllm and backends/ray are the other
engine and the other placement; testing/ holds the simulated engine and the
demo model, for tests and benchmarks only.

common/ is shared with the daemons: the wire protocol, config structs,
auth, logs, process helpers, the socket helper. It lives here because the
dependency arrow points one way: daemons import engine, engine never imports
daemons.
"""
