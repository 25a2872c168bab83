"""Tool-call parsers (vLLM's ``--tool-call-parser``), by name: each reads the calls a model
wrote in its format out of its output (`abstract_tool_parser.ToolParser`).

  hermes        ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (`hermes.py`)
  llama3_json   ``{"name": ..., "parameters": {...}}``, ``;``-separated (`llama3_json.py`)
  qwen3_coder   ``<tool_call><function=NAME><parameter=KEY>value</parameter>...`` (`qwen3_coder.py`)
"""

from __future__ import annotations

from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import (
  MalformedToolCall,
  ParsedCall,
  ParsedToolCalls,
  ToolParser,
)
from jaxengine.entrypoints.tool_parsers.hermes import Hermes2ProToolParser
from jaxengine.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxengine.entrypoints.tool_parsers.qwen3_coder import Qwen3CoderToolParser

#: The parsers by their ``--tool-call-parser`` name.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
  "hermes": Hermes2ProToolParser,
  "llama3_json": Llama3JsonToolParser,
  "qwen3_coder": Qwen3CoderToolParser,
}

__all__ = [
  "TOOL_PARSERS",
  "MalformedToolCall",
  "ParsedCall",
  "ParsedToolCalls",
  "ToolParser",
  "tool_parser_class",
]


def tool_parser_class(name: str) -> type[ToolParser]:
  """The parser named `name`.

  Raises:
    ValueError: for an unknown name, listing the known ones.
  """
  if name not in TOOL_PARSERS:
    raise ValueError(
      f"unknown tool_call_parser {name!r}: the known ones are {sorted(TOOL_PARSERS)}"
    )
  return TOOL_PARSERS[name]
