"""`SpeculativeConfig`: the `speculative_config` an engine is built with, vLLM's names."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, cast

from jaxengine.params import is_int

#: The drafting methods `SpeculativeConfig` knows.
METHODS = ("ngram", "suffix")
#: The keys of `speculative_config`, vLLM's names: the common ones, then each method's own.
_COMMON_KEYS = ("method", "num_speculative_tokens")
_METHOD_KEYS = {
  "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
  "suffix": (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
  ),
}
_KEYS = _COMMON_KEYS + tuple(key for keys in _METHOD_KEYS.values() for key in keys)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """Speculative decoding settings, vLLM's `speculative_config` names.

  Attributes:
    method: "ngram" (prompt lookup: drafts copied from the request's own prompt and output,
      `spec_decode/ngram_proposer.py`) or "suffix" (suffix decoding: drafts from suffix trees
      over the request's prompt, its output and the outputs of the other samples of its prompt,
      and over recent finished outputs, `spec_decode/suffix_proposer.py`).
    num_speculative_tokens: `k`, the most draft tokens verified per row and step (the draft
      slots of the verify step). Required for "ngram"; for "suffix" it defaults to
      `suffix_decoding_max_tree_depth`, as in vLLM (suffix drafts are of adaptive length, `k`
      their cap).
    prompt_lookup_max: ("ngram") longest suffix n-gram looked up (default 4, or
      `prompt_lookup_min` if that is larger).
    prompt_lookup_min: ("ngram") shortest suffix n-gram looked up (default 2, or
      `prompt_lookup_max` if that is smaller).
    suffix_decoding_max_tree_depth: ("suffix") depth of the suffix trees, an int >= 1 (default
      24): the longest context matched plus the draft after it, so a draft never passes
      `depth - 1` tokens.
    suffix_decoding_max_cached_requests: ("suffix") finished completions whose outputs are kept
      for other requests' drafts, an int >= 0 (default 10000); past it the oldest is dropped
      (first in, first out). 0 keeps none: drafts then come from the request itself and the
      running samples of its prompt only.
    suffix_decoding_max_spec_factor: ("suffix") a draft is at most `factor * m` tokens, `m` the
      length of the context it was matched on (a float >= 0, default 1.0): short matches draft
      short.
    suffix_decoding_min_token_prob: ("suffix") a draft stops before the first token whose
      estimated probability (the product of the frequencies of the continuations taken, from the
      counts in the tree) falls below it: a float in [0, 1] (default 0.1; 0: no cut).
  """

  method: str
  num_speculative_tokens: int
  prompt_lookup_max: int = 4
  prompt_lookup_min: int = 2
  suffix_decoding_max_tree_depth: int = 24
  suffix_decoding_max_cached_requests: int = 10000
  suffix_decoding_max_spec_factor: float = 1.0
  suffix_decoding_min_token_prob: float = 0.1

  @classmethod
  def build(cls, config: SpeculativeConfig | Mapping | None) -> SpeculativeConfig | None:
    """Validates a `speculative_config` dict (or passes a config or None through).

    Raises:
      ValueError: naming the field and value: an unknown key or method, a key of another
        method, a missing method or (for "ngram") `num_speculative_tokens`, a count that is not
        an int >= 1 (`suffix_decoding_max_cached_requests`: >= 0), `prompt_lookup_min` above
        `prompt_lookup_max`, a spec factor that is not a finite number >= 0 or a token
        probability outside [0, 1].
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
    own = _METHOD_KEYS[method]
    for key in config:
      if key not in _COMMON_KEYS and key not in own:
        raise ValueError(
          f"speculative_config: {key} does not apply to method {method!r} (its keys: {list(own)})"
        )
    if method == "ngram":
      return _ngram(config)
    return _suffix(config)


def _count(config: Mapping, key: str, minimum: int = 1) -> int | None:
  """`config[key]` as an int >= `minimum`, None when absent (ValueError naming it otherwise)."""
  value = config.get(key)
  if value is None:
    return None
  if not is_int(value) or int(cast(int, value)) < minimum:
    raise ValueError(f"speculative_config: {key} must be an int >= {minimum}, got {value!r}")
  return int(cast(int, value))


def _number(config: Mapping, key: str, default: float, high: float = math.inf) -> float:
  """`config[key]` as a finite float in `[0, high]` (ValueError naming it otherwise)."""
  value: Any = config.get(key, default)
  valid = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not valid or not math.isfinite(value) or not 0 <= value <= high:
    bound = f"in [0, {high:g}]" if math.isfinite(high) else "a finite number >= 0"
    raise ValueError(f"speculative_config: {key} must be {bound}, got {value!r}")
  return float(value)


def _ngram(config: Mapping) -> SpeculativeConfig:
  k = _count(config, "num_speculative_tokens")
  if k is None:
    raise ValueError("speculative_config: num_speculative_tokens must be an int >= 1, got None")
  high, low = _count(config, "prompt_lookup_max"), _count(config, "prompt_lookup_min")
  high = max(4, low or 0) if high is None else high
  low = min(2, high) if low is None else low
  if low > high:
    raise ValueError(
      f"speculative_config: prompt_lookup_min={low} exceeds prompt_lookup_max={high}"
    )
  return SpeculativeConfig("ngram", k, prompt_lookup_max=high, prompt_lookup_min=low)


def _suffix(config: Mapping) -> SpeculativeConfig:
  depth = _count(config, "suffix_decoding_max_tree_depth") or 24
  cached = _count(config, "suffix_decoding_max_cached_requests", minimum=0)
  k = _count(config, "num_speculative_tokens") or depth
  return SpeculativeConfig(
    "suffix",
    k,
    suffix_decoding_max_tree_depth=depth,
    suffix_decoding_max_cached_requests=10000 if cached is None else cached,
    suffix_decoding_max_spec_factor=_number(config, "suffix_decoding_max_spec_factor", 1.0),
    suffix_decoding_min_token_prob=_number(config, "suffix_decoding_min_token_prob", 0.1, 1.0),
  )
