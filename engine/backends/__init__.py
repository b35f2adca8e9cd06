"""Engines other than the native one, and placements other than a local child:
vllm/ (vLLM's engine behind the RankEngine interface), ray/ (ranks as Ray actors)."""
