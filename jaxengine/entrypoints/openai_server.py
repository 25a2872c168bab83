"""An OpenAI-compatible HTTP server on an `AsyncLLM` (FastAPI; `jaxengine serve` runs it).

  POST /v1/completions        text or token-id prompts (a list of them is a batch); streamed as
                              server-sent events with `"stream": true`
  POST /v1/chat/completions   messages rendered by the model's chat template; streamed likewise
  GET  /v1/models             the served model and LoRA adapters
  POST /v1/load_lora_adapter, /v1/unload_lora_adapter
  GET  /health                200 while the engine thread runs, else 503
  GET  /metrics               Prometheus text (`entrypoints/metrics.py`)
  POST /tokenize, /detokenize
  POST /pause, /resume, /sleep, /wake_up, /reset_prefix_cache, GET /is_paused, /is_sleeping
                              RL weight syncs (`rl_routes.py`): `AsyncLLM.pause_generation`,
                              `resume_generation`, `sleep`, `wake_up`, `reset_prefix_cache`

Bad input is a 400 with OpenAI's error body naming the field (a malformed body, a wrong type
(strict: a JSON boolean is no count, 1 or "yes" no boolean), a value `SamplingParams` refuses, a
prompt of `max_model_len` tokens or more, a token-id prompt with an id outside the vocabulary,
a prompt plus `max_tokens` past `max_model_len`,
`stream_options` without `stream`, `prompt_logprobs` with `stream`, a `best_of` other than `n`,
an invalid output constraint (named as sent: `response_format`, `guided_json`, ...), a field
this server does not implement set to change the output: `use_beam_search` true, a non-empty
`suffix`, `functions` unless `function_call` is "none"; `tools` with `tool_choice` "auto" without
`enable_auto_tool_choice`, a `tool_choice` naming a function not in `tools`),
an unknown model a 404, and a missing or wrong API key (with `api_key` set) a 401 on `/v1/*`,
`/tokenize` and `/detokenize`. Fields the server does not know are ignored (vLLM's behaviour),
with one warning per request naming them. vLLM's `guided_json`, `guided_regex`, `guided_choice`
and `guided_grammar` are `structured_outputs`' `json`, `regex`, `choice`, `grammar`;
`truncate_prompt_tokens=k` keeps the prompt's last k tokens (-1: `max_model_len`); chat `echo`
starts the reply with the last message when it has the reply's role. Tools are rendered by the
chat template (not with `tool_choice` "none"); tool calls are read by the `tool_call_parser`
("auto") or forced by structured outputs ("required", a named function: `tool_choice.py`), the
reasoning split off by the `reasoning_parser` (`chat_output.py`). A client that
disconnects aborts its requests (streamed or not): their rows are freed at the next step
boundary. An error while serving one request fails that request alone.

The endpoints' work is in modules named as vLLM names them: `serving_completion.py`,
`serving_chat.py`, `serving_tokenization.py`, `serving_models.py` (the served model and LoRA
adapters), on `serving_engine.py` (what they share), `engine_requests.py` (an HTTP request's
engine requests, server-sent events), `serving_logprobs.py` and `text_offsets.py` (the logprob
formats), `serving_token_ids.py` (vLLM's `return_token_ids`, token-id prompts checked). This
module builds the app: routes, API key, error handlers.

Logprobs follow vLLM (`serving_logprobs.py`): `prompt_logprobs=k` adds `prompt_logprobs` to each
completion choice (to the chat response itself), one entry per prompt token, the first null, the
others `{str(token id): {"logprob", "rank", "decoded_token"}}`; `echo` with `logprobs`
(completions) lists the prompt's tokens before the completion's, the first with null logprob and
top dict, `text_offset` counting through the echoed text: a token's offset is the length of the
text the tokens before it decode to (a character split over several tokens starts where it
starts).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Iterable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.chat_output import ChatParserOptions
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
)
from jaxengine.entrypoints.rl_routes import add_rl_routes
from jaxengine.entrypoints.serving_chat import OpenAIServingChat
from jaxengine.entrypoints.serving_completion import OpenAIServingCompletion
from jaxengine.entrypoints.serving_logprobs import MIN_LOGPROB
from jaxengine.entrypoints.serving_models import OpenAIServingModels
from jaxengine.entrypoints.serving_tokenization import OpenAIServingTokenization
from jaxengine.lora import LoRAModulePath

__all__ = ["MIN_LOGPROB", "Serving", "build_app"]

logger = logging.getLogger(__name__)


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
  if first.get("type") == "value_error":  # a validator's own message names what is wrong
    return RequestError(str(first.get("ctx", {}).get("error")), loc[0] if loc else None)
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


@dataclasses.dataclass(frozen=True)
class Serving:
  """What an app serves with (`app.state.serving`).

  Attributes:
    engine: the `AsyncLLM`.
    models: the served model and LoRA adapters.
    metrics: the Prometheus metrics the engine's steps feed.
    completion: `/v1/completions`' work.
    chat: `/v1/chat/completions`' work.
    tokenization: `/tokenize`'s and `/detokenize`'s work.
  """

  engine: AsyncLLM
  models: OpenAIServingModels
  metrics: ServerMetrics
  completion: OpenAIServingCompletion
  chat: OpenAIServingChat
  tokenization: OpenAIServingTokenization

  @classmethod
  def create(cls, engine: AsyncLLM, served_model_name: str,
             parsers: ChatParserOptions | None = None) -> Serving:  # fmt: skip
    """The serving of `engine`; `parsers`: the chat's tool and reasoning options."""
    models = OpenAIServingModels(engine, served_model_name)
    return cls(
      engine=engine,
      models=models,
      metrics=ServerMetrics(served_model_name, engine.engine),
      completion=OpenAIServingCompletion(engine, models),
      chat=OpenAIServingChat(engine, models, parsers),
      tokenization=OpenAIServingTokenization(engine, models),
    )


def build_app(
  engine: AsyncLLM,
  served_model_name: str,
  api_key: str | None = None,
  lora_modules: Mapping[str, str] | Iterable[LoRAModulePath] | None = None,
  *,
  enable_auto_tool_choice: bool = False,
  tool_call_parser: str | None = None,
  reasoning_parser: str | None = None,
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
    enable_auto_tool_choice: `tool_choice` "auto" (the default with `tools`) is allowed: the
      model may call tools, which `tool_call_parser` reads from its output (vLLM's
      ``--enable-auto-tool-choice``). Without it "auto" with tools is a 400.
    tool_call_parser: the tool-call format, one of `tool_parsers.TOOL_PARSERS` ("hermes",
      "llama3_json", "qwen3_coder"), or None.
    reasoning_parser: the reasoning format, one of `reasoning_parsers.REASONING_PARSERS`
      ("deepseek_r1", "qwen3"), or None: choices get `reasoning_content`.

  Raises:
    ValueError: an unknown `tool_call_parser` or `reasoning_parser` (listing the known ones),
      `enable_auto_tool_choice` without a `tool_call_parser`, a LoRA module without
      `enable_lora`, named twice or as the base model, or a directory
      `jaxengine.lora.load_peft_adapter` refuses.
  """
  parsers = ChatParserOptions.from_names(
    enable_auto_tool_choice, tool_call_parser, reasoning_parser
  )
  app = FastAPI(title="jaxengine", docs_url=None, redoc_url=None)
  serving = Serving.create(engine, served_model_name, parsers)
  modules = lora_modules or ()
  for module in modules.items() if isinstance(modules, Mapping) else modules:
    serving.models.add_lora(*module)
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
    return {"object": "list", "data": serving.models.model_cards()}

  @app.post("/v1/load_lora_adapter")
  async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
    serving.models.add_lora(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

  @app.post("/v1/unload_lora_adapter")
  async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
    serving.models.remove_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: Request) -> Response:
    return await serving.completion.completions(body, request)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await serving.chat.chat_completions(body, request)

  add_rl_routes(app, engine)

  @app.post("/tokenize")
  async def tokenize(body: TokenizeRequest) -> dict:
    return serving.tokenization.tokenize(body)

  @app.post("/detokenize")
  async def detokenize(body: DetokenizeRequest) -> dict:
    return serving.tokenization.detokenize(body)

  return app
