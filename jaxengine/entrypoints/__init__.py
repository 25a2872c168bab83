"""The front doors: offline `LLM`, the asynchronous engine and the OpenAI-compatible HTTP server.

llm.py                   `LLM`: vLLM's offline API (`generate`, `chat`, `load_weights`, `sleep`)
chat_messages.py         chat messages checked and rendered with the model's chat template
chat_session.py          `jaxengine chat`'s conversation loop: reading a message, the prompt
async_llm.py             `AsyncLLM`: `LLMEngine.step()` in a background thread, outputs streamed to
                         asyncio callers (`async for out in engine.generate(...)`), `abort`,
                         `shutdown`
async_weight_sync.py     `AsyncLLM`'s `pause_generation`, `resume_generation`, `is_paused`,
                         `load_weights` (asynchronous RL's weight sync)
output_mailbox.py        a request's mailbox: its outputs as its output kind shows them
stats.py                 `IterationStats`: what each engine step did, for the stat loggers
protocol.py              the server's request bodies (pydantic) and their `SamplingParams`
metrics.py               Prometheus metrics under the `jaxengine:` prefix (vLLM's names)
serving_models.py        `OpenAIServingModels`: the served model and its LoRA adapters
serving_engine.py        `OpenAIServing`: the endpoints' shared work (model, prompt, chat template)
engine_requests.py       an HTTP request's engine requests: awaited, aborted on disconnect, or
                         streamed as server-sent events
serving_logprobs.py      logprobs in the OpenAI APIs' formats
text_offsets.py          `TextOffsets`: the completions API's `text_offset`
serving_completion.py    `OpenAIServingCompletion`: `/v1/completions`
serving_chat.py          `OpenAIServingChat`: `/v1/chat/completions`
chat_output.py           a chat choice's text as message or deltas: reasoning, content, tool calls
tool_choice.py           `tool_choice` checked against `tools`; the constraint forcing a call
tool_parsers/            tool-call formats (``--tool-call-parser``): hermes, llama3_json,
                         qwen3_coder
reasoning_parsers/       reasoning formats (``--reasoning-parser``): qwen3, deepseek_r1
serving_tokenization.py  `OpenAIServingTokenization`: `/tokenize`, `/detokenize`
openai_server.py         the FastAPI app: routes, API key, error handlers (`build_app`)
serve.py                 `jaxengine serve`

Nothing below `jaxengine.engine` imports this package; FastAPI and uvicorn are imported only by
the server modules.
"""
