"""The hermes format (NousResearch Hermes 2 Pro, Qwen2.5, Qwen3): each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
around the calls is content."""

from __future__ import annotations

import dataclasses

from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import (
  ParsedCall,
  ParsedToolCalls,
  ToolParser,
  parse_tagged,
)
from jaxengine.entrypoints.tool_parsers.json_scan import partial_call


class Hermes2ProToolParser(ToolParser):
  """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, as often as called (vLLM's
  ``--tool-call-parser hermes``). A call left open when the output ends is read as far as its
  JSON goes (complete if its object closed); one its end tag closes is complete."""

  start_tag = "<tool_call>"
  end_tag = "</tool_call>"

  def parse(self, text: str, final: bool) -> ParsedToolCalls:
    return parse_tagged(text, final, self.start_tag, self.end_tag, _read_call)


def _read_call(body: str, final: bool, closed: bool) -> ParsedCall:
  """One call's JSON, read as far as it goes; a call its end tag closed has ended, however it
  reads."""
  call, _ = partial_call(body, 0, final or closed, ("arguments",))
  return dataclasses.replace(call, complete=True) if closed and not call.complete else call
