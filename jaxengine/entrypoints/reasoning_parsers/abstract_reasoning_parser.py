"""What every reasoning parser gives: the reasoning a model wrote before its answer, and the
answer (content), read from its output or from a prefix of it (streaming).

As with tool-call parsers (`jaxengine/entrypoints/tool_parsers/abstract_tool_parser.py`), a
reading of a prefix never contradicts the whole's: its reasoning and content are prefixes of
the whole's (a tag being written is held back until it is known to be one)."""

from __future__ import annotations

import dataclasses

from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import held_back


@dataclasses.dataclass(frozen=True)
class ParsedReasoning:
  """A reading of a model's output.

  Attributes:
    reasoning: the reasoning's text, None when the output has no reasoning block.
    content: the rest of the output.
  """

  reasoning: str | None
  content: str


class ReasoningParser:
  """A reasoning format (vLLM's `ReasoningParser`): `start_tag` and `end_tag` around the
  reasoning; subclasses implement `parse`."""

  start_tag = "<think>"
  end_tag = "</think>"

  def parse(self, text: str, final: bool) -> ParsedReasoning:
    """Reads `text`, the output so far (`final`: all of it)."""
    raise NotImplementedError

  def _reasoning_then_content(self, rest: str, final: bool) -> tuple[str, str]:
    """`rest` (what follows the start tag, or the output where the start tag may be absent)
    split at the end tag: (reasoning, content); all reasoning while the end tag is not written
    (a part of it held back unless `final`)."""
    end = rest.find(self.end_tag)
    if end < 0:
      return (rest if final else held_back(rest, self.end_tag)), ""
    return rest[:end], rest[end + len(self.end_tag) :]
