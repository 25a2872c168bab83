"""A checkpoint's sampling defaults, read from its ``generation_config.json`` (vLLM's
`LLM.get_default_sampling_params`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: ``generation_config.json`` keys vLLM takes as sampling defaults -> the `SamplingParams` field.
GENERATION_DEFAULTS = {
  "repetition_penalty": "repetition_penalty",
  "temperature": "temperature",
  "top_k": "top_k",
  "top_p": "top_p",
  "min_p": "min_p",
  "max_new_tokens": "max_tokens",
}


def generation_defaults(directory: str | os.PathLike | None) -> dict[str, Any]:
  """The sampling defaults a Hugging Face model directory's ``generation_config.json`` sets.

  Args:
    directory: the model directory; None (a GGUF file, a built model) has none.

  Returns:
    `SamplingParams` keywords (``{"temperature": 0.6, "top_p": 0.9}``): the keys of
    `GENERATION_DEFAULTS` the file gives a value, under the field's name; empty without the
    file (or when it is not a JSON object).

  Raises:
    ValueError: the file is not valid JSON (naming it).
  """
  if directory is None:
    return {}
  path = Path(directory) / "generation_config.json"
  if not path.is_file():
    return {}
  try:
    config = json.loads(path.read_text())
  except json.JSONDecodeError as error:
    raise ValueError(f"{path} is not valid JSON: {error}") from None
  if not isinstance(config, dict):
    return {}
  return {
    field: config[key] for key, field in GENERATION_DEFAULTS.items() if config.get(key) is not None
  }
