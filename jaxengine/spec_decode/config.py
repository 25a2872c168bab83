"""`SpeculativeConfig`: the `speculative_config` an engine is built with, vLLM's names."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import cast

from jaxengine.params import is_int

#: The drafting methods `SpeculativeConfig` knows.
METHODS = ("ngram",)
#: The keys of `speculative_config`, vLLM's names.
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """Speculative decoding settings, vLLM's `speculative_config` names.

  Attributes:
    method: "ngram" (prompt lookup: drafts copied from the request's own prompt and output).
    num_speculative_tokens: `k`, the most draft tokens verified per row and step.
    prompt_lookup_max: longest suffix n-gram looked up (default 4, or `prompt_lookup_min` if
      that is larger).
    prompt_lookup_min: shortest suffix n-gram looked up (default 2, or `prompt_lookup_max` if
      that is smaller).
  """

  method: str
  num_speculative_tokens: int
  prompt_lookup_max: int
  prompt_lookup_min: int

  @classmethod
  def build(cls, config: SpeculativeConfig | Mapping | None) -> SpeculativeConfig | None:
    """Validates a `speculative_config` dict (or passes a config or None through).

    Raises:
      ValueError: naming the field and value: an unknown key or method, a missing method or
        `num_speculative_tokens`, a count that is not an int >= 1, or `prompt_lookup_min`
        above `prompt_lookup_max`.
    """
    if config is None or isinstance(config, SpeculativeConfig):
      return config
    if not isinstance(config, Mapping):
      raise ValueError(f"speculative_config must be a dict, got {config!r}")
    unknown = [key for key in config if key not in _KEYS]
    if unknown:
      raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {list(_KEYS)})")
    method = config.get("method")
    if method not in METHODS:
      raise ValueError(f"speculative_config: method must be one of {list(METHODS)}, got {method!r}")
    values: dict[str, int] = {}
    for key in _KEYS[1:]:
      value = config.get(key)
      if value is None and key != "num_speculative_tokens":
        continue
      if not is_int(value) or int(cast(int, value)) < 1:
        raise ValueError(f"speculative_config: {key} must be an int >= 1, got {value!r}")
      values[key] = int(cast(int, value))
    high, low = values.get("prompt_lookup_max"), values.get("prompt_lookup_min")
    high = max(4, low or 0) if high is None else high
    low = min(2, high) if low is None else low
    if low > high:
      raise ValueError(
        f"speculative_config: prompt_lookup_min={low} exceeds prompt_lookup_max={high}"
      )
    return cls(method, values["num_speculative_tokens"], high, low)
