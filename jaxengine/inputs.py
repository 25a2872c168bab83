"""vLLM's module path `vllm.inputs`: the prompt dicts `TextPrompt` and `TokensPrompt`.

Both are plain dicts (`typing.TypedDict`), as in vLLM: ``TokensPrompt(prompt_token_ids=ids)``
is ``{"prompt_token_ids": ids}``, a prompt `LLM.generate`, `LLMEngine.add_request` and
`AsyncLLM.generate` take. Only the keys below are accepted (vLLM's multimodal and
`cache_salt` keys are refused with a ValueError naming them).
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
  """A text prompt: ``{"prompt": text}`` (tokenized by the engine's tokenizer)."""

  prompt: str


class TokensPrompt(TypedDict):
  """A token-id prompt: ``{"prompt_token_ids": ids}``, optionally with its ``"prompt"`` text
  (returned in `RequestOutput.prompt`; not tokenized)."""

  prompt_token_ids: list[int]
  prompt: NotRequired[str]


__all__ = ["TextPrompt", "TokensPrompt"]
