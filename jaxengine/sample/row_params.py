"""`RowParams`: the one table of per-row sampling parameters (shape legend: `R` rows, `V` vocab).

Each field of `RowParams` is one `SamplingParams` value stored per row, declared once with
`row_param`: its dtype, its "off" sentinel, which rows the sampler reads it in, and how a request's
`SamplingParams` encodes it. Everything else follows from that one declaration:

  BatchState        inherits the fields: `state.top_p[row] == params.top_p`, `off` where empty
  RowUpdate         inherits the fields: one request's row, encoded by `encode_row_params`
  write_row         writes every `RowUpdate` field into its `BatchState` field
  SamplingMetadata  inherits the fields: the values the sampler reads (`off` in the rows that do
                    not use them), derived by `refresh_metadata` through `effective_row_params`

So a new per-row sampling parameter is a `SamplingParams` field (`jaxengine.params`), one
`row_param` entry here, and the stage that uses it: it reads `metadata.<name>` and can skip its
work behind `lax.cond(any_row_uses(metadata, "<name>", config), ...)`.

Values with a list per row (stop ids, logit bias, allowlist, bad words) have shapes and encodings
of their own; they are declared once too, on `RowFields` in `jaxengine.sample.state`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any, Generic, Literal, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.config import BatchConfig
from jaxengine.params import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowParam:
  """How one per-row sampling parameter is stored, encoded and read (see `row_param`).

  Attributes:
    dtype: the NumPy dtype of the `[R]` array.
    off: the value that disables the parameter (vLLM's sentinel), or a function of the batch's
      `BatchConfig` giving it (`top_k`'s is `V`). Empty rows of a new state hold it, and
      `SamplingMetadata` puts it in the rows that do not use the parameter.
    used_by: the rows whose value the sampler reads: `"live"` (every request) or `"random"`
      (requests that sample, not greedy ones).
    encode: `encode(params, config)`, the row's value for a validated `SamplingParams` (host
      Python, converted to `dtype`).
  """

  dtype: type
  off: float | int | Callable[[BatchConfig], float | int]
  used_by: Literal["live", "random"]
  encode: Callable[[SamplingParams, BatchConfig], Any]

  def off_value(self, config: BatchConfig) -> float | int:
    """The disabling value for a batch of `config`."""
    return self.off(config) if callable(self.off) else self.off


def row_param(
  dtype: type,
  *,
  off: float | int | Callable[[BatchConfig], float | int],
  used_by: Literal["live", "random"],
  encode: Callable[[SamplingParams, BatchConfig], Any],
) -> dict[str, RowParam]:
  """The `dataclasses.field` metadata declaring a `RowParams` field (see `RowParam`)."""
  return dict(row_param=RowParam(dtype=dtype, off=off, used_by=used_by, encode=encode))


def _vocab_size(config: BatchConfig) -> int:
  return config.vocab_size


def _top_k(params: SamplingParams, config: BatchConfig) -> int:
  """vLLM's `top_k` 0 and -1 (off) and any value >= `V` are all stored as `V`."""
  return params.top_k if 0 < params.top_k < config.vocab_size else config.vocab_size


def _num_logprobs(params: SamplingParams, config: BatchConfig) -> int:
  """`-1` without logprobs, `V` for `logprobs=-1` (the whole vocabulary)."""
  if params.logprobs is None:
    return -1
  return config.vocab_size if params.logprobs == -1 else params.logprobs


def _min_tokens(params: SamplingParams, config: BatchConfig) -> int:
  """A row never holds `max_model_len` outputs: a larger min_tokens means the same (and fits
  int32)."""
  return min(params.min_tokens, config.max_model_len)


#: A row field's type: `jax.Array` in `BatchState` and `SamplingMetadata` (`[R, ...]`), NumPy in a
#: `RowUpdate` (one row on the host, traced inside `write_row`).
Leaf = TypeVar("Leaf")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowParams(Generic[Leaf]):
  """The per-row sampling parameters: `[R]` arrays named like their `SamplingParams` field.

  Attributes:
    temperature: `[R] float32`, `0` for greedy requests (metadata: 1 in greedy and empty rows).
    top_k: `[R] int32`, `V` when disabled.
    top_p: `[R] float32`, `1` when disabled.
    min_p: `[R] float32`, `0` when disabled.
    presence_penalty: `[R] float32`, `0` when disabled.
    frequency_penalty: `[R] float32`, `0` when disabled.
    repetition_penalty: `[R] float32`, `1` when disabled.
    num_logprobs: `[R] int32` requested logprobs (`SamplingParams.logprobs`), `-1` for none,
      `V` for the whole vocabulary.
    min_tokens: `[R] int32` outputs before a stop id may be sampled, at most `S`.
  """

  temperature: Leaf = field(
    metadata=row_param(np.float32, off=1.0, used_by="random", encode=lambda p, c: p.temperature)
  )
  top_k: Leaf = field(
    metadata=row_param(np.int32, off=_vocab_size, used_by="random", encode=_top_k)
  )
  top_p: Leaf = field(
    metadata=row_param(np.float32, off=1.0, used_by="random", encode=lambda p, c: p.top_p)
  )
  min_p: Leaf = field(
    metadata=row_param(np.float32, off=0.0, used_by="random", encode=lambda p, c: p.min_p)
  )
  presence_penalty: Leaf = field(
    metadata=row_param(np.float32, off=0.0, used_by="live", encode=lambda p, c: p.presence_penalty)
  )
  frequency_penalty: Leaf = field(
    metadata=row_param(np.float32, off=0.0, used_by="live", encode=lambda p, c: p.frequency_penalty)
  )
  repetition_penalty: Leaf = field(
    metadata=row_param(
      np.float32, off=1.0, used_by="live", encode=lambda p, c: p.repetition_penalty
    )
  )
  num_logprobs: Leaf = field(
    metadata=row_param(np.int32, off=-1, used_by="live", encode=_num_logprobs)
  )
  min_tokens: Leaf = field(metadata=row_param(np.int32, off=0, used_by="live", encode=_min_tokens))


def row_param_specs() -> dict[str, RowParam]:
  """`{name: RowParam}` for every `RowParams` field, in declaration order."""
  return {f.name: f.metadata["row_param"] for f in dataclasses.fields(RowParams)}


def empty_row_params(config: BatchConfig) -> dict[str, np.ndarray]:
  """`{name: [R] array}` every row disabled (each parameter's `off` value, in its dtype; host
  NumPy, `BatchState.create` sends them with the rest)."""
  return {
    name: np.full((config.max_num_reqs,), spec.off_value(config), spec.dtype)
    for name, spec in row_param_specs().items()
  }


def encode_row_params(params: SamplingParams, config: BatchConfig) -> dict[str, np.ndarray]:
  """`{name: [] array}` one request's row of each parameter (host NumPy, explicit dtypes, so a
  row update never retraces)."""
  return {
    name: np.asarray(spec.encode(params, config), spec.dtype)
    for name, spec in row_param_specs().items()
  }


def effective_row_params(
  values: RowParams[jax.Array], config: BatchConfig, is_live: jax.Array, is_random: jax.Array
) -> dict[str, jax.Array]:
  """`{name: [R] array}` the values the sampler reads: each parameter's own value in the rows
  that use it (`is_live` or `is_random`, per its `used_by`), its `off` value elsewhere.

  Args:
    values: the batch state.
    config: its configuration (for config-dependent `off` values).
    is_live: `[R] bool` rows that hold a request.
    is_random: `[R] bool` live rows that sample (not greedily).
  """
  rows = {"live": is_live, "random": is_random}
  return {
    name: jnp.where(rows[spec.used_by], getattr(values, name), spec.off_value(config))
    for name, spec in row_param_specs().items()
  }


def any_row_uses(metadata: RowParams[jax.Array], name: str, config: BatchConfig) -> jax.Array:
  """`[] bool` whether some row's effective `name` differs from its `off` value: the traced flag
  a stage puts behind `lax.cond` to skip its work when no row uses the parameter.

  Args:
    metadata: the `SamplingMetadata` (effective values, `off` in rows that do not use `name`).
    name: a `RowParams` field.
    config: the batch's configuration.
  """
  spec = row_param_specs()[name]
  return (getattr(metadata, name) != spec.off_value(config)).any()
