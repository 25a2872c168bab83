"""vLLM's module paths under `vllm.v1`, for scripts that import from them
(`jaxengine.v1.engine.async_llm.AsyncLLM`)."""
