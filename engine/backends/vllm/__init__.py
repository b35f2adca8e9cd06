"""`--engine vllm`: vLLM's LLMEngine inside a dpserve rank process (core.py), fed by
args.py, the plain-Python translation of dpserve's configuration and parameters.
vllm itself is imported only by a rank that runs it; API servers and the
supervisor never import it."""
