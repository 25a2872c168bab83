"""Reasoning parsers (vLLM's ``--reasoning-parser``), by name: each splits a model's output into
its reasoning (``message.reasoning_content``) and its answer (``message.content``).

  qwen3         ``<think>reasoning</think>answer``; no ``<think>``: no reasoning (`qwen3.py`)
  deepseek_r1   ``[<think>]reasoning</think>answer``: the start tag optional (`deepseek_r1.py`)
"""

from __future__ import annotations

from jaxengine.entrypoints.reasoning_parsers.abstract_reasoning_parser import (
  ParsedReasoning,
  ReasoningParser,
)
from jaxengine.entrypoints.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from jaxengine.entrypoints.reasoning_parsers.qwen3 import Qwen3ReasoningParser

#: The parsers by their ``--reasoning-parser`` name.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
  "deepseek_r1": DeepSeekR1ReasoningParser,
  "qwen3": Qwen3ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "ParsedReasoning", "ReasoningParser", "reasoning_parser_class"]


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
  """The parser named `name`.

  Raises:
    ValueError: for an unknown name, listing the known ones.
  """
  if name not in REASONING_PARSERS:
    raise ValueError(
      f"unknown reasoning_parser {name!r}: the known ones are {sorted(REASONING_PARSERS)}"
    )
  return REASONING_PARSERS[name]
