"""`OpenAIServingCompletion`: `/v1/completions` (vLLM's name): text or token-id prompts (a list
of them is a batch) run as one engine request each, answered whole or streamed as server-sent
events; `echo` starts each choice with its prompt, its logprobs with the prompt's."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxengine.entrypoints.engine_requests import (
  EngineRequests,
  outputs_usage,
  sse_response,
  unless_disconnected,
)
from jaxengine.entrypoints.protocol import CompletionRequest
from jaxengine.entrypoints.serving_engine import OpenAIServing, warn_unknown
from jaxengine.entrypoints.serving_logprobs import completion_logprobs, prompt_logprobs_field
from jaxengine.entrypoints.serving_token_ids import (
  check_prompt_token_ids,
  prompt_token_ids_field,
  token_ids_field,
)
from jaxengine.entrypoints.text_offsets import TextOffsets
from jaxengine.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
  """The completions API's work (`OpenAIServing`'s arguments)."""

  async def completions(self, body: CompletionRequest, request: Request) -> Response:
    lora = self.check_model(body.model)
    warn_unknown(body, "/v1/completions")
    params = body.sampling_params()
    check_prompt_token_ids(body.prompt, self.engine.vocab_size)
    prompts = [
      self.truncated(self.tokenized(p), body.truncate_prompt_tokens) for p in body.prompts()
    ]
    self.check_context(prompts, params.max_tokens, body.max_tokens_field())
    request_id = f"cmpl-{uuid.uuid4().hex}"
    header = {"id": request_id, "created": int(time.time()), "model": body.model or self.model_name}
    stream = EngineRequests(self.engine, prompts, params, request_id, body.stream, "prompt",
                            body.constraint_source(), lora)  # fmt: skip
    if not body.stream:
      outputs = await unless_disconnected(request, stream.finals())
      k = body.prompt_logprobs if body.prompt_logprobs is not None else params.prompt_logprobs
      choices = [
        {**self.completion_choice(i * params.n + c.index, output, c, body.echo,
                                  self.text_offsets(output, params.skip_special_tokens),
                                  params.logprobs),
         "prompt_logprobs": prompt_logprobs_field(output, k),
         **prompt_token_ids_field(body.return_token_ids, output),
         **token_ids_field(body.return_token_ids, c)}
        for i, output in enumerate(outputs)
        for c in output.outputs
      ]  # fmt: skip
      response = {**header, "object": "text_completion", "choices": choices}
      return JSONResponse({**response, "usage": outputs_usage(outputs)})
    await stream.start()
    return sse_response(self._completion_events(stream, header, body, params.n, params.logprobs))

  async def _completion_events(self, stream, header, body, n: int, num_logprobs) -> AsyncIterator:
    usage = body.stream_options is not None and body.stream_options.include_usage
    chunk = {**header, "object": "text_completion"}
    offsets: dict[int, TextOffsets] = {}
    async for i, output in stream.deltas():
      for c in output.outputs:
        index = i * n + c.index
        first = index not in offsets
        if first:
          offsets[index] = self.text_offsets(output, body.skip_special_tokens)
        choice = self.completion_choice(
          index, output, c, body.echo and first, offsets[index], num_logprobs
        )
        if first:  # vLLM's: the prompt's ids on a choice's first chunk
          choice.update(prompt_token_ids_field(body.return_token_ids, output))
        choice.update(token_ids_field(body.return_token_ids, c))
        yield {**chunk, "choices": [choice], **({"usage": None} if usage else {})}
    if usage:
      yield {**chunk, "choices": [], "usage": stream.usage()}

  def text_offsets(self, output: RequestOutput, skip_special_tokens: bool) -> TextOffsets:
    """A new choice's `text_offset` counter (its completion decodes after `output`'s prompt)."""
    return TextOffsets(self.engine.tokenizer, output.prompt_token_ids, skip_special_tokens)

  def completion_choice(self, index, output: RequestOutput, c: CompletionOutput, echo: bool,
                        offsets: TextOffsets, num_logprobs) -> dict:  # fmt: skip
    """One choice of a completion response or chunk (`offsets` counts through the choice's text,
    across a stream's chunks). With `echo` the text and the logprobs start with the prompt's (its
    first token has no logprob)."""
    prompt = self.prompt_text(output) if echo else ""
    logprobs = None
    if c.logprobs is not None:
      echoed = None
      if echo:
        ids = output.prompt_token_ids
        steps = output.prompt_logprobs or [None] * len(ids)
        prompt_offsets = offsets.prompt_offsets(ids, prompt)
        echoed = completion_logprobs(ids, steps, prompt_offsets, num_logprobs, self.decode)
      completion_offsets = offsets.completion_offsets(c.token_ids, c.text)
      logprobs = completion_logprobs(
        c.token_ids, c.logprobs, completion_offsets, num_logprobs, self.decode
      )
      if echoed is not None:
        logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
    text = prompt + c.text
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
