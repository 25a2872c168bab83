"""A chat request's `tool_choice` against its `tools` (vLLM's rules), the output constraint that
forces a call, and the parsers of the forced calls.

  "none"        no call: the tools are left out of the prompt, the output is content
  "auto"        the model may call (needs ``--enable-auto-tool-choice``): the server's
                ``--tool-call-parser`` reads its calls; the default when `tools` are given
  "required"    at least one call: the output is constrained to a JSON array of
                ``{"name": NAME, "parameters": {...}}``, NAME one of the tools' and the
                parameters following that tool's schema; finish_reason "tool_calls"
  {"type": "function", "function": {"name": NAME}}
                a call of NAME: the output is constrained to NAME's `parameters` schema and is
                the call's arguments; finish_reason "stop" (as OpenAI's)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import (
  MalformedToolCall,
  ParsedCall,
  ParsedToolCalls,
  ToolParser,
  is_json,
)
from jaxengine.entrypoints.tool_parsers.json_scan import partial_call, skip_whitespace
from jaxengine.params import StructuredOutputsParams


class ToolChoiceError(ValueError):
  """A `tool_choice` or `tools` the request may not have (the server answers a 400 naming
  `param`)."""

  def __init__(self, message: str, param: str) -> None:
    super().__init__(message)
    self.param = param


def effective_tool_choice(
  tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None
) -> str | Mapping[str, Any]:
  """The request's `tool_choice`, checked against its `tools`: "auto" when absent with tools,
  "none" when absent without.

  Raises:
    ToolChoiceError: a tool that is not ``{"type": "function", "function": {"name": str,
      ...}}`` (param "tools"); a `tool_choice` other than "none", "auto", "required" or
      ``{"type": "function", "function": {"name": str}}``, "required" or a named function
      without `tools`, or a function that is not one of the tools (param "tool_choice").
  """
  names = tool_names(tools)
  if tool_choice is None:
    return "auto" if tools else "none"
  if isinstance(tool_choice, str):
    if tool_choice not in ("none", "auto", "required"):
      raise ToolChoiceError(
        f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
        f'{{"name": ...}}}}, got {tool_choice!r}',
        "tool_choice",
      )
    if tool_choice == "required" and not tools:
      raise ToolChoiceError('tool_choice "required" needs tools', "tool_choice")
    return tool_choice
  name = named_function(tool_choice)
  if not tools:
    raise ToolChoiceError(f"tool_choice names the function {name!r} but no tools are given",
                          "tool_choice")  # fmt: skip
  if name not in names:
    raise ToolChoiceError(
      f"tool_choice names the function {name!r}, which is not one of the tools {names}",
      "tool_choice",
    )
  return tool_choice


def named_function(tool_choice: Mapping[str, Any]) -> str:
  """The function a named `tool_choice` names.

  Raises:
    ToolChoiceError: for a dict that is not ``{"type": "function", "function": {"name": str}}``.
  """
  function = tool_choice.get("function")
  name = function.get("name") if isinstance(function, Mapping) else None
  if tool_choice.get("type") != "function" or not isinstance(name, str) or not name:
    raise ToolChoiceError(
      f'a named tool_choice is {{"type": "function", "function": {{"name": ...}}}}, got '
      f"{dict(tool_choice)!r}",
      "tool_choice",
    )
  return name


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
  """The tools' function names.

  Raises:
    ToolChoiceError: naming "tools", for a tool that is not ``{"type": "function", "function":
      {"name": str, ...}}``.
  """
  names = []
  for index, tool in enumerate(tools or ()):
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if tool.get("type", "function") != "function" or not isinstance(name, str) or not name:
      raise ToolChoiceError(
        f'tools[{index}] must be {{"type": "function", "function": {{"name": str, ...}}}}, got '
        f"{dict(tool)!r:.200}",
        "tools",
      )
    names.append(name)
  return names


def _parameters(tool: Mapping[str, Any]) -> Mapping[str, Any]:
  return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_call_constraint(
  tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any]
) -> StructuredOutputsParams | None:
  """The output constraint a checked `tool_choice` asks for: a named function's `parameters`
  schema, for "required" an array of one or more ``{"name", "parameters"}`` objects over the
  tools (vLLM's schema); None for "none" and "auto"."""
  if tool_choice in ("none", "auto"):
    return None
  if isinstance(tool_choice, Mapping):
    name = named_function(tool_choice)
    tool = next(t for t in tools or () if t["function"]["name"] == name)
    return StructuredOutputsParams(json=dict(_parameters(tool)))
  calls = [
    {
      "type": "object",
      "properties": {
        "name": {"type": "string", "enum": [tool["function"]["name"]]},
        "parameters": _parameters(tool),
      },
      "required": ["name", "parameters"],
    }
    for tool in tools or ()
  ]
  schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
  return StructuredOutputsParams(json=schema)


class NamedFunctionParser(ToolParser):
  """The output of a named `tool_choice`: all of it the arguments of one call of `name`,
  complete once the output ends as JSON (else it was cut off, by `max_tokens`)."""

  def __init__(self, name: str) -> None:
    super().__init__()
    self.name = name

  def parse(self, text: str, final: bool) -> ParsedToolCalls:
    return ParsedToolCalls("", [ParsedCall(self.name, text, final and is_json(text))])


class RequiredCallsParser(ToolParser):
  """The output of `tool_choice` "required": a JSON array of ``{"name", "parameters"}``."""

  def parse(self, text: str, final: bool) -> ParsedToolCalls:
    position = skip_whitespace(text, 0)
    if position >= len(text):
      return ParsedToolCalls("", [])
    if text[position] != "[":
      raise MalformedToolCall(f"expected a JSON array of calls, got {text[:20]!r}")
    calls: list[ParsedCall] = []
    position = skip_whitespace(text, position + 1)
    while position < len(text) and text[position] != "]":
      call, end = partial_call(text, position, final, ("parameters",))
      calls.append(call)
      if end is None:
        break
      position = skip_whitespace(text, end)
      if text.startswith(",", position):
        position = skip_whitespace(text, position + 1)
    return ParsedToolCalls("", calls)
