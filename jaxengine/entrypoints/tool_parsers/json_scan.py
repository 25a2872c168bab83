"""Reading JSON as it is written: where a value ends (or that the text ends first), and a call
object ``{"name": ..., "arguments": {...}}`` read from its prefix, its arguments as their raw
text (so that a prefix of the text gives a prefix of the arguments)."""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import MalformedToolCall, ParsedCall

_WHITESPACE = " \t\n\r"
_STRUCTURE = re.compile(r'["{}\[\]]')
_PRIMITIVE = re.compile(r"[A-Za-z0-9+\-.]*")


def skip_whitespace(text: str, index: int) -> int:
  """The index of the first non-whitespace character at or after `index` (or `len(text)`)."""
  while index < len(text) and text[index] in _WHITESPACE:
    index += 1
  return index


def string_end(text: str, start: int) -> int | None:
  """The end (exclusive) of the JSON string whose opening quote is `text[start]`; None if the
  text ends inside it."""
  index = start + 1
  while True:
    quote = text.find('"', index)
    if quote < 0:
      return None
    backslashes = 0
    while text[quote - 1 - backslashes] == "\\":
      backslashes += 1
    if backslashes % 2 == 0:
      return quote + 1
    index = quote + 1


def value_end(text: str, start: int, final: bool) -> int | None:
  """The end (exclusive) of the JSON value that starts at `text[start]`; None if the text ends
  inside it (a number or literal at the end of a text that is not `final` may go on).

  Raises:
    MalformedToolCall: no value starts there.
  """
  if start >= len(text):
    return None
  first = text[start]
  if first == '"':
    return string_end(text, start)
  if first in "{[":
    depth, index = 0, start
    while (match := _STRUCTURE.search(text, index)) is not None:
      char, index = match.group(), match.start()
      if char == '"':
        end = string_end(text, index)
        if end is None:
          return None
        index = end
        continue
      depth += 1 if char in "{[" else -1
      index += 1
      if depth == 0:
        return index
    return None
  end = _PRIMITIVE.match(text, start).end()  # type: ignore[union-attr]
  if end == start:
    raise MalformedToolCall(f"no JSON value starts at {text[start : start + 20]!r}")
  return end if end < len(text) or final else None


def partial_call(text: str, start: int, final: bool,
                 arguments_keys: Collection[str]) -> tuple[ParsedCall, int | None]:  # fmt: skip
  """The call object that starts at `text[start]` (after whitespace): ``{"name": str,
  KEY: value}`` for a KEY of `arguments_keys`, in either order.

  Returns:
    The call read so far (its arguments the raw text of their value, "{}" when a complete
    object has none) and the end of its object (exclusive; None while it is open).

  Raises:
    MalformedToolCall: text that is no such object (a name that is not a string included).
  """
  index = skip_whitespace(text, start)
  name: str | None = None
  arguments: str | None = None
  if index < len(text) and text[index] != "{":
    raise MalformedToolCall(f"a call is a JSON object, got {text[index : index + 20]!r}")
  index += 1
  while (index := skip_whitespace(text, index)) < len(text):
    char = text[index]
    if char == "}":
      return ParsedCall(name, "{}" if arguments is None else arguments, True), index + 1
    if char == ",":
      index += 1
      continue
    if char != '"':
      raise MalformedToolCall(f"expected a key, got {text[index : index + 20]!r}")
    key_end = string_end(text, index)
    if key_end is None:
      break
    key = json.loads(text[index:key_end])
    colon = skip_whitespace(text, key_end)
    if colon >= len(text):
      break
    if text[colon] != ":":
      raise MalformedToolCall(f"expected ':' after {key!r}")
    value_start = skip_whitespace(text, colon + 1)
    end = value_end(text, value_start, final=False)
    if key in arguments_keys:
      arguments = text[value_start : len(text) if end is None else end]
    if end is None:
      break
    if key == "name":
      name = json.loads(text[value_start:end])
      if not isinstance(name, str):
        raise MalformedToolCall(f"a call's name must be a string, got {name!r}")
    index = end
  return ParsedCall(name, arguments or "", False), None
