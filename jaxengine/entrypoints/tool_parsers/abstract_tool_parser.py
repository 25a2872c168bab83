"""What every tool-call parser gives: the text outside the calls and the calls themselves, read
from a model's output or from a prefix of it (streaming).

A parser reads the whole text generated so far each time (`ToolParser.parse`); a reading of a
prefix never contradicts a reading of the whole: its content is a prefix of the whole's content,
its calls are the first calls of the whole, each named as there (once named) and with arguments
that are a prefix of the whole's. `jaxengine/entrypoints/chat_output.py` streams the
differences between successive readings as OpenAI's deltas.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ParsedCall:
  """One tool call read from the output.

  Attributes:
    name: the function's name, None until the text has named it.
    arguments: the arguments' JSON text so far (all of it once `complete`).
    complete: the call's text has ended.
  """

  name: str | None
  arguments: str
  complete: bool


@dataclasses.dataclass(frozen=True)
class ParsedToolCalls:
  """A reading of a model's output.

  Attributes:
    content: the text outside the calls (so far: text that could still open a call is held
      back until it is known not to).
    calls: the calls, in order.
    cut: the output ended inside a call (`extract_tool_calls`: one cut off before its name is
      not in `calls`).
  """

  content: str
  calls: list[ParsedCall]
  cut: bool = False


class MalformedToolCall(ValueError):
  """The text of a call is not the parser's format (a name missing, JSON that does not parse)."""


class ToolParser:
  """A tool-call format (vLLM's `ToolParser`): subclasses implement `parse`.

  Args:
    tools: the request's `tools` (OpenAI's ``{"type": "function", "function": {"name",
      "parameters"}}``), for formats whose argument values are typed by the schema.
  """

  def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
    self.tools = list(tools or ())

  def parse(self, text: str, final: bool) -> ParsedToolCalls:
    """Reads `text`, the output so far (`final`: all of it).

    Raises:
      MalformedToolCall: for a call the format cannot read.
    """
    raise NotImplementedError

  def extract_tool_calls(self, text: str) -> ParsedToolCalls:
    """The whole output's calls (vLLM's name), as streaming's last reading gives them: a call
    the output ends inside (cut off by `max_tokens`, or left open) is kept as far as it was
    read, its `arguments` not valid JSON and `complete` False, once named (streaming has sent
    it); one cut off before its name is dropped. A call that ended but cannot be read (not the
    format, no name, arguments that are not JSON) makes the output all content, with no calls
    (vLLM's rule)."""
    try:
      parsed = self.parse(text, final=True)
    except MalformedToolCall:
      return ParsedToolCalls(text, [])
    calls = []
    for call in parsed.calls:
      if call.complete and (call.name is None or not is_json(call.arguments)):
        return ParsedToolCalls(text, [])
      if call.name is not None:  # else cut off before its name: streaming never sent it
        calls.append(call)
    cut = not all(call.complete for call in parsed.calls)
    return ParsedToolCalls(parsed.content, calls, cut)

  def parameter_schema(self, function_name: str) -> Mapping[str, Any]:
    """The `parameters` JSON schema of the request's tool of that name ({} if none)."""
    for tool in self.tools:
      function = tool.get("function") or {}
      if function.get("name") == function_name:
        return function.get("parameters") or {}
    return {}


def is_json(text: str) -> bool:
  """Whether `text` parses as JSON."""
  try:
    json.loads(text)
  except ValueError:
    return False
  return True


def held_back(text: str, *tags: str) -> str:
  """`text` without a last part that could be the start of one of `tags` (streaming holds it
  back until the next text says whether a tag opens there)."""
  cut = len(text)
  for tag in tags:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
      if text.endswith(tag[:size]):
        cut = min(cut, len(text) - size)
        break
  return text[:cut]


def content_of(parts: Sequence[str]) -> str:
  """The content around the calls: `parts[0]` is the text before the first call, the others
  the text after each call, which counts only once it is more than whitespace (a newline
  between calls is no content). A prefix of the output gives a prefix of this."""
  return "".join(part for index, part in enumerate(parts) if index == 0 or part.strip())


def parse_tagged(
  text: str,
  final: bool,
  start_tag: str,
  end_tag: str,
  read_call: Callable[[str, bool, bool], ParsedCall],
) -> ParsedToolCalls:
  """A reading of an output whose calls are each between `start_tag` and `end_tag`: the text
  between calls is content (text that may open a call held back unless `final`), each call's
  body read by `read_call(body, final, closed)` (`closed`: its end tag is written); a call left
  open ends the reading."""
  parts, calls, position = [], [], 0
  while (start := text.find(start_tag, position)) >= 0:
    parts.append(text[position:start])
    body_start = start + len(start_tag)
    end = text.find(end_tag, body_start)
    calls.append(read_call(text[body_start : len(text) if end < 0 else end], final, end >= 0))
    if end < 0:
      return ParsedToolCalls(content_of(parts), calls)
    position = end + len(end_tag)
  tail = text[position:]
  parts.append(tail if final else held_back(tail, start_tag))
  return ParsedToolCalls(content_of(parts), calls)
