"""`OpenAIServingChat`: `/v1/chat/completions` (vLLM's name): messages rendered with the model's
chat template and run as one engine request, answered whole or streamed as server-sent events (a
role chunk per choice first); chat `echo` starts the reply with the last message when it has the
reply's role. With tool and reasoning parsers (`chat_output.py`) a choice's text becomes
`reasoning_content`, `content` and `tool_calls`, streamed as such."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.chat_messages import as_conversations
from jaxengine.entrypoints.chat_output import ChatOutputParser, ChatParserOptions
from jaxengine.entrypoints.engine_requests import (
  EngineRequests,
  outputs_usage,
  sse_response,
  unless_disconnected,
)
from jaxengine.entrypoints.protocol import ChatCompletionRequest
from jaxengine.entrypoints.serving_engine import OpenAIServing, warn_unknown
from jaxengine.entrypoints.serving_logprobs import chat_logprobs, prompt_logprobs_field
from jaxengine.entrypoints.serving_models import OpenAIServingModels
from jaxengine.entrypoints.serving_token_ids import prompt_token_ids_field, token_ids_field


class OpenAIServingChat(OpenAIServing):
  """The chat completions API's work (`OpenAIServing`'s arguments, and the server's tool and
  reasoning options)."""

  def __init__(self, engine: AsyncLLM, models: OpenAIServingModels,
               parsers: ChatParserOptions | None = None) -> None:  # fmt: skip
    super().__init__(engine, models)
    self.parsers = parsers or ChatParserOptions()

  async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
    lora = self.check_model(body.model)
    warn_unknown(body, "/v1/chat/completions")
    params = body.sampling_params()
    parser = self.parsers.output_parser(body.tools, body.effective_tool_choice())
    prompt = self.truncated(self.render_chat(body), body.truncate_prompt_tokens)
    self.check_context([prompt], params.max_tokens, body.max_tokens_field())
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    header = {"id": request_id, "created": int(time.time()), "model": body.model or self.model_name}
    stream = EngineRequests(self.engine, [prompt], params, request_id, body.stream, "messages",
                            body.constraint_source(), lora)  # fmt: skip
    echoed = chat_echo(body)
    if not body.stream:
      outputs = await unless_disconnected(request, stream.finals())
      choices = []
      for c in outputs[0].outputs:
        message, called = parser.message(c.text)
        if echoed:
          message["content"] = echoed + (message["content"] or "")
        choices.append({"index": c.index, "message": {"role": "assistant", **message},
                        "logprobs": chat_logprobs(c, params.logprobs),
                        "finish_reason": parser.finish_reason(called, c.finish_reason),
                        "stop_reason": c.stop_reason,
                        **token_ids_field(body.return_token_ids, c)})  # fmt: skip
      response = {**header, "object": "chat.completion", "choices": choices}
      prompt_logprobs = prompt_logprobs_field(outputs[0], params.prompt_logprobs)
      return JSONResponse(
        {**response, "usage": outputs_usage(outputs), "prompt_logprobs": prompt_logprobs,
         **prompt_token_ids_field(body.return_token_ids, outputs[0])}
      )  # fmt: skip
    await stream.start()
    return sse_response(
      self._chat_events(stream, header, body, params.n, params.logprobs, echoed, parser)
    )

  async def _chat_events(self, stream, header, body, n: int, num_logprobs, echoed: str,
                         parser: ChatOutputParser) -> AsyncIterator:  # fmt: skip
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
    choices = [parser.stream() for _ in range(n)]
    async for _, output in stream.deltas():
      for c in output.outputs:
        delta = choices[c.index].delta(c.text, final=c.finish_reason is not None)
        logprobs = chat_logprobs(c, num_logprobs)
        token_ids = token_ids_field(body.return_token_ids, c)
        if not delta and c.finish_reason is None and logprobs is None and not token_ids:
          continue  # text held back (it may open a tag): nothing to send yet
        finish_reason = parser.finish_reason(choices[c.index].tools_called, c.finish_reason)
        choice = {"index": c.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                  **token_ids}  # fmt: skip
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
