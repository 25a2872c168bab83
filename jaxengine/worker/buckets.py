"""Bucket sizes of the runner's steps: how a count (rows, tokens) is padded to one of a few static
shapes, so each step compiles once per bucket rather than once per count; and `StepShapes`, which
lets a short job run in the shapes it has already compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Hashable, Iterable

#: Smallest token bucket of a ragged step with 8 rows or more; fewer rows start at their row
#: bucket, so one request's decode runs the model on 1 token, not 8 (XLA:CPU takes about 1.8x as
#: long over 8 rows of SmolLM2-135M as over 1), at the price of a few more shapes.
MIN_TOKEN_BUCKET = 8

#: Token bucket from which a step runs in the largest row bucket (`step_buckets`): the logits of
#: `max_num_reqs` rows cost little next to the model over this many tokens (under 3% for
#: SmolLM2-135M at 16 rows), and fewer (token, row) shapes compile.
FULL_ROWS_MIN_TOKENS = 128


#: Fewest rows the sampler of a plain step runs over (`sample_rows`): a step of fewer rows pads
#: its logits to this row bucket, so a batch of 1 to 8 requests compiles one sampler, not one per
#: row bucket (the sampler compiles about as long as SmolLM2-135M's whole forward on XLA:CPU, and
#: its cost over 8 rows is small next to the model's; TPU and GPU tiles hold 8 rows anyway).
MIN_SAMPLE_ROWS = 8


def buckets(limit: int, start: int) -> list[int]:
  """Powers of two from `start`, the last one clipped to `limit`."""
  sizes = [start]
  while sizes[-1] < limit:
    sizes.append(sizes[-1] * 2)
  sizes[-1] = min(sizes[-1], limit)
  return sizes


def row_buckets(max_num_reqs: int, rows_per_shard: int, batch_invariant: bool) -> list[int]:
  """A runner's row buckets: powers of two times `rows_per_shard` (on a mesh, the data-parallel
  size: whole rows per shard) up to `max_num_reqs`. With `batch_invariant`, only
  `max_num_reqs`: the sampler's reductions (top-p masses, the draw's cumulative sums) take their
  order from the whole `[rows, V]` shape, so one row count keeps a request's draw independent of
  the batch (the model's arithmetic is per token, `jaxengine.models.batch_invariant`)."""
  return [max_num_reqs] if batch_invariant else buckets(max_num_reqs, rows_per_shard)


def bucket(n: int, sizes: list[int]) -> int:
  """The smallest of `sizes` holding `n`."""
  return next(b for b in sizes if b >= n)


def sample_rows(num_rows: int, row_buckets: list[int]) -> int:
  """The rows a plain step's sampler runs over when its model runs over `num_rows` (a row
  bucket): the smallest row bucket holding `num_rows` and `MIN_SAMPLE_ROWS` (or the largest)."""
  return bucket(min(max(num_rows, MIN_SAMPLE_ROWS), row_buckets[-1]), row_buckets)


def token_bucket(num_tokens: int, num_rows: int, token_buckets: list[int]) -> int:
  """The token bucket of a step of `num_tokens` scheduled tokens over `num_rows` (a row
  bucket): the smallest of `token_buckets` holding them and `min(num_rows, MIN_TOKEN_BUCKET)`."""
  return bucket(max(1, num_tokens, min(num_rows, MIN_TOKEN_BUCKET)), token_buckets)


def step_buckets(
  num_tokens: int,
  num_reqs: int,
  row_buckets: list[int],
  token_buckets: list[int],
  prompt_logprobs: bool = False,
) -> tuple[int, int]:
  """`(token bucket, row bucket)` of a step of `num_tokens` scheduled tokens over `num_reqs`
  rows: the row bucket holding them, and `token_bucket`; the largest row bucket for a step of
  `FULL_ROWS_MIN_TOKENS` tokens or more and for a step that computes prompt logprobs. Those steps
  cost far more than the logits of a few more rows (`[T, V]` logits with prompt logprobs), and so
  `worker/precompile.py` compiles fewer shapes.
  """
  num_rows = bucket(max(num_reqs, 1), row_buckets)
  tokens = token_bucket(num_tokens, num_rows, token_buckets)
  if prompt_logprobs or tokens >= FULL_ROWS_MIN_TOKENS:
    num_rows = row_buckets[-1]
    tokens = token_bucket(num_tokens, num_rows, token_buckets)
  return tokens, num_rows


def step_shapes(
  row_buckets: list[int], token_buckets: list[int], prompt_logprobs: bool = False
) -> list[tuple[int, int]]:
  """The `(token bucket, row bucket)` pairs a ragged step can reach (`step_buckets`), with or
  without prompt logprobs, by row bucket then token bucket."""
  shapes = {
    step_buckets(t, r, row_buckets, token_buckets, prompt_logprobs)
    for r in row_buckets
    for t in token_buckets
  }
  return sorted(shapes, key=lambda shape: shape[::-1])


#: Uses of a step shape that is not compiled yet served by a larger compiled one before it gets
#: its own executable (`StepShapes`).
PROMOTE_AFTER = 8

#: A compiled shape serves a smaller step only if it has at most this many times the step's
#: token bucket, or at most `SMALL_STEP_TOKENS` tokens: a padded token costs about what a real
#: one does, so the wasted work stays under a step's own cost per use.
MAX_PADDING_FACTOR = 2

#: Steps of up to this many tokens cost about the same whatever their count (they read every
#: weight once; measured 1.8x from 1 to 8 rows of SmolLM2-135M on XLA:CPU), so any compiled shape
#: up to this size may serve them.
SMALL_STEP_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class StepShape:
  """One executable of the ragged step: its token bucket, row bucket and variant (the
  prompt-logprobs and verify forms are other executables)."""

  num_tokens: int
  num_rows: int
  variant: Hashable = None

  def holds(self, other: StepShape) -> bool:
    """Whether this shape can run `other`'s step (same variant, no fewer tokens or rows)."""
    return (
      self.variant == other.variant
      and self.num_tokens >= other.num_tokens
      and self.num_rows >= other.num_rows
    )


class StepShapes:
  """Which step shapes a runner has compiled, and which shape runs a step.

  A short job (a notebook's first `generate`, an lm-eval run of a few dozen requests) would spend
  most of its time compiling: each new (token bucket, row bucket) is a compile of the whole model
  (seconds on CPU for SmolLM2-135M), and a batch whose requests finish one by one walks down every
  row bucket. So a step whose exact shape is not compiled yet runs in the smallest compiled shape
  that holds it, if that wastes little (`MAX_PADDING_FACTOR`, `SMALL_STEP_TOKENS`), until the
  shape has been wanted `PROMOTE_AFTER` times; then it compiles, and a long job runs every step in
  its own bucket, as before. A shape nothing holds compiles at once. `precompile` marks every
  shape compiled, so a precompiled engine always runs the exact bucket.

  A shape another thread is compiling (`expect`: `jaxengine serve`'s background compile,
  `entrypoints/background_compile.py`) is not compiled here too: until it is marked compiled, its
  steps run in the smallest compiled shape that holds it, whatever the padding (only a step that
  no compiled shape holds compiles its own). The compiled and
  expected sets are guarded by a lock (the compiling thread marks shapes while the engine's
  thread chooses).

  The choice changes only padding: padded tokens and rows compute nothing a real one reads.
  Outputs are the same up to floating-point reassociation of the model's matmuls (bitwise the same
  with ``batch_invariant=True``, whose arithmetic is per token).
  """

  def __init__(self, promote_after: int = PROMOTE_AFTER) -> None:
    """Args:
    promote_after: uses of a shape served by a larger one before it compiles (0: every step
      runs in its exact bucket, compiling it when first reached).
    """
    self.promote_after = promote_after
    self._compiled: set[StepShape] = set()
    self._expected: set[StepShape] = set()
    self._wanted: collections.Counter[StepShape] = collections.Counter()
    self._lock = threading.Lock()

  def mark_compiled(self, shape: StepShape) -> None:
    """Records that `shape`'s executable exists (`precompile`, a background compile, or after
    running it)."""
    with self._lock:
      self._compiled.add(shape)
      self._expected.discard(shape)

  def expect(self, shapes: Iterable[StepShape]) -> None:
    """Records shapes another thread is compiling: steps that want one run in a compiled host
    until it is marked compiled (see the class)."""
    with self._lock:
      self._expected.update(set(shapes) - self._compiled)

  def cancel_expected(self) -> None:
    """Forgets the expected shapes (their compile stopped): each compiles when first wanted."""
    with self._lock:
      self._expected.clear()

  @property
  def num_expected(self) -> int:
    """Shapes expected from another thread and not compiled yet."""
    with self._lock:
      return len(self._expected)

  def choose(self, wanted: StepShape) -> StepShape:
    """The shape to run a step whose exact bucket is `wanted`; marks it compiled."""
    with self._lock:
      if wanted in self._compiled:
        return wanted
      self._wanted[wanted] += 1
      expected = wanted in self._expected
      host = self._host(wanted, any_padding=expected)
      if host is not None and (expected or self._wanted[wanted] <= self.promote_after):
        return host
      self._compiled.add(wanted)
      self._expected.discard(wanted)
      return wanted

  def _host(self, wanted: StepShape, any_padding: bool = False) -> StepShape | None:
    """The cheapest compiled shape that holds `wanted` within the padding bounds (any compiled
    shape that holds it with `any_padding`), or None."""
    limit = max(SMALL_STEP_TOKENS, MAX_PADDING_FACTOR * wanted.num_tokens)
    hosts = [
      s for s in self._compiled if s.holds(wanted) and (any_padding or s.num_tokens <= limit)
    ]
    return min(hosts, key=lambda s: (s.num_tokens, s.num_rows), default=None)
