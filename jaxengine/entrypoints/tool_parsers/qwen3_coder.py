"""Qwen3-Coder's XML-like tool calls: each call

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

a parameter's value the text between its tags (one newline after the opening tag and one
before the closing tag dropped), typed by the tool's `parameters` schema; the text around the
calls is content."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import (
  ParsedCall,
  ParsedToolCalls,
  ToolParser,
  parse_tagged,
)

_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(ToolParser):
  """vLLM's ``--tool-call-parser qwen3_coder``. The arguments are the JSON object of the
  parameters read so far (``{`` once the function is named, each parameter once its closing tag
  is written, ``}`` once the function's is), so that a prefix of the output gives a prefix of
  the arguments."""

  start_tag = "<tool_call>"
  end_tag = "</tool_call>"

  def parse(self, text: str, final: bool) -> ParsedToolCalls:
    def read_call(body: str, ended: bool, closed: bool) -> ParsedCall:
      return self._call(body, ended or closed)

    return parse_tagged(text, final, self.start_tag, self.end_tag, read_call)

  def _call(self, body: str, closed: bool) -> ParsedCall:
    """One call's text (`closed`: the whole of it)."""
    start = body.find(_FUNCTION)
    name_end = body.find(">", start + len(_FUNCTION)) if start >= 0 else -1
    if name_end < 0:
      return ParsedCall(None, "", closed)
    name = body[start + len(_FUNCTION) : name_end].strip()
    schema = self.parameter_schema(name).get("properties") or {}
    function_end = body.find(_FUNCTION_END, name_end)
    closed = closed or function_end >= 0
    region = body[name_end + 1 : len(body) if function_end < 0 else function_end]
    fields = []
    for key, value in _parameters(region, closed):
      typed = typed_value(value, schema.get(key) or {})
      fields.append(
        f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(typed, ensure_ascii=False)}"
      )
    return ParsedCall(name, "{" + ", ".join(fields) + ("}" if closed else ""), closed)


def _parameters(region: str, closed: bool) -> list[tuple[str, str]]:
  """The parameters of a function's text whose values are complete: a value ends at its
  ``</parameter>``, else at the next ``<parameter=`` or, once `closed`, at the region's end."""
  out, position = [], 0
  while (start := region.find(_PARAMETER, position)) >= 0:
    key_end = region.find(">", start)
    if key_end < 0:
      break
    key = region[start + len(_PARAMETER) : key_end].strip()
    end = region.find(_PARAMETER_END, key_end)
    following = region.find(_PARAMETER, key_end)
    if end < 0 or 0 <= following < end:
      end = following if following >= 0 else (len(region) if closed else -1)
      if end < 0:
        break
      position = end
    else:
      position = end + len(_PARAMETER_END)
    value = region[key_end + 1 : end]
    value = value.removeprefix("\n")
    out.append((key, value.removesuffix("\n")))
  return out


def typed_value(text: str, schema: Mapping[str, Any]) -> Any:
  """A parameter's text as the JSON value its schema's ``type`` says (a string when the schema
  names no type, or when the text is no value of that type)."""
  kind = schema.get("type")
  kind = kind if isinstance(kind, str) else "string"
  if kind != "string" and text.strip().lower() == "null":
    return None
  stripped = text.strip()
  try:
    if kind == "integer":
      return int(stripped)
    if kind == "number":
      number = float(stripped)
      return int(number) if number.is_integer() and "." not in stripped else number
    if kind == "boolean":
      return {"true": True, "false": False}[stripped.lower()]
    if kind in ("object", "array"):
      return json.loads(stripped)
  except (ValueError, KeyError):
    return text
  return text
