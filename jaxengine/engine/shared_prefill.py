"""One prefill for the `n` samples of a request: the prompt's keys and values copied between slots.

A request with `n > 1` has `n` completions with the same prompt, each in its own row and KV-cache
slot. Prefilling the prompt once and copying the cached keys and values to the other samples'
slots on the device costs one slot copy per sample instead of a forward pass over the prompt.

Only samples admitted in the same step share a prefill (their source slot is then freshly
written); a sample admitted later, when a row frees up, is prefilled itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

from jaxengine.engine.requests import Completion
from jaxengine.models.kv_cache import KVCache


def plan_shared_prefill(
  completions: Sequence[Completion],
) -> tuple[list[Completion], list[tuple[Completion, Completion]]]:
  """Splits newly admitted completions into those to prefill and those to copy.

  Args:
    completions: the completions admitted this step, in admission order.

  Returns:
    `(prefilled, copies)`: the first admitted completion of each request (the one with
    `index == 0` when it is among them, so prompt logprobs are computed by the prefill), and
    `(source, target)` pairs whose target takes the source's cached prompt.
  """
  first: dict[str, Completion] = {}
  for completion in completions:
    request_id = completion.request.request_id
    if request_id not in first or completion.index == 0:
      first[request_id] = completion
  prefilled = list(first.values())
  copies = [
    (first[c.request.request_id], c) for c in completions if first[c.request.request_id] is not c
  ]
  return prefilled, copies


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def copy_slots(kv_cache: KVCache, src, dst) -> KVCache:
  """Copies whole cache slots: slot `dst[i]` takes the keys and values of slot `src[i]`.

  Args:
    kv_cache: the cache (donated).
    src: `[P] int32` source slots.
    dst: `[P] int32` target slots; entries `>= num_slots` are padding and copy nothing.

  Returns:
    The cache with the targets overwritten (every position: those past the prompt are never
    read before the target's own decode writes them).
  """
  return jax.tree.map(lambda a: a.at[:, dst].set(a[:, src], mode="drop"), kv_cache)


def copy_plan_arrays(pairs: Sequence[tuple[int, int]], size: int, num_slots: int):
  """`(src, dst)` slot pairs as two `[size] int32` arrays, padded with dropped targets (one
  shape for every step: one compile)."""
  src = np.zeros((size,), np.int32)
  dst = np.full((size,), num_slots, np.int32)
  for i, (a, b) in enumerate(pairs):
    src[i], dst[i] = a, b
  return src, dst
