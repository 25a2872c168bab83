"""The hermes format (NousResearch Hermes 2 Pro, Qwen2.5, Qwen3): each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text
around the calls is content."""

from __future__ import annotations

import dataclasses

from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import (
  ParsedToolCalls,
  ToolParser,
  content_of,
  held_back,
)
from jaxengine.entrypoints.tool_parsers.json_scan import partial_call


class Hermes2ProToolParser(ToolParser):
  """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, as often as called (vLLM's
  ``--tool-call-parser hermes``). A call left open when the output ends is read as far as its
  JSON goes (complete if its object closed); one its end tag closes is complete."""

  start_tag = "<tool_call>"
  end_tag = "</tool_call>"

  def parse(self, text: str, final: bool) -> ParsedToolCalls:
    parts, calls, position = [], [], 0
    while (start := text.find(self.start_tag, position)) >= 0:
      parts.append(text[position:start])
      body_start = start + len(self.start_tag)
      end = text.find(self.end_tag, body_start)
      body = text[body_start : len(text) if end < 0 else end]
      call, _ = partial_call(body, 0, final or end >= 0, ("arguments",))
      if end >= 0 and not call.complete:  # closed by its tag: ended, however it reads
        call = dataclasses.replace(call, complete=True)
      calls.append(call)
      if end < 0:
        return ParsedToolCalls(content_of(parts), calls)
      position = end + len(self.end_tag)
    tail = text[position:]
    parts.append(tail if final else held_back(tail, self.start_tag))
    return ParsedToolCalls(content_of(parts), calls)
