"""Bucket sizes of the runner's steps: how a count (rows, tokens) is padded to one of a few static
shapes, so each step compiles once per bucket rather than once per count.
"""

from __future__ import annotations


def buckets(limit: int, start: int) -> list[int]:
  """Powers of two from `start`, the last one clipped to `limit`."""
  sizes = [start]
  while sizes[-1] < limit:
    sizes.append(sizes[-1] * 2)
  sizes[-1] = min(sizes[-1], limit)
  return sizes


def bucket(n: int, sizes: list[int]) -> int:
  """The smallest of `sizes` holding `n`."""
  return next(b for b in sizes if b >= n)
