"""DeepSeek-R1's reasoning: the output opens with the reasoning, up to ``</think>``; the opening
``<think>`` may be absent (the chat template of DeepSeek-R1 puts it in the prompt)."""

from __future__ import annotations

from jaxengine.entrypoints.reasoning_parsers.abstract_reasoning_parser import (
  ParsedReasoning,
  ReasoningParser,
)


class DeepSeekR1ReasoningParser(ReasoningParser):
  """vLLM's ``--reasoning-parser deepseek_r1``: the text up to ``</think>`` (after a leading
  ``<think>``, if any) is the reasoning, the rest content; without ``</think>`` it is all
  reasoning (the output ended while reasoning)."""

  def parse(self, text: str, final: bool) -> ParsedReasoning:
    if text.startswith(self.start_tag):
      text = text[len(self.start_tag) :]
    elif self.start_tag.startswith(text) and not final:
      return ParsedReasoning("", "")  # the start tag may be being written
    reasoning, content = self._reasoning_then_content(text, final)
    return ParsedReasoning(reasoning, content)
