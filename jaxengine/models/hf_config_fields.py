"""Typed reads of a Hugging Face ``config.json``'s fields, shared by every config reader
(`llama_checkpoints.config_from_hf`, `gemma_checkpoints.config_from_hf`).

JSON gives each field its own type: a size written as ``"576"`` (a string), ``null`` or
``4.5`` is a broken config, not a number to convert. Each reader here checks the type and raises
a ValueError naming the field and its value, so ``LLM(model)`` and ``jaxengine compile`` refuse
such a file the same way. An absent field, or ``null`` where a default exists, takes the default
(transformers writes ``null`` for "the default", e.g. ``"head_dim": null``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _wrong_type(key: str, value: Any, wanted: str) -> ValueError:
  return ValueError(f"config.json field {key!r} must be {wanted}, got {value!r}")


def _is_int(value: Any) -> bool:
  """An integer in JSON: an int (not a bool), or a float with no fraction (``4096.0``)."""
  if isinstance(value, bool):
    return False
  return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def config_int(hf: Mapping[str, Any], key: str, default: int | None = None) -> int:
  """``hf[key]`` as an int; `default` when absent or null (None: the field is required).

  Raises:
    ValueError: the field is missing or null without a default, or not an integer (naming the
      field and its value).
  """
  value = hf.get(key)
  if value is None:
    if default is not None:
      return default
    if key not in hf:
      raise ValueError(f"config.json lacks {key!r}")
  if value is None or not _is_int(value):
    raise _wrong_type(key, value, "an integer")
  return int(value)


def config_optional_int(hf: Mapping[str, Any], key: str) -> int | None:
  """``hf[key]`` as an int, or None when absent or null.

  Raises:
    ValueError: a value that is not an integer (naming the field and its value).
  """
  value = hf.get(key)
  return None if value is None else config_int(hf, key)


def config_float(hf: Mapping[str, Any], key: str, default: float | None = None) -> float:
  """``hf[key]`` as a float (an int is taken too); `default` when absent or null (None:
  required).

  Raises:
    ValueError: the field is missing or null without a default, or not a number (naming the
      field and its value).
  """
  value = hf.get(key)
  if value is None:
    if default is not None:
      return float(default)
    if key not in hf:
      raise ValueError(f"config.json lacks {key!r}")
  if isinstance(value, bool) or not isinstance(value, (int, float)):  # None included
    raise _wrong_type(key, value, "a number")
  return float(value)


def config_optional_float(hf: Mapping[str, Any], key: str) -> float | None:
  """``hf[key]`` as a float, or None when absent or null.

  Raises:
    ValueError: a value that is not a number (naming the field and its value).
  """
  return None if hf.get(key) is None else config_float(hf, key)


def config_bool(hf: Mapping[str, Any], key: str, default: bool) -> bool:
  """``hf[key]`` as a bool (``true``/``false``); `default` when absent or null.

  Raises:
    ValueError: any other value (naming the field and its value).
  """
  value = hf.get(key)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise _wrong_type(key, value, "true or false")
  return value


def config_token_id(hf: Mapping[str, Any], key: str) -> int | None:
  """A token id field (``bos_token_id``, ``eos_token_id``): an id, or the first of a list of
  ids (Llama 3.1 lists several EOS ids); None when absent, null or an empty list.

  Raises:
    ValueError: a value that is not an integer or a list of them (naming the field and value).
  """
  value = hf.get(key)
  if isinstance(value, (list, tuple)):
    if not value:
      return None
    if not all(_is_int(v) for v in value):
      raise _wrong_type(key, value, "an integer or a list of integers")
    return int(value[0])
  return config_optional_int(hf, key)
