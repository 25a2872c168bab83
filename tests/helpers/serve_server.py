"""The OpenAI-compatible server of the serve tests (tests/entrypoints/test_serve*.py): its
requests' constants, `served` (an app under uvicorn in a thread; also the LoRA server's of
tests/lora/test_lora.py), `running_server` (which tests/entrypoints/conftest.py's module fixture
`server` yields from) and the chat client helpers of the tool tests.

One uvicorn server per module on 127.0.0.1 (an ephemeral port, in a thread) serves a random tiny
Llama with a byte-level ChatML tokenizer; 4 rows and max_model_len 128, every step in one shape
(4 rows, 16 tokens: `one_shape`), so that few executables compile (a second module's server reads
them back from the run's compilation cache). The reference outputs come from `LLM.generate` /
`LLM.chat` on the same `LLM` before the server takes its engine over.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from byte_tokenizer import chatml_byte_tokenizer
from step_shapes import one_shape

import jaxengine as je
from jaxengine.entrypoints.async_llm import AsyncLLM, EngineDeadError
from jaxengine.entrypoints.openai_server import build_app
from jaxengine.testing import tiny_llama

MODEL = "tiny"
PROMPTS = ["The quick fox", "Once upon"]  # prompts of one length bucket: fewer compiles
MESSAGES = [{"role": "user", "content": "Say hi."}]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 12}
NUM_CLIENTS = 64
STREAM_PARAMS = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
TOKEN_IDS = {"extra_body": {"return_token_ids": True}}


def client_prompt(i: int) -> str:
  """The prompt of streaming client `i`."""
  return f"client {i}"


@contextlib.contextmanager
def served(app) -> Iterator[str]:
  """Runs the ASGI `app` with uvicorn on 127.0.0.1 (an ephemeral port) in a thread; yields its
  base URL, then stops it."""
  uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
  thread = threading.Thread(target=uv.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not uv.started:
    assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
    time.sleep(0.05)
  port = uv.servers[0].sockets[0].getsockname()[1]
  try:
    yield f"http://127.0.0.1:{port}"
  finally:
    uv.should_exit = True
    thread.join(30)


def running_server() -> Iterator[dict]:
  """Yields the running server: its base URL, `AsyncLLM` and the reference outputs; then stops
  it and checks the engine is shut down."""
  tokenizer = chatml_byte_tokenizer()
  model, _ = tiny_llama(vocab_size=tokenizer.vocab_size)
  llm = je.LLM(
    model, tokenizer=tokenizer, max_num_reqs=4, max_model_len=128, max_num_batched_tokens=16
  )
  one_shape(llm)  # the server's behaviour, not bucket choice, is the point here
  refs = {}
  for name, kwargs in (("greedy", GREEDY), ("seeded", SEEDED)):
    params = je.SamplingParams(**kwargs)
    refs[name] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    refs["chat-" + name] = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
  streams = llm.generate(
    [client_prompt(i) for i in range(NUM_CLIENTS)],
    [je.SamplingParams(seed=i, **STREAM_PARAMS) for i in range(NUM_CLIENTS)],
    use_tqdm=False,
  )
  refs["streams"] = [o.outputs[0].text for o in streams]
  engine = AsyncLLM(llm)
  with served(build_app(engine, MODEL)) as url:
    yield {"url": url, "engine": engine, "refs": refs}
  engine.shutdown()
  assert not engine.is_running
  with pytest.raises(EngineDeadError):
    asyncio.run(anext(engine.generate("hi")))


def chat_through(app, requests):
  """Each of `requests` (keyword dicts) sent to `app` in-process by the async openai client:
  its non-streamed response and its streamed chunks."""

  async def main():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
      client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
      out = []
      for kwargs in requests:
        response = await client.chat.completions.create(model=MODEL, **kwargs)
        stream = await client.chat.completions.create(model=MODEL, stream=True, **kwargs)
        out.append((response, [chunk async for chunk in stream]))
      return out

  return asyncio.run(main())


def streamed_message(chunks):
  """The streamed choice's message (content, reasoning_content, tool calls by index) and its
  finish_reason, as a client accumulates them."""
  content, reasoning, calls = "", "", {}
  for chunk in chunks:
    delta = chunk.choices[0].delta
    content += delta.content or ""
    reasoning += getattr(delta, "reasoning_content", None) or ""
    for call in delta.tool_calls or ():
      if call.index not in calls:  # the first delta of a call: its id and name
        assert call.id.startswith("chatcmpl-tool-") and call.function.name
        calls[call.index] = [call.function.name, call.function.arguments]
      else:
        assert call.id is None and call.function.name is None
        calls[call.index][1] += call.function.arguments
  return (
    content or None,
    reasoning or None,
    [calls[i] for i in sorted(calls)],
    [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
  )


def response_message(response):
  """The choice's message (content, reasoning_content, tool calls) and finish_reason, as
  `streamed_message` gives them."""
  message = response.choices[0].message
  calls = [[c.function.name, c.function.arguments] for c in message.tool_calls or ()]
  reasoning = getattr(message, "reasoning_content", None)
  return message.content, reasoning, calls, [response.choices[0].finish_reason]
