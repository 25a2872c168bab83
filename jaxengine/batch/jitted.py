"""The jitted helpers of `InputBatch.sample`: the sampler as a step, and row padding."""

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


@functools.partial(jax.jit, static_argnums=1)
def pad_rows(logits: jax.Array, max_num_reqs: int) -> jax.Array:
  """`[N, V]` -> `[R, V]` with zero rows (ignored by the sampler)."""
  return jnp.pad(logits, ((0, max_num_reqs - logits.shape[0]), (0, 0)))
