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

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
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
    k: candidates per row (static), at most ``V`` (each shard sends ``min(k, V / t)``).
    mesh: the mesh holding `axis` (and `rows` if given).
    axis: the mesh axis over the vocabulary.
    rows: the mesh axis over rows, or None (rows replicated).

  Returns:
    ``(values [R, k] float32, ids [R, k] int32)``, sorted descending, ties by lower id;
    sharded ``P(rows)``, replicated over `axis`.

  Raises:
    ValueError: `k` outside ``[1, V]``.
  """
  vocab = logits.shape[-1]
  if not 0 < k <= vocab:
    raise ValueError(f"k must be in [1, {vocab}] (the vocabulary size), got k={k}")
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


# --- the sampler's vocabulary operations, on shards while `vocab_sharded` is active -------------


@dataclasses.dataclass(frozen=True)
class VocabSharding:
  """How the sampler's ``[R, V]`` arrays are laid out while it traces (`vocab_sharded`).

  Attributes:
    mesh: the mesh.
    axis: the mesh axis over the vocabulary (size ``t > 1``, dividing ``V``).
    rows: the mesh axis over rows, or None (rows replicated).
  """

  mesh: Mesh
  axis: str
  rows: str | None

  @property
  def size(self) -> int:
    """``t``: shards of the vocabulary."""
    return int(self.mesh.shape[self.axis])

  def map(self, fn, in_specs, out_specs):
    """`jax.shard_map` of `fn` on this mesh (specs as tuples of axis names)."""
    return jax.shard_map(
      fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


_CURRENT: contextvars.ContextVar[VocabSharding | None] = contextvars.ContextVar(
  "jaxengine_vocab_sharding", default=None
)


_MULTI_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "jaxengine_multi_device", default=False
)


def multi_device() -> bool:
  """Whether the sampler is tracing for more than one device (`vocab_sharded` with a mesh of
  several devices, or `across_devices`)."""
  return _MULTI_DEVICE.get()


@contextlib.contextmanager
def across_devices() -> Iterator[None]:
  """Marks the sampler traced under it as running on several devices (e.g. inside a caller's
  `jax.shard_map`): XLA 0.10.2 aborts compiling an ``optimization_barrier`` inside a ``cond`` in
  a multi-device program, so the deep top-k list goes without its barrier there."""
  token = _MULTI_DEVICE.set(True)
  try:
    yield
  finally:
    _MULTI_DEVICE.reset(token)


def current() -> VocabSharding | None:
  """The active `VocabSharding` (while `sample` traces with a mesh), else None."""
  return _CURRENT.get()


@contextlib.contextmanager
def vocab_sharded(
  mesh: Mesh | None, num_rows: int, vocab_size: int, axis: str = "model", rows: str = "data"
) -> Iterator[VocabSharding | None]:
  """While tracing under this context, the sampler's vocabulary reductions run per shard.

  Nothing is activated (the sampler runs as on one device, GSPMD partitioning it) when `mesh` is
  None, its `axis` has size 1 or does not divide `vocab_size`. Rows are split over `rows` when
  that axis has size above 1 and divides `num_rows`.
  """
  spec = None
  t = mesh.shape.get(axis, 1) if mesh is not None else 1
  if mesh is not None and t > 1 and vocab_size % t == 0:
    d = mesh.shape.get(rows, 1)
    spec = VocabSharding(mesh, axis, rows if d > 1 and num_rows % d == 0 else None)
  token = _CURRENT.set(spec)
  several = _MULTI_DEVICE.set(multi_device() or (mesh is not None and mesh.size > 1))
  try:
    yield spec
  finally:
    _MULTI_DEVICE.reset(several)
    _CURRENT.reset(token)


def _psum_owned(value: jax.Array, owned: jax.Array, axis: str) -> jax.Array:
  """The owning shard's `value` on every shard: a ``psum`` where the others add zeros (exact)."""
  zero = jnp.zeros((), value.dtype)
  if value.dtype == jnp.bool_:
    return lax.psum(jnp.where(owned, value, False).astype(jnp.int32), axis) > 0
  return lax.psum(jnp.where(owned, value, zero), axis)


def take_along_vocab(x: jax.Array, ids: jax.Array) -> jax.Array:
  """``jnp.take_along_axis(x, ids, 1)``: ``[R, V]`` at ``ids [R, n]`` (in ``[0, V)``) ->
  ``[R, n]``. Sharded: each value comes from the shard owning it (one ``psum`` of ``[R, n]``)."""
  spec = current()
  if spec is None:
    return jnp.take_along_axis(x, ids, 1)

  def local(x, ids):
    width = x.shape[-1]
    at = ids - lax.axis_index(spec.axis) * width
    owned = (at >= 0) & (at < width)
    return _psum_owned(jnp.take_along_axis(x, jnp.clip(at, 0, width - 1), 1), owned, spec.axis)

  return spec.map(local, (P(spec.rows, spec.axis), P(spec.rows)), P(spec.rows))(x, ids)


def scatter_vocab(x: jax.Array, ids: jax.Array, values, add: bool = False) -> jax.Array:
  """``x.at[rows, ids].set(values, mode="drop")`` (or ``.add``) on ``[R, V]`` at ``ids [R, n]``
  (ids outside ``[0, V)`` dropped). Sharded: each shard writes the ids it owns, no collective."""
  values = jnp.broadcast_to(jnp.asarray(values, x.dtype), ids.shape)
  rows = lambda a: jnp.arange(a.shape[0])[:, None]

  def write(x, at, values):
    ref = x.at[rows(x), at]
    return ref.add(values, mode="drop") if add else ref.set(values, mode="drop")

  spec = current()
  if spec is None:
    return write(x, ids, values)

  def local(x, ids, values):
    width = x.shape[-1]
    at = ids - lax.axis_index(spec.axis) * width
    return write(x, jnp.where((at >= 0) & (at < width), at, width), values)

  by_row, by_token = P(spec.rows), P(spec.rows, spec.axis)
  return spec.map(local, (by_token, by_row, by_row), by_token)(x, ids, values)


def in_block_along_vocab(x_blocks: jax.Array, block: jax.Array, fn, arg: jax.Array) -> jax.Array:
  """``fn(chosen [R, W], arg [R]) -> [R]`` on each row's block at ``block [R]`` of ``[R, V / W,
  W]`` blocks. Sharded (whole blocks per shard): computed by the shard owning the block, on the
  same values as one device, then one ``psum`` of ``[R]``."""
  spec = current()
  if spec is None or x_blocks.shape[1] % spec.size:
    return fn(jnp.take_along_axis(x_blocks, block[:, None, None], 1)[:, 0], arg)

  def local(x_blocks, block, arg):
    n = x_blocks.shape[1]
    at = block - lax.axis_index(spec.axis) * n
    chosen = jnp.take_along_axis(x_blocks, jnp.clip(at, 0, n - 1)[:, None, None], 1)[:, 0]
    return _psum_owned(fn(chosen, arg), (at >= 0) & (at < n), spec.axis)

  in_specs = (P(spec.rows, spec.axis, None), P(spec.rows), P(spec.rows))
  return spec.map(local, in_specs, P(spec.rows))(x_blocks, block, arg)


def whole_rows(x: jax.Array) -> jax.Array:
  """`x` (``[R, ...]``) replicated over the vocabulary axis when sharded (an all-gather of
  whatever `x` holds: used on ``[R, V / W]`` block masses, or as the documented fallback)."""
  spec = current()
  if spec is None:
    return x
  return lax.with_sharding_constraint(x, NamedSharding(spec.mesh, P(spec.rows)))


def vocab_blocks_fit(vocab_size: int, width: int) -> bool:
  """Whether blocks of `width` tokens lie whole inside each shard (always on one device)."""
  spec = current()
  return spec is None or (vocab_size // spec.size) % width == 0


def top_k_along_vocab(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array] | None:
  """`sharded_top_k` of ``[R, V]`` when sharded (``lax.top_k``'s result), else None."""
  spec = current()
  if spec is None or k == 0:
    return None
  return sharded_top_k(x, k, spec.mesh, spec.axis, spec.rows)
