"""vLLM's `vllm.v1.engine` module path (`async_llm`)."""
