"""vLLM's module path `vllm.v1.engine.async_llm`: `AsyncLLM` (`jaxengine.entrypoints.async_llm`)."""

from jaxengine.entrypoints.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
