"""One data-parallel rank: model, KV cache, scheduler, sampler, engine process.

engine/ is the lower layer: it never imports dpserve.daemons. Two things in it
are not about one rank and are shared with the daemons for that reason:
protocol.py (the wire between ranks and daemons, owned by the engine side) and
common/ (process plumbing every dpserve process uses; see its docstring).
"""
