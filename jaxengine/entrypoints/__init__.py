"""Online entry points: the asynchronous engine and the OpenAI-compatible HTTP server.

async_llm.py        `AsyncLLM`: `LLMEngine.step()` in a background thread, outputs streamed to
                    asyncio callers (`async for out in engine.generate(...)`), `abort`, `shutdown`
protocol.py         the server's request bodies (pydantic) and their `SamplingParams`
metrics.py          Prometheus metrics under the `jaxengine:` prefix (vLLM's names)
openai_server.py    the FastAPI app (`/v1/completions`, `/v1/chat/completions`, ...) and
                    `jaxengine serve`

Nothing below `jaxengine.engine` imports this package; FastAPI and uvicorn are imported only by
the server modules.
"""
