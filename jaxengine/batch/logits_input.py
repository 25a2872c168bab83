"""The logits a batch step takes: their check, padding `N` rows to `R`, and the sampler alone as
such a step (`InputBatch.sample` through `InputBatch.run`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxengine.sample import BatchState, SamplingMetadata, sample


@functools.partial(jax.jit, donate_argnames=("state",))
def sample_logits(state: BatchState, metadata: SamplingMetadata, logits: jax.Array):
  """`InputBatch.sample`'s step: the sampler alone, as `InputBatch.run` calls a step."""
  state, output = sample(state, metadata, logits)
  return state, output, None


def check_logits(name: str, logits, rows: tuple[int, int], trailing: dict[str, int]) -> None:
  """Raises ValueError unless `logits` is a float array of shape `[rows[0] or rows[1],
  *trailing.values()]` (`rows` = (max_num_reqs, num_reqs); `trailing` names each extent),
  naming the argument and what it got."""
  shape, extents = tuple(getattr(logits, "shape", ())), tuple(trailing.values())
  if len(shape) != 1 + len(extents) or shape[1:] != extents or shape[0] not in rows:
    names = ", ".join(f"{label}={n}" for label, n in trailing.items())
    raise ValueError(
      f"{name} must have shape [max_num_reqs={rows[0]} or num_reqs={rows[1]}, {names}], got {shape}"
    )
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"{name} must have a float dtype, got {logits.dtype}")


@functools.partial(jax.jit, static_argnums=1)
def pad_device_rows(logits: jax.Array, max_num_reqs: int) -> jax.Array:
  """`[N, ...]` -> `[R, ...]` with zero rows (ignored by the sampler)."""
  padding = ((0, max_num_reqs - logits.shape[0]),) + ((0, 0),) * (logits.ndim - 1)
  return jnp.pad(logits, padding)
