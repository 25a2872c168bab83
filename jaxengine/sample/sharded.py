"""Exact per-row summaries of vocabulary-sharded logits, gathering candidates, never the vocabulary.

With tensor parallelism the LM head leaves the logits sharded over the vocabulary,
``[R, V]`` as ``P(rows, "model")``. Every JAX engine all-gathers them before sampling. The
functions here run under `jax.shard_map` over the model axis: each shard summarises its own
``V / t`` columns, and only ``t`` small summaries per row cross devices.

Built and tested (exact: bit-identical to the same function on the gathered logits):

- `sharded_top_k`: each shard's top ``k`` (values, global ids), all-gathered as ``[R, t * k]``,
  then a top ``k`` of those. Shards are concatenated in vocabulary order and `lax.top_k` prefers
  the lower position among equal values, so ties go to the lower token id, as `lax.top_k` over the
  whole row does. The result equals ``lax.top_k(logits, k)``. (The one-device sampler's
  `blocked.blocked_top_k` reports the same values but, among equal values, possibly other ids: a
  sharded sampler must use one tie rule on both sides to stay token-exact.)
- `sharded_argmax`: `sharded_top_k` with ``k = 1`` (the greedy token, ties to the lowest id).
- `sharded_max`: the row maximum (a ``pmax``), exact.

NOT DONE: the sampler (`jaxengine.sample.sample`) does not call these yet; under a mesh it runs as
GSPMD partitions it, which all-gathers the logits. The design for wiring them in, stage by stage
(issue 11, part 2):

1. Per-token stages shard as they are: temperature, logit bias, min_tokens, bad words, penalties
   (the ``[R, V]`` counts stay ``P(rows, "model")``), per-token logits processors.
2. Candidates: `sharded_top_k` with the batch's candidate count ``C`` gives the same
   `Candidates` as the one-device sampler (same values, ids, order), so every row whose top-k,
   top-p and min-p cut falls inside the candidates draws the same token from the same uniform
   (`draw_from_candidates` is then run replicated on ``[R, C]``).
3. The softmax normaliser: ``pmax`` of the shard maxima, then ``psum`` of each shard's
   ``sum(exp(x - max))``. Exactness caveat: the one-device sampler sums in its own (blocked) order;
   a sum over shards rounds differently, so the draw over the whole vocabulary (top-p deeper than
   the candidates, plain sampling without top-k) must gather the per-block masses (``V / W``
   floats per row, `blocked.block_width`), not per-shard totals, and run the same cumulative sum
   replicated; the chosen block's ``W`` logits come from the shard owning it (one
   ``psum`` of a masked ``[R, W]`` slice). This is where exactness needs more than scalars.
4. Logprobs and ranks: the sampled token's logit comes from its owning shard (masked ``psum``);
   the rank is a ``psum`` of per-shard counts of larger logits; top-``n`` logprobs are
   `sharded_top_k` with ``k = n``; the log-normaliser is step 3's (equal up to rounding, as
   ``log_softmax`` over a gathered row would be with a different reduction order).
5. Fallback to a gather: rows needing the whole sorted vocabulary (``max_num_logprobs = -1``,
   i.e. all ``V`` logprobs) and the exact top-p bisection after the rejection attempts; both are
   per-row and rare, under a ``lax.cond`` on "any row needs it".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def _local_top_k(logits: jax.Array, k: int, axis: str) -> tuple[jax.Array, jax.Array]:
  """Inside `shard_map`: this shard's top `k` of ``[r, V / t]`` with global ids, gathered
  over `axis` into ``[r, t * k]`` (shards in vocabulary order), then the top `k` of those."""
  width = logits.shape[-1]
  values, ids = lax.top_k(logits, min(k, width))
  ids = ids + lax.axis_index(axis) * width
  values = lax.all_gather(values, axis, axis=1, tiled=True)  # [r, t * k]
  ids = lax.all_gather(ids, axis, axis=1, tiled=True)
  best, where = lax.top_k(values, k)
  return best, jnp.take_along_axis(ids, where, axis=-1)


def sharded_top_k(
  logits: jax.Array, k: int, mesh: Mesh, axis: str = "model", rows: str | None = None
) -> tuple[jax.Array, jax.Array]:
  """``lax.top_k(logits, k)`` of vocabulary-sharded logits, moving ``t * k`` entries per row.

  Args:
    logits: ``[R, V] float32``, sharded ``P(rows, axis)``; `V` divisible by the axis size.
    k: candidates per row (static), at most ``V / t``.
    mesh: the mesh holding `axis` (and `rows` if given).
    axis: the mesh axis over the vocabulary.
    rows: the mesh axis over rows, or None (rows replicated).

  Returns:
    ``(values [R, k] float32, ids [R, k] int32)``, sorted descending, ties by lower id;
    sharded ``P(rows)``, replicated over `axis`.

  Raises:
    ValueError: `k` above the shard width ``V / t``.
  """
  width = logits.shape[-1] // mesh.shape[axis]
  if not 0 < k <= width:
    raise ValueError(f"k must be in [1, {width}] (the vocabulary shard width), got k={k}")
  fn = jax.shard_map(
    lambda x: _local_top_k(x, k, axis),
    mesh=mesh,
    in_specs=P(rows, axis),
    out_specs=(P(rows), P(rows)),
    check_vma=False,  # every shard computes the same top k of the same gathered candidates
  )
  return fn(logits)


def sharded_argmax(
  logits: jax.Array, mesh: Mesh, axis: str = "model", rows: str | None = None
) -> jax.Array:
  """``jnp.argmax(logits, -1)`` (ties to the lowest id) of vocabulary-sharded logits: ``[R]
  int32``, moving one value and one id per shard and row. Args as `sharded_top_k`."""
  return sharded_top_k(logits, 1, mesh, axis, rows)[1][:, 0]


def sharded_max(
  logits: jax.Array, mesh: Mesh, axis: str = "model", rows: str | None = None
) -> jax.Array:
  """``logits.max(-1)`` of vocabulary-sharded logits (``[R] float32``, a ``pmax`` of the shard
  maxima). Args as `sharded_top_k`."""
  fn = jax.shard_map(
    lambda x: lax.pmax(x.max(-1), axis),
    mesh=mesh,
    in_specs=P(rows, axis),
    out_specs=P(rows),
  )
  return fn(logits)
