"""The engine requests of one HTTP request: started together (one per prompt), awaited whole
(aborted when the client disconnects) or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxengine.entrypoints.async_llm import AsyncLLM, RequestOutputKind
from jaxengine.entrypoints.protocol import RequestError, error_body, field_named, json_dumps
from jaxengine.lora import LoRARequest
from jaxengine.outputs import RequestOutput
from jaxengine.worker.sleep_mode import EngineAsleepError


class EngineRequests:
  """The engine requests of one HTTP request (one per prompt) and their outputs.

  Args:
    engine: the `AsyncLLM`.
    prompts: one request per prompt.
    params: their `SamplingParams`.
    request_id: the HTTP request's id; engine request i is `"{request_id}-{i}"`.
    stream: deltas (True) or the final outputs only.
    prompt_field: the request field an engine `ValueError` about the prompt names.
    constraint_source: where the request's output constraint was given, which an engine
      `ValueError` about `structured_outputs.{kind}` names instead (None: as it is).
    lora_request: the LoRA adapter the request's `model` named, None for the base model.
  """

  def __init__(self, engine: AsyncLLM, prompts: Sequence, params, request_id: str,
               stream: bool, prompt_field: str,
               constraint_source: str | None = None,
               lora_request: LoRARequest | None = None) -> None:  # fmt: skip
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    self.generators = [
      engine.generate(p, params, f"{request_id}-{i}", output_kind=kind, lora_request=lora_request)
      for i, p in enumerate(prompts)
    ]
    self.prompt_field = prompt_field
    self.constraint_source = constraint_source
    self.firsts: list[RequestOutput] = []
    self.prompt_tokens = [0] * len(prompts)
    self.completion_tokens = [0] * len(prompts)

  async def _next_each(self) -> list[RequestOutput]:
    """The next output of every generator; on an error all are closed and it is raised (an
    engine `ValueError` as a 400 `RequestError`, `EngineAsleepError` as a 503)."""
    results = await asyncio.gather(
      *(anext(g) for g in self.generators), return_exceptions=True
    )  # fmt: skip
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
      await self.close()
      error = errors[0]
      if isinstance(error, ValueError) and not isinstance(error, RequestError):
        message = str(error)
        if self.constraint_source is not None:
          message = re.sub(r"^structured_outputs\.\w+", self.constraint_source, message)
        param = field_named(message) or (self.prompt_field if "prompt" in message else None)
        raise RequestError(message, param)
      if isinstance(error, EngineAsleepError):  # POST /sleep: until POST /wake_up
        raise RequestError(str(error), None, 503)
      raise error
    return results  # type: ignore[return-value]

  async def finals(self) -> list[RequestOutput]:
    """Every request's final output (the generators yield nothing else)."""
    outputs = await self._next_each()
    self._count(outputs)
    return outputs

  async def start(self) -> None:
    """Waits for every request's first output, so that a refused request is a 400 before the
    response starts."""
    self.firsts = await self._next_each()

  async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`(prompt index, delta output)` as they come, the first outputs first."""
    pending: dict[asyncio.Future, int] = {}
    try:
      for i, output in enumerate(self.firsts):
        self._count([output], i)
        yield i, output
      pending.update(
        {
          asyncio.ensure_future(anext(g)): i
          for i, (g, first) in enumerate(zip(self.generators, self.firsts))
          if not first.finished
        }
      )
      while pending:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
          i = pending.pop(task)
          output = task.result()
          self._count([output], i)
          yield i, output
          if not output.finished:
            pending[asyncio.ensure_future(anext(self.generators[i]))] = i
    finally:
      for task in pending:
        task.cancel()
      await self.close()

  def _count(self, outputs: list[RequestOutput], start: int = 0) -> None:
    for i, output in enumerate(outputs, start):
      self.prompt_tokens[i] = len(output.prompt_token_ids)
      self.completion_tokens[i] += sum(len(c.token_ids) for c in output.outputs)

  def usage(self) -> dict:
    prompt, completion = sum(self.prompt_tokens), sum(self.completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip

  async def close(self) -> None:
    for generator in self.generators:
      with contextlib.suppress(BaseException):
        await generator.aclose()


def outputs_usage(outputs: list[RequestOutput]) -> dict:
  prompt = sum(len(o.prompt_token_ids) for o in outputs)
  completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}  # fmt: skip


async def unless_disconnected(request: Request, work):
  """Awaits `work`, cancelling it (so its engine requests abort) if the client disconnects."""
  task = asyncio.ensure_future(work)

  async def disconnected() -> None:
    while (await request.receive())["type"] != "http.disconnect":
      pass

  watcher = asyncio.ensure_future(disconnected())
  try:
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    watcher.cancel()
    if not task.done():
      task.cancel()
      with contextlib.suppress(asyncio.CancelledError):
        await task
  if task.cancelled():
    raise RequestError("the client disconnected", None, 499)
  return task.result()


def sse_response(events: AsyncIterator[dict]) -> StreamingResponse:
  """Server-sent events: one `data:` line per chunk, an error chunk if serving fails midway,
  then `data: [DONE]`."""

  async def lines() -> AsyncIterator[str]:
    try:
      async for event in events:
        yield f"data: {json_dumps(event)}\n\n"
    except Exception as error:  # this request fails alone; the stream ends properly
      yield f"data: {json_dumps(error_body(f'{type(error).__name__}: {error}', 500))}\n\n"
    yield "data: [DONE]\n\n"

  return StreamingResponse(lines(), media_type="text/event-stream")
