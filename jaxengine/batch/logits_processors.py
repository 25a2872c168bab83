"""Building the batch's `LogitsProcessor`s and encoding a request's rows of their state (host).

`resolve_logits_processors` turns what a user passes (classes, instances, `"module:Class"`
strings) into instances; `encode_processor_rows` asks each processor for the request's row and
converts it to the dtypes and shapes of the state, so every request hands `write_row` a pytree of
one structure (no retrace) and a refused request changes nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import jax
import numpy as np

from jaxengine.sample.custom import LogitsProcessor


def resolve_logits_processors(specs: Sequence | None) -> tuple[LogitsProcessor, ...]:
  """Instances from classes (built with no arguments), instances or `"module:Class"` strings.

  Raises:
    ValueError: naming the entry, for a string that does not name an importable
      `LogitsProcessor` subclass, or anything that is not a `LogitsProcessor`.
  """
  if specs is None:
    return ()
  if isinstance(specs, (str, type, LogitsProcessor)):
    specs = [specs]
  processors = []
  for spec in specs:
    if isinstance(spec, str):
      module_name, _, class_name = spec.partition(":")
      try:
        spec = getattr(importlib.import_module(module_name), class_name)
      except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
          f"logits_processors: cannot import {spec!r} (expected 'module:Class'): {error}"
        ) from None
    if isinstance(spec, type) and issubclass(spec, LogitsProcessor):
      spec = spec()
    if not isinstance(spec, LogitsProcessor):
      raise ValueError(
        f"logits_processors entries must be LogitsProcessor classes, instances or "
        f"'module:Class' strings, got {spec!r}"
      )
    processors.append(spec)
  return tuple(processors)


def encode_processor_rows(
  processors: Sequence[LogitsProcessor],
  empty_states: tuple,
  params,
  prompt_token_ids: list[int],
) -> tuple[tuple, np.ndarray]:
  """Each processor's row for one request.

  Args:
    processors: the batch's processors.
    empty_states: their `init_state` pytrees (only shapes and dtypes are read).
    params: the request's `SamplingParams`.
    prompt_token_ids: the prompt.

  Returns:
    `(rows, active)`: a tuple of row pytrees (zeros where a processor does not act) and
    `[P] bool` whether each processor acts on the request.

  Raises:
    ValueError: from a processor's `row_state` (it refuses the request), or naming the
      processor when its row does not match its state's structure, shapes or dtypes.
  """
  rows, active = [], np.zeros((len(processors),), bool)
  for index, (processor, empty) in enumerate(zip(processors, empty_states, strict=True)):
    zeros = jax.tree.map(lambda a: np.zeros(a.shape[1:], a.dtype), empty)
    row = processor.row_state(params, prompt_token_ids)
    if row is None:
      rows.append(zeros)
      continue
    name = type(processor).__name__
    try:
      row = jax.tree.map(
        lambda z, v: np.broadcast_to(np.asarray(v, z.dtype), z.shape).copy(), zeros, row
      )
    except (ValueError, TypeError) as error:
      raise ValueError(
        f"logits processor {name}: row_state must match init_state's rows: {error}"
      ) from None
    rows.append(row)
    active[index] = True
  return tuple(rows), active
