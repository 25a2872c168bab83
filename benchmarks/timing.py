"""Wall-clock timing shared by the benchmark scripts: medians in milliseconds, every call waited
for with `jax.block_until_ready` before the clock is read."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import jax

K = TypeVar("K")


def warm(fns: Iterable[Callable[[], Any]], times: int = 1) -> None:
  """Calls each function `times` times (compiles, first-touch allocations), waiting for each."""
  for fn in fns:
    for _ in range(times):
      jax.block_until_ready(fn())


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
  """Median ms of `repeats` calls of `fn`, after `warmup` untimed calls."""
  return interleaved_ms({0: fn}, repeats, warmup)[0]


def interleaved_ms(
  fns: Mapping[K, Callable[[], Any]], repeats: int, warmup: int = 1
) -> dict[K, float]:
  """Median ms of each function, one call of each per round, after `warmup` untimed calls each.

  Taking turns means drifts in machine speed (other processes, frequency scaling) touch every
  function alike, so their ratios hold even on a shared machine.
  """
  warm(fns.values(), warmup)
  samples: dict[K, list[float]] = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      samples[name].append(time.perf_counter() - start)
  return {name: statistics.median(values) * 1e3 for name, values in samples.items()}
