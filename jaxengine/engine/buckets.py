"""Bucket sizes of the runner's steps: how a count (rows, prompt tokens, cache positions) is
padded to one of a few static shapes, so each step compiles once per bucket rather than once per
count.

Every step uses them: prefill pads its rows and prompt lengths, decode and verify their rows and
the cache positions they attend to, the prefix cache its block copies.
"""

from __future__ import annotations

#: Smallest prefill length bucket, in tokens.
MIN_LENGTH_BUCKET = 16
#: Smallest decode attention bucket, in cache positions. Attending to 128 positions costs little
#: next to reading the weights, and it spares most short generations a second decode compile.
MIN_ATTENTION_BUCKET = 128


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
