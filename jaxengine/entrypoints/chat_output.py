"""A chat choice's text as OpenAI's message, or its deltas as OpenAI's streamed deltas: the
reasoning split off (``reasoning_content``, with ``--reasoning-parser``) and the tool calls read
out of the rest (``tool_calls``, with ``tool_choice`` "auto" and ``--tool-call-parser``, or the
calls "required" or a named function forced), the text left being the content.

Streaming reads the whole text so far at each step and sends what it adds to the last reading
(the parsers' readings of a prefix never contradict the whole's): reasoning and content as
text, each call first with its index, id, type and name (arguments ""), then its argument
fragments, as OpenAI streams them. A call the output ends inside is, streamed or not, the call
as far as it was read, and the choice keeps the engine's finish_reason (not "tool_calls").
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from jaxengine.entrypoints.protocol import RequestError
from jaxengine.entrypoints.reasoning_parsers import ReasoningParser, reasoning_parser_class
from jaxengine.entrypoints.tool_choice import (
  NamedFunctionParser,
  RequiredCallsParser,
  named_function,
)
from jaxengine.entrypoints.tool_parsers import (
  MalformedToolCall,
  ParsedToolCalls,
  ToolParser,
  tool_parser_class,
)


def tool_call_id() -> str:
  """A new tool call's id (vLLM's form)."""
  return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclasses.dataclass(frozen=True)
class ChatOutputParser:
  """How a request's choices become messages.

  Attributes:
    reasoning_parser: splits off the reasoning, or None.
    tool_parser: reads the calls out of the content, or None (all content).
    finish_reason_rule: when calls were made, the finish_reason: "auto" ("tool_calls"),
      "required" ("tool_calls" if the engine's was "stop"), "named" (the engine's: "stop",
      as OpenAI's for a named function).
  """

  reasoning_parser: ReasoningParser | None = None
  tool_parser: ToolParser | None = None
  finish_reason_rule: str = "auto"

  @property
  def is_plain(self) -> bool:
    """The text is all content (no parser applies)."""
    return self.reasoning_parser is None and self.tool_parser is None

  def finish_reason(self, tools_called: bool, finish_reason: str | None) -> str | None:
    """The choice's finish_reason given whether it called tools and the engine's (None: not
    finished)."""
    if finish_reason is None or not tools_called or self.finish_reason_rule == "named":
      return finish_reason
    if self.finish_reason_rule == "required" and finish_reason != "stop":
      return finish_reason
    return "tool_calls"

  def message(self, text: str) -> tuple[dict[str, Any], bool]:
    """A whole choice's message fields (``content``, ``reasoning_content`` with a reasoning
    parser, ``tool_calls`` when calls were read) and whether it called tools: calls were made
    and none was cut off. A call cut off by the end of the output is in ``tool_calls`` as far
    as it was read (its arguments not valid JSON), as the stream sent it; its choice keeps the
    engine's finish_reason ("length"), not "tool_calls" (`ToolParser.extract_tool_calls`)."""
    if self.is_plain:
      return {"content": text}, False
    message: dict[str, Any] = {}
    content = text
    if self.reasoning_parser is not None:
      parsed = self.reasoning_parser.parse(text, final=True)
      message["reasoning_content"] = parsed.reasoning or None
      content = parsed.content
    if self.tool_parser is None:
      return {"content": content or None, **message}, False
    tools = self.tool_parser.extract_tool_calls(content)
    calls = [
      {"id": tool_call_id(), "type": "function",
       "function": {"name": call.name, "arguments": call.arguments}}
      for call in tools.calls
    ]  # fmt: skip
    message["content"] = tools.content if tools.content.strip() else None
    if calls:
      message["tool_calls"] = calls
    return message, bool(calls) and not tools.cut

  def stream(self) -> ChoiceStream:
    """A new choice's streaming state."""
    return ChoiceStream(self)


class ChoiceStream:
  """One streamed choice: its text so far and what its deltas have sent of it."""

  def __init__(self, parser: ChatOutputParser) -> None:
    self.parser = parser
    self.text = ""
    self.sent_reasoning = 0
    self.sent_content = 0
    self.ids: list[str] = []  # one per call whose name was sent
    self.sent_arguments: list[int] = []
    self.broken = False  # a call the tool parser cannot read: nothing more of calls is sent
    self.calls_complete = True  # no call of the last reading was left open

  @property
  def tools_called(self) -> bool:
    """Calls were sent and (after the last delta) none was cut off, as `message` says."""
    return bool(self.ids) and self.calls_complete and not self.broken

  def delta(self, text: str, final: bool) -> dict[str, Any]:
    """The delta of `text`, the choice's new text (`final`: its last): ``reasoning_content``,
    ``content``, ``tool_calls`` as far as each has grown; {} when nothing can be sent yet."""
    if self.parser.is_plain:
      return {"content": text}
    self.text += text
    delta: dict[str, Any] = {}
    content = self.text
    if self.parser.reasoning_parser is not None:
      parsed = self.parser.reasoning_parser.parse(self.text, final)
      reasoning = parsed.reasoning or ""
      if len(reasoning) > self.sent_reasoning:
        delta["reasoning_content"] = reasoning[self.sent_reasoning :]
        self.sent_reasoning = len(reasoning)
      content = parsed.content
    if self.parser.tool_parser is None:
      self._add_content(delta, content)
      return delta
    if self.broken:
      return delta
    try:
      tools = self.parser.tool_parser.parse(content, final)
    except MalformedToolCall:
      self.broken = True
      return delta
    # Whitespace alone is no content yet (the message's content is None then).
    self._add_content(delta, tools.content if tools.content.strip() else "")
    calls = self._call_deltas(tools)
    self.calls_complete = all(call.complete for call in tools.calls)
    if calls:
      delta["tool_calls"] = calls
    return delta

  def _add_content(self, delta: dict[str, Any], content: str) -> None:
    if len(content) > self.sent_content:
      delta["content"] = content[self.sent_content :]
      self.sent_content = len(content)

  def _call_deltas(self, tools: ParsedToolCalls) -> list[dict[str, Any]]:
    out = []
    for index, call in enumerate(tools.calls):
      if call.name is None:
        break  # later calls wait for this one's name: indices are sent in order
      entry: dict[str, Any] = {"index": index}
      if index == len(self.ids):
        self.ids.append(tool_call_id())
        self.sent_arguments.append(0)
        entry.update(id=self.ids[index], type="function", function={"name": call.name})
      fragment = call.arguments[self.sent_arguments[index] :]
      if fragment or "id" in entry:
        entry.setdefault("function", {})["arguments"] = fragment
        self.sent_arguments[index] = len(call.arguments)
        out.append(entry)
    return out


@dataclasses.dataclass(frozen=True)
class ChatParserOptions:
  """The server's tool and reasoning options (vLLM's flags).

  Attributes:
    enable_auto_tool_choice: ``--enable-auto-tool-choice``: `tool_choice` "auto" with tools is
      allowed (else a 400).
    tool_parser: ``--tool-call-parser``'s class, or None.
    reasoning_parser: ``--reasoning-parser``'s class, or None.
  """

  enable_auto_tool_choice: bool = False
  tool_parser: type[ToolParser] | None = None
  reasoning_parser: type[ReasoningParser] | None = None

  @classmethod
  def from_names(cls, enable_auto_tool_choice: bool, tool_call_parser: str | None,
                 reasoning_parser: str | None) -> ChatParserOptions:  # fmt: skip
    """The options of the flags' values.

    Raises:
      ValueError: an unknown parser name (listing the known ones), or
        `enable_auto_tool_choice` without a `tool_call_parser`.
    """
    if enable_auto_tool_choice and tool_call_parser is None:
      raise ValueError(
        "enable_auto_tool_choice needs a tool_call_parser (--enable-auto-tool-choice needs "
        "--tool-call-parser)"
      )
    return cls(
      enable_auto_tool_choice,
      None if tool_call_parser is None else tool_parser_class(tool_call_parser),
      None if reasoning_parser is None else reasoning_parser_class(reasoning_parser),
    )

  def output_parser(
    self, tools: list[dict[str, Any]] | None, tool_choice: str | Mapping[str, Any]
  ) -> ChatOutputParser:
    """The parser of a request's choices (a forced call's output is the call alone: no
    reasoning is read from it).

    Args:
      tools: the request's `tools`.
      tool_choice: its checked `tool_choice` (`ChatCompletionRequest.effective_tool_choice`).

    Raises:
      RequestError: naming `tool_choice`, for "auto" with tools on a server without
        ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (vLLM's 400).
    """
    if isinstance(tool_choice, Mapping):
      return ChatOutputParser(None, NamedFunctionParser(named_function(tool_choice)), "named")
    if tool_choice == "required":
      return ChatOutputParser(None, RequiredCallsParser(tools), "required")
    reasoning = self.reasoning_parser() if self.reasoning_parser is not None else None
    if tool_choice != "auto" or not tools:
      return ChatOutputParser(reasoning, None)
    if not self.enable_auto_tool_choice or self.tool_parser is None:
      raise RequestError(
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
        'set (or send tool_choice "required", a named function, or "none")',
        "tool_choice",
      )
    return ChatOutputParser(reasoning, self.tool_parser(tools), "auto")
