"""Llama 3.1 / 3.2's JSON tool calls: an output that starts (after whitespace, or after
``<|python_tag|>``) with ``{`` is one or more objects ``{"name": ..., "parameters": {...}}``
separated by ``;``; any other output is content."""

from __future__ import annotations

from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import (
  MalformedToolCall,
  ParsedToolCalls,
  ToolParser,
)
from jaxengine.entrypoints.tool_parsers.json_scan import partial_call, skip_whitespace

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
  """vLLM's ``--tool-call-parser llama3_json``: the arguments are ``parameters`` (or
  ``arguments``); text after the last call that is not a call is content."""

  def parse(self, text: str, final: bool) -> ParsedToolCalls:
    start = skip_whitespace(text, 0)
    if text.startswith(_PYTHON_TAG, start):
      start = skip_whitespace(text, start + len(_PYTHON_TAG))
      if start == len(text) and not final:
        return ParsedToolCalls("", [])  # the calls follow
    elif _PYTHON_TAG.startswith(text[start:]) and not final:
      return ParsedToolCalls("", [])  # nothing yet, or the tag is being written
    if not text.startswith("{", start):
      return ParsedToolCalls(text, [])
    calls, position = [], start
    while True:
      call, end = partial_call(text, position, final, ("parameters", "arguments"))
      calls.append(call)
      if end is None:
        return ParsedToolCalls("", calls)
      position = skip_whitespace(text, end)
      if text.startswith(";", position):
        position = skip_whitespace(text, position + 1)
        if position < len(text):
          continue
        return ParsedToolCalls("", calls)
      rest = text[position:]
      if rest.startswith("{"):
        raise MalformedToolCall("calls must be separated by ';'")
      return ParsedToolCalls(rest, calls)
