"""The shape of a completions `prompt` (text, token ids, or a batch of either), checked before
pydantic's union of types, so that a 400 names the element at fault (pydantic's own error names
only the first type of the union it tried: ``prompt.str``).
"""

from __future__ import annotations

import json
from typing import Any


def _is_token_id(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no token id


def check_prompt_shape(prompt: Any) -> Any:
  """Returns `prompt` when it is a string, a list of token ids (ints), a list of strings or a
  list of token-id lists; an empty list is left to `CompletionRequest.prompts`.

  Raises:
    ValueError: naming the first element at fault and its position (``prompt[1]``, or
      ``prompt[0][2]`` in a batch), e.g. a JSON boolean or float among token ids, or a string
      in a batch of token-id lists (a batch is all texts or all token-id lists).
  """
  if isinstance(prompt, str):
    return prompt
  if not isinstance(prompt, list):
    raise ValueError(
      f"prompt must be a string, a list of token ids, or a list of either, got {prompt!r}"
    )
  if not prompt:
    return prompt
  first = prompt[0]
  if isinstance(first, str):
    kind, ok = "a string (the batch's first element is text)", lambda v: isinstance(v, str)
  elif isinstance(first, list):
    kind, ok = "a list of token ids (the batch's first element is one)", _id_list
  else:
    kind, ok = "a token id (a JSON integer)", _is_token_id
  for i, element in enumerate(prompt):
    if not ok(element):
      where = f"prompt[{i}]"
      if isinstance(element, list) and isinstance(first, list):
        j = next(j for j, v in enumerate(element) if not _is_token_id(v))
        where, element, kind = f"{where}[{j}]", element[j], "a token id (a JSON integer)"
      raise ValueError(f"{where} must be {kind}, got {_json(element)}")
  return prompt


def _id_list(value: Any) -> bool:
  return isinstance(value, list) and all(_is_token_id(v) for v in value)


def _json(value: Any) -> str:
  """`value` as the client wrote it in JSON (true, not True)."""
  try:
    return json.dumps(value)
  except (TypeError, ValueError):
    return repr(value)
