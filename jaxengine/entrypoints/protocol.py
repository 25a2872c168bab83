"""The server's request bodies (OpenAI's fields plus vLLM's extra sampling fields, and
jaxengine's `max_staleness`), as pydantic models, and the `SamplingParams` each asks for.

Types are checked strictly by pydantic (a wrong type is a 400 naming the field: a JSON boolean
is not a count, nor 1 or "yes" a boolean, nor "5" a number); values by `SamplingParams` itself,
whose `ValueError` names the field too. Fields a client sends that are not listed here are
ignored, as OpenAI's and vLLM's servers do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxengine.entrypoints.prompt_shape import check_prompt_shape
from jaxengine.entrypoints.tool_choice import (
  ToolChoiceError,
  effective_tool_choice,
  tool_call_constraint,
)
from jaxengine.params import SamplingParams, StructuredOutputsParams


class RequestError(ValueError):
  """A request the server refuses, with the OpenAI error fields to answer with.

  Args:
    message: what is wrong (names the field and value).
    param: the request field at fault, or None.
    status_code: 400 (bad request), 404 (unknown model), 401 (no or wrong API key), 409 (the
      engine's state refuses it: sleep with requests unfinished) or 503 (the engine sleeps).
  """

  def __init__(self, message: str, param: str | None = None, status_code: int = 400):
    super().__init__(message)
    self.param = param
    self.status_code = status_code


class _Strict(BaseModel):
  """Strict types: booleans are not integers, integers and strings not booleans, strings not
  numbers (a float field still takes an integer)."""

  model_config = ConfigDict(strict=True)


class LoadLoRAAdapterRequest(_Strict):
  """vLLM's `/v1/load_lora_adapter` body: an adapter's served name and PEFT directory."""

  lora_name: str
  lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
  """vLLM's `/v1/unload_lora_adapter` body."""

  lora_name: str
  lora_int_id: int | None = None


class _Body(_Strict):
  """A request body: unknown fields are kept aside (`unknown_fields`), for a warning."""

  model_config = ConfigDict(strict=True, extra="allow")

  def unknown_fields(self) -> list[str]:
    """The fields the client sent that this server does not know (it ignores them)."""
    return sorted(self.model_extra or ())


class StreamOptions(_Strict):
  """OpenAI's `stream_options`: `include_usage` adds a last chunk with the token counts."""

  include_usage: bool = False


class JsonSchemaFormat(_Strict):
  """`response_format.json_schema`: the schema the output must follow."""

  model_config = ConfigDict(strict=True, populate_by_name=True)
  name: str | None = None
  description: str | None = None
  json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
  strict: bool | None = None


class ResponseFormat(_Strict):
  """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
  """vLLM's `structured_outputs` field: exactly one of its constraints."""

  model_config = ConfigDict(strict=True, populate_by_name=True)
  json_: dict[str, Any] | str | None = Field(default=None, alias="json")
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None
  json_object: bool | None = None


class SamplingRequest(_Body):
  """Fields both endpoints share."""

  model: str | None = None
  n: int = 1
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  min_p: float | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  repetition_penalty: float | None = None
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  bad_words: list[str] | None = None
  ignore_eos: bool = False
  min_tokens: int = 0
  skip_special_tokens: bool = True
  include_stop_str_in_output: bool = False
  logit_bias: dict[str, float] | None = None
  allowed_token_ids: list[int] | None = None
  prompt_logprobs: int | None = None
  best_of: int | None = None
  use_beam_search: bool = False
  truncate_prompt_tokens: int | None = None
  structured_outputs: StructuredOutputsRequest | None = None
  response_format: ResponseFormat | None = None
  guided_json: dict[str, Any] | str | None = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  guided_grammar: str | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  #: vLLM's: the generated ids on each choice (`token_ids`) and the prompt's (`prompt_token_ids`;
  #: `serving_token_ids.py`).
  return_token_ids: bool | None = None
  #: jaxengine's (no vLLM field): `SamplingParams.max_staleness`, asynchronous RL's bound on
  #: how many weight versions a request's oldest token may lag (None: no bound).
  max_staleness: int | None = None

  def _max_tokens(self) -> int | None:
    return None

  def max_tokens_field(self) -> str:
    """The field the request's `max_tokens` came from (what a 400 about it names)."""
    return "max_tokens"

  def _num_logprobs(self) -> int | None:
    return None

  def _prompt_logprobs(self) -> int | None:
    """The `prompt_logprobs` to compute: none while streaming (a stream never shows them; any
    but 0 is refused there)."""
    return None if self.stream else self.prompt_logprobs

  def sampling_params(self) -> SamplingParams:
    """The request's `SamplingParams`.

    Raises:
      RequestError: naming the field, for a value `SamplingParams` refuses, a `logit_bias` key
        that is not a token id, a `response_format` without its schema, several output
        constraints (`structured_outputs`, `response_format`, `guided_*`), `stream_options`
        without `stream`, `prompt_logprobs` (other than 0) with `stream`, a `best_of` other
        than None or `n` (vLLM V1 has no best_of: n samples are all returned), a
        `truncate_prompt_tokens` other than -1 or >= 1, or a field whose meaning this server
        does not implement set to change the output (`unsupported`).
    """
    self.check_supported()
    self._check_stream_fields()
    if self.truncate_prompt_tokens is not None and (
      self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1
    ):
      raise RequestError(
        f"truncate_prompt_tokens must be -1 (max_model_len) or >= 1, got "
        f"{self.truncate_prompt_tokens}",
        "truncate_prompt_tokens",
      )
    if self.best_of is not None and self.best_of != self.n:
      raise RequestError(
        f"best_of={self.best_of} is not supported (no sampling-then-ranking): leave it out, or "
        f"set it equal to n={self.n}, and choose among the n choices returned",
        "best_of",
      )
    fields: dict[str, Any] = {
      name: value
      for name in _OPTIONAL_FIELDS
      if (value := getattr(self, name)) is not None
    }  # fmt: skip
    if (prompt_logprobs := self._prompt_logprobs()) is not None:
      fields["prompt_logprobs"] = prompt_logprobs
    if isinstance(self.stop, str):
      fields["stop"] = [self.stop]
    if self.logit_bias is not None:
      fields["logit_bias"] = _logit_bias(self.logit_bias)
    structured = self._structured_outputs()
    try:
      return SamplingParams(
        n=self.n,
        max_tokens=self._max_tokens(),
        min_tokens=self.min_tokens,
        ignore_eos=self.ignore_eos,
        skip_special_tokens=self.skip_special_tokens,
        include_stop_str_in_output=self.include_stop_str_in_output,
        logprobs=self._num_logprobs(),
        structured_outputs=structured,
        **fields,
      )
    except ValueError as error:
      raise RequestError(str(error), field_named(str(error))) from None

  def check_supported(self) -> None:
    """Refuses (a 400 naming the field) a field vLLM or OpenAI give a meaning this server does
    not implement, when its value would change the output.

    Raises:
      RequestError: for `use_beam_search` true (and, per endpoint, `unsupported` fields).
    """
    if self.use_beam_search:
      raise RequestError(
        "use_beam_search=true is not supported (no beam search): leave it out or set it false",
        "use_beam_search",
      )

  def _check_stream_fields(self) -> None:
    if self.stream_options is not None and not self.stream:
      raise RequestError("stream_options can only be set when stream is true", "stream_options")
    if self.stream and self.prompt_logprobs not in (None, 0):
      raise RequestError(
        f"prompt_logprobs={self.prompt_logprobs} is not available when stream is true",
        "prompt_logprobs",
      )

  def constraint_fields(self) -> list[str]:
    """The output constraints the request sets: "structured_outputs", "response_format" (other
    than text), "guided_json", "guided_regex", "guided_choice", "guided_grammar" (vLLM's older
    names)."""
    fields = [name for name in _GUIDED if getattr(self, name) is not None]
    if self.response_format not in (None, _TEXT):
      fields.insert(0, "response_format")
    if self.structured_outputs is not None:
      fields.insert(0, "structured_outputs")
    return fields

  def constraint_source(self) -> str | None:
    """Where the request's output constraint was given, as an error about it names it (the
    engine's errors name `structured_outputs.{kind}`): None for `structured_outputs` itself or
    no constraint."""
    fields = self.constraint_fields()
    if not fields or fields[0] == "structured_outputs":
      return None
    if fields[0] == "response_format" and self.response_format is not None:
      return "response_format" + (
        ".json_schema.schema" if self.response_format.type == "json_schema" else ""
      )
    return fields[0]

  def _structured_outputs(self) -> StructuredOutputsParams | None:
    fields = self.constraint_fields()
    if len(fields) > 1:
      raise RequestError(f"give one output constraint, not several: got {fields}", fields[0])
    if not fields:
      return None
    try:
      return self._constraint(fields[0])
    except RequestError:
      raise
    except ValueError as error:
      raise RequestError(f"{fields[0]}: {error}", fields[0]) from None

  def _constraint(self, field: str) -> StructuredOutputsParams:
    if field == "structured_outputs":
      so = self.structured_outputs
      assert so is not None
      return StructuredOutputsParams(
        json=so.json_, regex=so.regex, grammar=so.grammar,
        choice=None if so.choice is None else tuple(so.choice), json_object=so.json_object,
      )  # fmt: skip
    if field != "response_format":  # guided_json -> json, ...
      return StructuredOutputsParams(**{field.removeprefix("guided_"): getattr(self, field)})
    fmt = self.response_format
    assert fmt is not None
    if fmt.type == "json_object":
      return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
      raise RequestError(
        "response_format of type json_schema needs json_schema.schema", "response_format"
      )
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


_TEXT = ResponseFormat(type="text")
#: vLLM's older names for `structured_outputs`' constraints (`guided_json` is its `json`, ...).
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
#: Fields passed to `SamplingParams` only when the request sets them (else its defaults hold).
_OPTIONAL_FIELDS = (
  "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
  "repetition_penalty", "seed", "stop", "stop_token_ids", "bad_words", "allowed_token_ids",
  "max_staleness",
)  # fmt: skip


class CompletionRequest(SamplingRequest):
  """`POST /v1/completions`: `prompt` is text, token ids, or a list of either."""

  prompt: str | list[int] | list[str] | list[list[int]]
  max_tokens: int | None = 16
  logprobs: int | None = None
  echo: bool = False
  suffix: str | None = None

  _prompt_shape = field_validator("prompt", mode="before")(check_prompt_shape)

  def _max_tokens(self) -> int | None:
    return self.max_tokens

  def check_supported(self) -> None:
    """As the base's, and a non-empty `suffix` (no fill-in-the-middle) is refused too."""
    super().check_supported()
    if self.suffix:
      raise RequestError("suffix is not supported (no fill-in-the-middle)", "suffix")

  def _num_logprobs(self) -> int | None:
    return self.logprobs

  def _prompt_logprobs(self) -> int | None:
    """With `echo` and `logprobs`, the prompt's logprobs are needed too: at least `logprobs`
    of them (vLLM's rule); -1 (the whole vocabulary) counts as the most."""
    asked, echoed = super()._prompt_logprobs(), self.logprobs if self.echo else None
    if asked is None or echoed is None:
      return echoed if asked is None else asked
    return -1 if -1 in (asked, echoed) else max(asked, echoed)

  def prompts(self) -> list[str | list[int]]:
    """The prompts, one per request (a list of strings or of id lists is a batch).

    Raises:
      RequestError: for an empty prompt list.
    """
    prompt = self.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
      return [prompt]  # type: ignore[list-item]
    if not prompt:
      raise RequestError("prompt must not be empty", "prompt")
    return list(prompt)  # type: ignore[arg-type]


class ChatCompletionRequest(SamplingRequest):
  """`POST /v1/chat/completions`, with vLLM's chat-template options."""

  messages: list[dict[str, Any]]
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  logprobs: bool | None = False
  top_logprobs: int | None = None
  add_generation_prompt: bool = True
  continue_final_message: bool = False
  chat_template: str | None = None
  chat_template_kwargs: dict[str, Any] | None = None
  echo: bool = False
  tools: list[dict[str, Any]] | None = None
  tool_choice: str | dict[str, Any] | None = None
  functions: list[dict[str, Any]] | None = None
  function_call: str | dict[str, Any] | None = None

  def _max_tokens(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

  def check_supported(self) -> None:
    """As the base's; `tools` and `tool_choice` are checked against each other
    (`tool_choice.effective_tool_choice`); `functions` unless `function_call` is "none", and a
    `function_call` naming a function, are refused (the older function calling: use tools)."""
    super().check_supported()
    self.effective_tool_choice()
    if self.function_call not in (None, "none", "auto"):
      raise RequestError(
        f"function_call={self.function_call!r} is not supported (no function calling)",
        "function_call",
      )
    if self.functions and self.function_call != "none":
      raise RequestError(
        "functions are not supported (no function calling): leave them out or set "
        'function_call to "none", or use tools',
        "functions",
      )

  def effective_tool_choice(self) -> str | Mapping[str, Any]:
    """`tool_choice`, "auto" when absent with `tools` ("none" without).

    Raises:
      RequestError: naming `tool_choice` or `tools` (`tool_choice.effective_tool_choice`).
    """
    try:
      return effective_tool_choice(self.tools, self.tool_choice)
    except ToolChoiceError as error:
      raise RequestError(str(error), error.param) from None

  def _structured_outputs(self) -> StructuredOutputsParams | None:
    """As the base's, or the constraint that forces the call(s) of `tool_choice` "required" or
    a named function, which may not be combined with another."""
    forced = tool_call_constraint(self.tools, self.effective_tool_choice())
    if forced is None:
      return super()._structured_outputs()
    if fields := self.constraint_fields():
      raise RequestError(
        f"tool_choice={self.tool_choice!r} constrains the output itself: it cannot be combined "
        f"with {fields}",
        "tool_choice",
      )
    return forced

  def constraint_source(self) -> str | None:
    """As the base's, "tool_choice" when it forces a call."""
    if tool_call_constraint(self.tools, self.effective_tool_choice()) is not None:
      return "tool_choice"
    return super().constraint_source()

  def max_tokens_field(self) -> str:
    return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

  def _num_logprobs(self) -> int | None:
    if self.top_logprobs is not None and not self.logprobs:
      raise RequestError("top_logprobs needs logprobs to be true", "top_logprobs")
    return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
  """`POST /tokenize`: a text prompt, or chat messages rendered by the chat template."""

  model: str | None = None
  prompt: str | None = None
  messages: list[dict[str, Any]] | None = None
  add_special_tokens: bool = True
  add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
  """`POST /detokenize`: token ids back to text."""

  model: str | None = None
  tokens: list[int]


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
  out = {}
  for key, value in bias.items():
    try:
      out[int(key)] = value
    except ValueError:
      raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
  return out


def field_named(message: str) -> str | None:
  """The request field a `SamplingParams` error message starts with, if any."""
  match = re.match(r"[a-z_]+", message)
  if match and match.group() in _FIELDS:
    return match.group()
  return None


_FIELDS = {*SamplingRequest.model_fields, "max_tokens", "logprobs", "top_logprobs", "prompt"}


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
  """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
  kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          409: "ConflictError"}.get(status_code, "InternalServerError")  # fmt: skip
  return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}


def json_dumps(value: Any) -> str:
  """Compact JSON for response bodies and server-sent events."""
  return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
