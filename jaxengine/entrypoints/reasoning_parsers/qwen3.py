"""Qwen3's reasoning: ``<think>...</think>`` in the output; an output without ``<think>`` has no
reasoning (Qwen3 with ``enable_thinking`` off, or a model that does not reason)."""

from __future__ import annotations

from jaxengine.entrypoints.reasoning_parsers.abstract_reasoning_parser import (
  ParsedReasoning,
  ReasoningParser,
)
from jaxengine.entrypoints.tool_parsers.abstract_tool_parser import held_back


class Qwen3ReasoningParser(ReasoningParser):
  """vLLM's ``--reasoning-parser qwen3``: the text between ``<think>`` and ``</think>`` is the
  reasoning (all that follows ``<think>`` when ``</think>`` never comes: the output ended
  while reasoning); the text before and after is content."""

  def parse(self, text: str, final: bool) -> ParsedReasoning:
    start = text.find(self.start_tag)
    if start < 0:
      return ParsedReasoning(None, text if final else held_back(text, self.start_tag))
    reasoning, after = self._reasoning_then_content(text[start + len(self.start_tag) :], final)
    return ParsedReasoning(reasoning, text[:start] + after)
