"""`--engine vllm`: vLLM's LLMEngine inside a dpserve rank process. Imported only by a rank
that runs it; API servers and the supervisor never import vLLM."""
