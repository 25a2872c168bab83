"""An OpenAI-compatible HTTP server on an `AsyncLLM` (FastAPI; `jaxengine serve` runs it).

  POST /v1/completions        text or token-id prompts (a list of them is a batch); streamed as
                              server-sent events with `"stream": true`
  POST /v1/chat/completions   messages rendered by the model's chat template; streamed likewise
  GET  /v1/models             the served model
  GET  /health                200 while the engine thread runs, else 503
  GET  /metrics               Prometheus text (`entrypoints/metrics.py`)
  POST /tokenize, /detokenize

Bad input is a 400 with OpenAI's error body naming the field (a malformed body, a wrong type
(strict: a JSON boolean is no count, 1 or "yes" no boolean), a value `SamplingParams` refuses, a
prompt of `max_model_len` tokens or more, a prompt plus `max_tokens` past `max_model_len`,
`stream_options` without `stream`, `prompt_logprobs` with `stream`, a `best_of` other than `n`,
an invalid output constraint (named as sent: `response_format`, `guided_json`, ...), a field
this server does not implement set to change the output: `use_beam_search` true, a non-empty
`suffix`, `tools` unless `tool_choice` is "none", `functions` unless `function_call` is "none"),
an unknown model a 404, and a missing or wrong API key (with `api_key` set) a 401 on `/v1/*`,
`/tokenize` and `/detokenize`. Fields the server does not know are ignored (vLLM's behaviour),
with one warning per request naming them. vLLM's `guided_json`, `guided_regex`, `guided_choice`
and `guided_grammar` are `structured_outputs`' `json`, `regex`, `choice`, `grammar`;
`truncate_prompt_tokens=k` keeps the prompt's last k tokens (-1: `max_model_len`); chat `echo`
starts the reply with the last message when it has the reply's role. With `tool_choice` "none"
the tools are left out of the prompt. A client that
disconnects aborts its requests (streamed or not): their rows are freed at the next step
boundary. An error while serving one request fails that request alone.

Logprobs follow vLLM: `prompt_logprobs=k` adds `prompt_logprobs` to each completion choice (to
the chat response itself), one entry per prompt token, the first null, the others
`{str(token id): {"logprob", "rank", "decoded_token"}}`; `echo` with `logprobs` (completions)
lists the prompt's tokens before the completion's, the first with null logprob and top dict,
`text_offset` counting through the echoed text: a token's offset is the length of the text the
tokens before it decode to (a character split over several tokens starts where it starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from jaxengine.chat_messages import as_conversations, render_prompts
from jaxengine.entrypoints.async_llm import AsyncLLM, RequestOutputKind
from jaxengine.entrypoints.metrics import ServerMetrics
from jaxengine.entrypoints.protocol import (
  ChatCompletionRequest,
  CompletionRequest,
  DetokenizeRequest,
  LoadLoRAAdapterRequest,
  RequestError,
  TokenizeRequest,
  UnloadLoRAAdapterRequest,
  error_body,
  field_named,
  json_dumps,
)
from jaxengine.lora import LoRAModulePath, LoRARequest, load_peft_adapter
from jaxengine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxengine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

#: Logprobs below this (including -inf) are reported as it: JSON has no infinities (vLLM's value).
MIN_LOGPROB = -9999.0


def _error_response(error: RequestError) -> JSONResponse:
  body = error_body(str(error), error.status_code, error.param)
  return JSONResponse(body, status_code=error.status_code)


def _validation_error(error: RequestValidationError) -> RequestError:
  """The first pydantic error as a `RequestError` naming the field (or the malformed JSON)."""
  first = error.errors()[0]
  loc = [str(part) for part in first.get("loc", ()) if part != "body"]
  if first.get("type") == "json_invalid":
    return RequestError(f"malformed JSON body: {first.get('msg')}", None)
  field = ".".join(loc) or None
  return RequestError(f"{field or 'body'}: {first.get('msg')}", loc[0] if loc else None)


class _ApiKeyMiddleware:
  """Answers 401 to `/v1/*`, `/tokenize` and `/detokenize` requests without the bearer token."""

  def __init__(self, app, api_key: str) -> None:
    self.app = app
    self.expected = f"Bearer {api_key}".encode()

  async def __call__(self, scope, receive, send) -> None:
    path = scope.get("path", "")
    if scope["type"] == "http" and (path.startswith("/v1") or path in _KEYED_PATHS):
      given = dict(scope["headers"]).get(b"authorization", b"")
      if not secrets.compare_digest(given, self.expected):
        response = _error_response(
          RequestError("missing or wrong API key (Authorization: Bearer KEY)", None, 401)
        )
        await response(scope, receive, send)
        return
    await self.app(scope, receive, send)


_KEYED_PATHS = ("/tokenize", "/detokenize")


def build_app(
  engine: AsyncLLM,
  served_model_name: str,
  api_key: str | None = None,
  lora_modules: Mapping[str, str] | Iterable[LoRAModulePath] | None = None,
) -> FastAPI:
  """The FastAPI app serving `engine` as the model `served_model_name`.

  Args:
    engine: a running `AsyncLLM`; its stat loggers gain the app's `ServerMetrics`.
    served_model_name: the `model` requests name (an absent `model` field means this one).
    api_key: when set, requests to `/v1/*`, `/tokenize` and `/detokenize` need
      ``Authorization: Bearer API_KEY``.
    lora_modules: LoRA adapters served from the start (an engine with `enable_lora`),
      ``{name: PEFT directory}`` or `LoRAModulePath`s (``--lora-modules``; a `base_model_name`
      is the adapter's `parent` in `/v1/models`): a request's `model` picks one by name;
      `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` add and remove adapters at run time.

  Raises:
    ValueError: a LoRA module without `enable_lora`, named twice or as the base model, or a
      directory `jaxengine.lora.load_peft_adapter` refuses.
  """
  app = FastAPI(title="jaxengine", docs_url=None, redoc_url=None)
  serving = _Serving(engine, served_model_name)
  modules = lora_modules or ()
  for module in modules.items() if isinstance(modules, Mapping) else modules:
    serving.add_lora(*module)
  engine.stat_loggers.append(serving.metrics.record)
  app.state.serving = serving
  if api_key:
    app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

  @app.exception_handler(RequestValidationError)
  async def on_validation_error(request: Request, error: RequestValidationError):
    return _error_response(_validation_error(error))

  @app.exception_handler(RequestError)
  async def on_request_error(request: Request, error: RequestError):
    return _error_response(error)

  @app.exception_handler(Exception)
  async def on_error(request: Request, error: Exception):
    body = error_body(f"{type(error).__name__}: {error}", 500)
    return JSONResponse(body, status_code=500)

  @app.get("/health")
  async def health() -> Response:
    return Response(status_code=200 if engine.is_running else 503)

  @app.get("/metrics")
  async def metrics() -> Response:
    return Response(serving.metrics.exposition(), media_type="text/plain; version=0.0.4")

  @app.get("/v1/models")
  async def models() -> dict:
    card = {"id": served_model_name, "object": "model", "created": serving.created,
            "owned_by": "jaxengine", "root": served_model_name,
            "max_model_len": engine.max_model_len}  # fmt: skip
    adapters = [
      {
        **card,
        "id": name,
        "root": str(lora.lora_path),
        "parent": lora.base_model_name or served_model_name,
      }
      for name, lora in serving.lora_modules.items()
    ]
    return {"object": "list", "data": [card, *adapters]}

  @app.post("/v1/load_lora_adapter")
  async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
    serving.add_lora(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

  @app.post("/v1/unload_lora_adapter")
  async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
    serving.remove_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: Request) -> Response:
    return await serving.completions(body, request)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await serving.chat_completions(body, request)

  @app.post("/tokenize")
  async def tokenize(body: TokenizeRequest) -> dict:
    return serving.tokenize(body)

  @app.post("/detokenize")
  async def detokenize(body: DetokenizeRequest) -> dict:
    return serving.detokenize(body)

  return app


class _Serving:
  """The endpoints' work, apart from the routing."""

  def __init__(self, engine: AsyncLLM, model_name: str) -> None:
    self.engine = engine
    self.model_name = model_name
    self.created = int(time.time())
    self.metrics = ServerMetrics(model_name, engine.engine)
    #: The served LoRA adapters by name (`add_lora`).
    self.lora_modules: dict[str, LoRARequest] = {}
    self._lora_ids = itertools.count(1)

  def check_model(self, model: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model); 404 for another name."""
    if model is None or model == self.model_name:
      return None
    lora = self.lora_modules.get(model)
    if lora is None:
      raise RequestError(f"The model `{model}` does not exist.", "model", 404)
    return lora

  def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
    """Serves the PEFT adapter at `path` as model `name` (checked here, on the host; read
    into the engine's cache by its first request). 400 (`RequestError`) when refused."""
    manager = self.engine.engine.runner.lora
    if manager is None:
      raise RequestError("LoRA adapters need an engine with enable_lora=True", "lora_name")
    if name == self.model_name or name in self.lora_modules:
      raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    lora = LoRARequest(name, next(self._lora_ids), path, base_model_name)
    try:
      load_peft_adapter(
        path,
        lora.lora_int_id,
        max_lora_rank=manager.max_lora_rank,
        num_layers=manager.num_layers,
        target_shapes=manager.target_shapes,
      )
    except ValueError as error:
      raise RequestError(str(error), "lora_path") from None
    self.lora_modules[name] = lora
    return lora

  def remove_lora(self, name: str) -> None:
    """Stops serving adapter `name` (running requests finish with it); 404 if unknown."""
    if self.lora_modules.pop(name, None) is None:
      raise RequestError(f"The lora adapter '{name}' cannot be found.", "lora_name", 404)

  # --- completions ----------------------------------------------------------------------------

  def tokenized(self, prompt: str | list[int]) -> dict | list[int] | str:
    """A text prompt as a prompt dict with its token ids (as the engine would tokenize it, so
    that it is not tokenized twice); token ids, or text without a tokenizer, as they are."""
    tokenizer = self.engine.tokenizer
    if isinstance(prompt, str) and tokenizer is not None:
      return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}
    return prompt

  def truncated(self, prompt: dict | list[int] | str, keep: int | None) -> dict | list[int] | str:
    """`prompt` cut to its last `keep` tokens (vLLM's `truncate_prompt_tokens`; -1 keeps
    `max_model_len`); its text is dropped then, so that an echo shows the tokens kept.

    Raises:
      RequestError: naming `truncate_prompt_tokens`, for a `keep` above `max_model_len` or a
        text prompt without a tokenizer.
    """
    if keep is None:
      return prompt
    max_model_len = self.engine.max_model_len
    if keep > max_model_len:
      raise RequestError(
        f"truncate_prompt_tokens={keep} is more than max_model_len={max_model_len}",
        "truncate_prompt_tokens",
      )
    if isinstance(prompt, str):
      raise RequestError(
        "truncate_prompt_tokens needs a tokenizer for text prompts", "truncate_prompt_tokens"
      )
    ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
    return {"prompt_token_ids": list(ids[-(max_model_len if keep == -1 else keep) :])}

  def check_context(self, prompts: Sequence, max_tokens: int | None, field: str) -> None:
    """Refuses (vLLM's 400) a request whose prompt plus `max_tokens` exceeds `max_model_len`.

    A prompt that alone leaves no room is left to the engine, whose error says so; prompts
    given as text without a tokenizer are not counted here.

    Raises:
      RequestError: naming `field` (the request's max_tokens field), the context length and
        the tokens requested.
    """
    if max_tokens is None:
      return
    max_model_len = self.engine.max_model_len
    for prompt in prompts:
      num_prompt = _num_prompt_tokens(prompt)
      if num_prompt is None or num_prompt >= max_model_len:
        continue
      if num_prompt + max_tokens > max_model_len:
        raise RequestError(
          f"This model's maximum context length is {max_model_len} tokens. However, you "
          f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
          f"{max_tokens} in the completion). Shorten the prompt or lower {field}.",
          field,
        )

  def prompt_text(self, output: RequestOutput) -> str:
    """The prompt as echoed: its text, or its token ids decoded (special tokens kept)."""
    if output.prompt is not None:
      return output.prompt
    return self.decode(*output.prompt_token_ids)

  def decode(self, *token_ids: int) -> str:
    """Token ids' text (special tokens kept), or "" without a tokenizer."""
    tokenizer = self.engine.tokenizer
    return "" if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=False)

  async def completions(self, body: CompletionRequest, request: Request) -> Response:
    lora = self.check_model(body.model)
    _warn_unknown(body, "/v1/completions")
    params = body.sampling_params()
    prompts = [
      self.truncated(self.tokenized(p), body.truncate_prompt_tokens) for p in body.prompts()
    ]
    self.check_context(prompts, params.max_tokens, body.max_tokens_field())
    request_id = f"cmpl-{uuid.uuid4().hex}"
    header = {"id": request_id, "created": int(time.time()), "model": body.model or self.model_name}
    stream = _Run(self.engine, prompts, params, request_id, body.stream, "prompt",
                  body.constraint_source(), lora)  # fmt: skip
    if not body.stream:
      outputs = await _unless_disconnected(request, stream.finals())
      k = body.prompt_logprobs if body.prompt_logprobs is not None else params.prompt_logprobs
      choices = [
        {**self.completion_choice(i * params.n + c.index, output, c, body.echo,
                                  self.text_offsets(output, params.skip_special_tokens),
                                  params.logprobs),
         "prompt_logprobs": _prompt_logprobs(output, k)}
        for i, output in enumerate(outputs)
        for c in output.outputs
      ]  # fmt: skip
      response = {**header, "object": "text_completion", "choices": choices}
      return JSONResponse({**response, "usage": _usage(outputs)})
    await stream.start()
    return _sse(self._completion_events(stream, header, body, params.n, params.logprobs))

  async def _completion_events(self, stream, header, body, n: int, num_logprobs) -> AsyncIterator:
    usage = body.stream_options is not None and body.stream_options.include_usage
    chunk = {**header, "object": "text_completion"}
    offsets: dict[int, _TextOffsets] = {}
    async for i, output in stream.deltas():
      for c in output.outputs:
        index = i * n + c.index
        echo = body.echo and index not in offsets
        if index not in offsets:
          offsets[index] = self.text_offsets(output, body.skip_special_tokens)
        choice = self.completion_choice(index, output, c, echo, offsets[index], num_logprobs)
        yield {**chunk, "choices": [choice], **({"usage": None} if usage else {})}
    if usage:
      yield {**chunk, "choices": [], "usage": stream.usage()}

  def text_offsets(self, output: RequestOutput, skip_special_tokens: bool) -> _TextOffsets:
    """A new choice's `text_offset` counter (its completion decodes after `output`'s prompt)."""
    return _TextOffsets(self.engine.tokenizer, output.prompt_token_ids, skip_special_tokens)

  def completion_choice(self, index, output: RequestOutput, c: CompletionOutput, echo: bool,
                        offsets: _TextOffsets, num_logprobs) -> dict:  # fmt: skip
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
        echoed = _completion_logprobs(ids, steps, prompt_offsets, num_logprobs, self.decode)
      completion_offsets = offsets.completion_offsets(c.token_ids, c.text)
      logprobs = _completion_logprobs(
        c.token_ids, c.logprobs, completion_offsets, num_logprobs, self.decode
      )
      if echoed is not None:
        logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
    text = prompt + c.text
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip

  # --- chat -----------------------------------------------------------------------------------

  async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
    lora = self.check_model(body.model)
    _warn_unknown(body, "/v1/chat/completions")
    params = body.sampling_params()
    prompt = self.truncated(self.render_chat(body), body.truncate_prompt_tokens)
    self.check_context([prompt], params.max_tokens, body.max_tokens_field())
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    header = {"id": request_id, "created": int(time.time()), "model": body.model or self.model_name}
    stream = _Run(self.engine, [prompt], params, request_id, body.stream, "messages",
                  body.constraint_source(), lora)  # fmt: skip
    echoed = _chat_echo(body)
    if not body.stream:
      outputs = await _unless_disconnected(request, stream.finals())
      choices = [
        {"index": c.index, "message": {"role": "assistant", "content": echoed + c.text},
         "logprobs": _chat_logprobs(c, params.logprobs), "finish_reason": c.finish_reason,
         "stop_reason": c.stop_reason}
        for c in outputs[0].outputs
      ]  # fmt: skip
      response = {**header, "object": "chat.completion", "choices": choices}
      prompt_logprobs = _prompt_logprobs(outputs[0], params.prompt_logprobs)
      return JSONResponse(
        {**response, "usage": _usage(outputs), "prompt_logprobs": prompt_logprobs}
      )
    await stream.start()
    return _sse(self._chat_events(stream, header, body, params.n, params.logprobs, echoed))

  async def _chat_events(self, stream, header, body, n: int, num_logprobs,
                         echoed: str) -> AsyncIterator:  # fmt: skip
    usage = {"usage": None} if body.stream_options and body.stream_options.include_usage else {}
    chunk = {**header, "object": "chat.completion.chunk"}
    for index in range(n):
      role = {"role": "assistant", "content": ""}
      choice = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
      yield {**chunk, "choices": [choice], **usage}
    for index in range(n if echoed else 0):
      choice = {"index": index, "delta": {"content": echoed}, "logprobs": None,
                "finish_reason": None}  # fmt: skip
      yield {**chunk, "choices": [choice], **usage}
    async for _, output in stream.deltas():
      for c in output.outputs:
        choice = {"index": c.index, "delta": {"content": c.text},
                  "logprobs": _chat_logprobs(c, num_logprobs),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        yield {**chunk, "choices": [choice], **usage}
    if usage:
      yield {**chunk, "choices": [], "usage": stream.usage()}

  def render_chat(self, body: ChatCompletionRequest) -> dict:
    tokenizer = self.engine.tokenizer
    if tokenizer is None:
      raise RequestError("this model has no tokenizer: chat is not available", "messages")
    if not body.messages:
      raise RequestError("messages must not be empty", "messages")
    try:
      return render_prompts(
        tokenizer,
        as_conversations(body.messages),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
      )[0]
    except ValueError as error:
      raise RequestError(str(error), "messages") from None

  # --- tokenizer ------------------------------------------------------------------------------

  def tokenize(self, body: TokenizeRequest) -> dict:
    self.check_model(body.model)
    _warn_unknown(body, "/tokenize")
    tokenizer = self.engine.tokenizer
    if tokenizer is None:
      raise RequestError("this model has no tokenizer", None)
    if (body.prompt is None) == (body.messages is None):
      raise RequestError("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
      tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
      chat = ChatCompletionRequest(
        messages=body.messages or [], add_generation_prompt=body.add_generation_prompt
      )
      tokens = self.render_chat(chat)["prompt_token_ids"]
    return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}

  def detokenize(self, body: DetokenizeRequest) -> dict:
    self.check_model(body.model)
    _warn_unknown(body, "/detokenize")
    tokenizer = self.engine.tokenizer
    if tokenizer is None:
      raise RequestError("this model has no tokenizer", None)
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
      raise RequestError(
        f"tokens must be ids in [0, {tokenizer.vocab_size}), got {bad[:5]}", "tokens"
      )
    return {"prompt": tokenizer.decode(body.tokens)}


class _Run:
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
    engine `ValueError` as a 400 `RequestError`)."""
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


def _warn_unknown(body: TokenizeRequest | DetokenizeRequest | CompletionRequest
                  | ChatCompletionRequest, path: str) -> None:  # fmt: skip
  """One warning naming the fields of a request that this server does not know (and ignores,
  as vLLM does)."""
  unknown = body.unknown_fields()
  if unknown:
    logger.warning("%s: ignoring unknown fields %s", path, unknown)


def _chat_echo(body: ChatCompletionRequest) -> str:
  """vLLM's chat `echo`: the last message's text, which the reply starts with when that message
  has the reply's role ("assistant", or with add_generation_prompt false the last message's
  own); "" otherwise."""
  if not body.echo:
    return ""
  last = as_conversations(body.messages)[0][-1]
  role = "assistant" if body.add_generation_prompt else last["role"]
  return last["content"] if last["role"] == role else ""


def _usage(outputs: list[RequestOutput]) -> dict:
  prompt = sum(len(o.prompt_token_ids) for o in outputs)
  completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}  # fmt: skip


async def _unless_disconnected(request: Request, work):
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


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
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


def _finite(value: float) -> float:
  return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def _num_prompt_tokens(prompt) -> int | None:
  """A prompt's token count, or None for text (the engine tokenizes it)."""
  if isinstance(prompt, dict):
    return len(prompt["prompt_token_ids"])
  return None if isinstance(prompt, str) else len(prompt)


def _top(entries: dict[int, Logprob], k: int | None) -> dict[int, Logprob]:
  """A position's entries cut to its token (the first) and the top `k` (-1 or None: all)."""
  if k is None or k == -1:
    return entries
  return {
    token_id: e
    for i, (token_id, e) in enumerate(entries.items())
    if i == 0 or (e.rank is not None and e.rank <= k)
  }  # fmt: skip


def _completion_logprobs(token_ids: Sequence[int], steps: Sequence, offsets: Sequence[int],
                         k: int | None, decode: Callable[[int], str]) -> dict:  # fmt: skip
  """The legacy completions API's logprobs: tokens, their logprobs, top dicts, text offsets.

  Args:
    token_ids: the tokens.
    steps: per token its `{token_id: Logprob}` dict, or None (a prompt's first token: its text
      comes from `decode`, its logprob and top dict are null).
    offsets: per token where it starts in the choice's text (characters; `_TextOffsets`).
    k: the top entries shown besides the token itself (-1 or None: all there are).
    decode: a token id's text.
  """
  tokens, values, tops = [], [], []
  for token_id, entries in zip(token_ids, steps):
    if entries is None:
      text, value, top = decode(token_id), None, None
    else:
      chosen = entries[token_id]
      text, value = chosen.decoded_token or "", _finite(chosen.logprob)
      top = {(e.decoded_token or ""): _finite(e.logprob) for e in _top(entries, k).values()}
    tokens.append(text)
    values.append(value)
    tops.append(top)
  return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
          "text_offset": list(offsets)}  # fmt: skip


class _TextOffsets:
  """Where each token of one completion choice starts in the choice's text (`text_offset`).

  A token's offset is the length of the text its part's earlier tokens decode to, decoded
  incrementally (`IncrementalDetokenizer`, which holds back a character until its last byte
  arrives): the tokens of one multi-byte character all get the offset where it starts, and the
  offsets never decrease. The echoed prompt decodes on its own with special tokens kept; the
  completion decodes after the prompt as the engine decoded it. Offsets are clipped to the text
  sent so far (a stop string cut from the text ends it before its tokens do). Kept across a
  stream's chunks.

  Args:
    tokenizer: the engine's tokenizer, or None (every offset is then the text's length so far).
    prompt_token_ids: the completion's decoding context.
    skip_special_tokens: the request's setting, as the engine decoded the completion with.
  """

  def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int],
               skip_special_tokens: bool) -> None:  # fmt: skip
    self.tokenizer = tokenizer
    self.prompt_token_ids = prompt_token_ids
    self.skip_special_tokens = skip_special_tokens
    self.text_length = 0  # characters of the choice's text sent so far
    self._decoded = 0  # where the current part's next token starts
    self._detokenizer: IncrementalDetokenizer | None = None
    self._pending: list[int] = []
    self._skip = skip_special_tokens
    self._in_completion = False

  def prompt_offsets(self, token_ids: Sequence[int], text: str) -> list[int]:
    """The echoed prompt's offsets (`text`: the prompt as echoed, before any completion text).
    Special tokens count as their text, unless only without them the tokens spell `text` (a
    BOS the tokenizer added to a text prompt starts where the text does)."""
    tokenizer = self.tokenizer
    skip = (
      tokenizer is not None
      and tokenizer.decode(token_ids, skip_special_tokens=False) != text
      and tokenizer.decode(token_ids, skip_special_tokens=True) == text
    )
    self._start_part((), skip)
    offsets = self._offsets(token_ids, text)
    self._in_completion = False
    return offsets

  def completion_offsets(self, token_ids: Sequence[int], text: str) -> list[int]:
    """The offsets of the completion's next tokens, which add `text` to the choice."""
    if not self._in_completion:
      self._start_part(self.prompt_token_ids, self.skip_special_tokens)
      self._in_completion = True
    return self._offsets(token_ids, text)

  def _start_part(self, context: Sequence[int], skip_special_tokens: bool) -> None:
    self._decoded = self.text_length
    self._pending = []  # tokens decoded to no text yet (a character's first bytes)
    self._skip = skip_special_tokens
    self._detokenizer = None
    if self.tokenizer is not None:
      self._detokenizer = IncrementalDetokenizer(
        self.tokenizer, context, skip_special_tokens=skip_special_tokens
      )

  def _offsets(self, token_ids: Sequence[int], text: str) -> list[int]:
    self.text_length += len(text)
    offsets: list[int] = []
    held = 0  # how many of the last `offsets` are pending (set again once their text comes)
    for token_id in token_ids:
      offsets.append(self._decoded)
      if self._detokenizer is None:
        continue
      chunk = self._detokenizer.add_tokens([token_id])
      if not chunk:
        self._pending.append(token_id)
        held += 1
        continue
      starts = self._starts_in(chunk)
      offsets[len(offsets) - held - 1 :] = starts[-held - 1 :]
      self._decoded += len(chunk)
      self._pending, held = [], 0
    return [min(offset, self.text_length) for offset in offsets]

  def _starts_in(self, chunk: str) -> list[int]:
    """Where the pending tokens and the one that ended them start in `chunk`, their text: how
    far the text of the tokens before each agrees with it (an incomplete character shows as
    U+FFFD, which a complete one replaces; invalid bytes stay U+FFFD in `chunk` too)."""
    assert self.tokenizer is not None
    starts = [self._decoded]
    for i in range(1, len(self._pending) + 1):
      before = self.tokenizer.decode(self._pending[:i], skip_special_tokens=self._skip)
      starts.append(self._decoded + _common_prefix_length(before, chunk))
    return starts


def _common_prefix_length(a: str, b: str) -> int:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _prompt_logprobs(output: RequestOutput, k: int | None) -> list | None:
  """vLLM's `prompt_logprobs` field: per prompt token null (the first) or `{str(token id):
  {"logprob", "rank", "decoded_token"}}` holding the token and the top `k`; None when not asked."""
  if output.prompt_logprobs is None:
    return None
  return [
    None if entries is None else {
      str(token_id): {"logprob": _finite(e.logprob), "rank": e.rank,
                      "decoded_token": e.decoded_token}
      for token_id, e in _top(entries, k).items()
    }
    for entries in output.prompt_logprobs
  ]  # fmt: skip


def _chat_logprobs(c: CompletionOutput, num_logprobs: int | None) -> dict | None:
  """The chat API's logprobs: per token its text, logprob, UTF-8 bytes and the top k."""
  if c.logprobs is None:
    return None
  k = num_logprobs or 0

  def entry(logprob) -> dict[str, Any]:
    text = logprob.decoded_token or ""
    return {"token": text, "logprob": _finite(logprob.logprob), "bytes": list(text.encode())}

  content = []
  for token_id, entries in zip(c.token_ids, c.logprobs):
    top = sorted(
      (e for e in entries.values() if e.rank is not None and e.rank <= k),
      key=lambda e: e.rank or 0,
    )
    content.append({**entry(entries[token_id]), "top_logprobs": [entry(e) for e in top]})
  return {"content": content}
