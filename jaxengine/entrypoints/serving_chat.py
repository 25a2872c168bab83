"""`OpenAIServingChat`: `/v1/chat/completions` (vLLM's name): messages rendered with the model's
chat template and run as one engine request, answered whole or streamed as server-sent events (a
role chunk per choice first); chat `echo` starts the reply with the last message when it has the
reply's role."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxengine.entrypoints.chat_messages import as_conversations
from jaxengine.entrypoints.engine_requests import (
  EngineRequests,
  outputs_usage,
  sse_response,
  unless_disconnected,
)
from jaxengine.entrypoints.protocol import ChatCompletionRequest
from jaxengine.entrypoints.serving_engine import OpenAIServing, warn_unknown
from jaxengine.entrypoints.serving_logprobs import chat_logprobs, prompt_logprobs_field
from jaxengine.entrypoints.serving_token_ids import prompt_token_ids_field, token_ids_field


class OpenAIServingChat(OpenAIServing):
  """The chat completions API's work (`OpenAIServing`'s arguments)."""

  async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
    lora = self.check_model(body.model)
    warn_unknown(body, "/v1/chat/completions")
    params = body.sampling_params()
    prompt = self.truncated(self.render_chat(body), body.truncate_prompt_tokens)
    self.check_context([prompt], params.max_tokens, body.max_tokens_field())
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    header = {"id": request_id, "created": int(time.time()), "model": body.model or self.model_name}
    stream = EngineRequests(self.engine, [prompt], params, request_id, body.stream, "messages",
                            body.constraint_source(), lora)  # fmt: skip
    echoed = chat_echo(body)
    if not body.stream:
      outputs = await unless_disconnected(request, stream.finals())
      choices = [
        {"index": c.index, "message": {"role": "assistant", "content": echoed + c.text},
         "logprobs": chat_logprobs(c, params.logprobs), "finish_reason": c.finish_reason,
         "stop_reason": c.stop_reason, **token_ids_field(body.return_token_ids, c)}
        for c in outputs[0].outputs
      ]  # fmt: skip
      response = {**header, "object": "chat.completion", "choices": choices}
      prompt_logprobs = prompt_logprobs_field(outputs[0], params.prompt_logprobs)
      return JSONResponse(
        {**response, "usage": outputs_usage(outputs), "prompt_logprobs": prompt_logprobs,
         **prompt_token_ids_field(body.return_token_ids, outputs[0])}
      )  # fmt: skip
    await stream.start()
    return sse_response(self._chat_events(stream, header, body, params.n, params.logprobs, echoed))

  async def _chat_events(self, stream, header, body, n: int, num_logprobs,
                         echoed: str) -> AsyncIterator:  # fmt: skip
    usage = {"usage": None} if body.stream_options and body.stream_options.include_usage else {}
    chunk = {**header, "object": "chat.completion.chunk"}
    for index in range(n):
      role = {"role": "assistant", "content": ""}
      choice = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
      prompt_ids = prompt_token_ids_field(body.return_token_ids, stream.firsts[0])
      yield {**chunk, "choices": [choice], **usage, **prompt_ids}
    for index in range(n if echoed else 0):
      choice = {"index": index, "delta": {"content": echoed}, "logprobs": None,
                "finish_reason": None}  # fmt: skip
      yield {**chunk, "choices": [choice], **usage}
    async for _, output in stream.deltas():
      for c in output.outputs:
        choice = {"index": c.index, "delta": {"content": c.text},
                  "logprobs": chat_logprobs(c, num_logprobs),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                  **token_ids_field(body.return_token_ids, c)}  # fmt: skip
        yield {**chunk, "choices": [choice], **usage}
    if usage:
      yield {**chunk, "choices": [], "usage": stream.usage()}


def chat_echo(body: ChatCompletionRequest) -> str:
  """vLLM's chat `echo`: the last message's text, which the reply starts with when that message
  has the reply's role ("assistant", or with add_generation_prompt false the last message's
  own); "" otherwise."""
  if not body.echo:
    return ""
  last = as_conversations(body.messages)[0][-1]
  role = "assistant" if body.add_generation_prompt else last["role"]
  return last["content"] if last["role"] == role else ""
