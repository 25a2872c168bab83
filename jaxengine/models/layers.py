"""Building blocks of the Llama family: initialisation, the ``[out, in]`` projection, rotary
embeddings, RMSNorm and grouped-query attention over gathered keys and values.

Model-agnostic and dtype-careful: rotations and normalisations run in float32 and return the
input's dtype. `jaxengine.models.llama` assembles them into a decoder.

References:
  Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models", 2023.
  Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
  Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.batch_invariant import row_tiled_dot
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.reductions import fixed_sum

__all__ = [
  "RMSNorm",
  "linear",
  "normal_init",
  "normal_out_in",
  "project",
  "rotary_embedding",
  "row_scale",
  "soft_cap_scores",
]


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
  """Gaussian init with standard deviation ``fan_in ** -0.5`` (keeps activations O(1))."""
  return (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype)


def normal_out_in(
  rngs: nnx.Rngs, out_shape: tuple[int, ...], in_shape: tuple[int, ...], dtype
) -> jax.Array:
  """`normal_init` of an ``[*out_shape, *in_shape]`` matrix (fan-in ``prod(in_shape)``).

  Drawn in ``[*in_shape, *out_shape]`` order and transposed, so a seed gives the same model as
  under the earlier ``[in, out]`` layout (tests pin the outputs of seeded tiny models).
  """
  num_in, num_out = math.prod(in_shape), math.prod(out_shape)
  w = normal_init(rngs, (*in_shape, *out_shape), num_in, dtype)
  return w.reshape(num_in, num_out).T.reshape(*out_shape, *in_shape)


def linear(
  x: jax.Array, w: jax.Array, *, scale: jax.Array | None = None, batch_invariant: bool = False
) -> jax.Array:
  """``x @ w.T`` for a PyTorch-layout ``[out, in]`` weight, contracting the weight's last dim.

  XLA:CPU runs this faster than ``x @ w`` over an ``[in, out]`` weight at batch > 1 (see
  `jaxengine.models.llama`); the ``[out, in]`` reshape of a stored parameter is free.

  With `scale` (a weight quantized per output row, `jaxengine.models.quantization`) the product
  is ``(x @ w.astype(x.dtype).T) * scale``: the values are cast to the activations' dtype, the dot
  runs in it, and the ``[..., out]`` result is multiplied by the row scales, exact per output
  channel (the same as dequantizing ``w`` first, without materialising a scaled float copy).

  Args:
    x: ``[..., in]`` activations.
    w: ``[out, in]`` weight (float, or int8 / float8_e4m3fn with `scale`).
    scale: None, or ``[out] float32`` per-row scales of a quantized `w`.
    batch_invariant: compute a fixed number of rows at a time
      (`jaxengine.models.batch_invariant.row_tiled_dot`), so each row's bits are independent of
      the other rows (slower, see there).

  Returns:
    ``[..., out]`` in the promoted dtype of ``x`` and ``w`` (as ``x @ w.T``); with `scale`, in
    ``x.dtype``.
  """
  if scale is not None:
    product = linear(x, w.astype(x.dtype), batch_invariant=batch_invariant)
    return (product * scale).astype(x.dtype)
  if batch_invariant:
    return row_tiled_dot(x, w)
  dtype = jnp.result_type(x, w)
  return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())))


def project(
  module: Any, name: str, x: jax.Array, shape: tuple[int, int] | None = None
) -> jax.Array:
  """`linear` of ``[..., in]`` `x` by the module's projection `name`: its weight reshaped to the
  2-D ``(out, in)`` `shape` when given (``[H, D, E]`` -> ``(H * D, E)``; a free reshape), its row
  scales when quantized (`row_scale` of ``module.scales``) and the module's ``batch_invariant``
  mode. Returns ``[..., out]`` in the activations' dtype."""
  w = getattr(module, name)[...]
  if shape is not None:
    w = w.reshape(shape)
  scale = row_scale(module.scales, name)
  return linear(x, w, scale=scale, batch_invariant=module.batch_invariant)


def row_scale(scales: nnx.Dict, name: str) -> jax.Array | None:
  """The ``[out] float32`` row scales of projection `name` when it is quantized (its entry in a
  module's ``scales``, flattened over its output axes), else None (a float weight)."""
  return scales[name][...].reshape(-1) if name in scales else None


def rotary_embedding(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates pairs of features by position-dependent angles (RoPE).

  Uses the "half-split" pairing of Hugging Face checkpoints: feature ``i`` is paired with feature
  ``i + D/2``, and the pair is rotated by ``position * inv_freq[i]``. GGUF files store the
  query/key projections with rows permuted for the interleaved pairing ``(2i, 2i+1)``; the GGUF
  loader undoes that permutation so both sources share this convention.

  Args:
    x: ``[..., N, D]`` queries or keys (any float dtype), e.g. ``[B, T, N, D]``.
    positions: ``[...] int32`` absolute positions (``x``'s leading shape).
    inv_freq: ``[D/2]`` host array of angles per position (`rope_frequencies`).

  Returns:
    ``[..., N, D]`` in ``x.dtype``; the rotation itself is computed in float32.
  """
  # A host constant, so it folds into the executable instead of being a traced input.
  inv_freq = np.asarray(inv_freq, np.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
  cos = jnp.cos(angles)[..., None, :]  # [..., 1, D/2]
  sin = jnp.sin(angles)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # 2 x [..., N, D/2]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square normalisation with a learned per-feature scale, computed in float32.

  ``y = x / sqrt(mean(x**2) + eps) * scale`` (Zhang & Sennrich, 2019), or with `unit_offset`
  ``* (1 + scale)`` (Gemma's norm: checkpoints store the offset from 1). The scale is kept in
  float32 whatever the model dtype; the result is cast back to the input dtype.
  """

  def __init__(self, dim: int, *, eps: float, unit_offset: bool = False):
    """Args: dim: feature width. eps: added to the mean square. unit_offset: multiply by
    ``1 + scale`` (scale initialised to 0) instead of ``scale`` (initialised to 1)."""
    self.scale = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), jnp.float32))
    self.eps = eps
    self.unit_offset = unit_offset
    #: Sum the squares in a fixed order (`jaxengine.reductions.fixed_sum`): a row's result is
    #: then independent of the other rows (batch-invariant mode).
    self.batch_invariant = False

  def __call__(self, x: jax.Array) -> jax.Array:
    """Normalises ``[..., dim]`` and returns the same shape and dtype."""
    x32 = x.astype(jnp.float32)
    if self.batch_invariant:
      mean_square = fixed_sum(jnp.square(x32), keepdims=True) / x32.shape[-1]
    else:
      mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    scale = 1.0 + self.scale[...] if self.unit_offset else self.scale[...]
    return (x32 * jax.lax.rsqrt(mean_square + self.eps) * scale).astype(x.dtype)


def vocab_logits(
  hidden: jax.Array, w: jax.Array, *, batch_invariant: bool = False, soft_cap: float | None = None
) -> jax.Array:
  """Hidden states projected onto the vocabulary: the output head of every decoder here.

  Args:
    hidden: ``[..., E]`` hidden states after the final norm.
    w: ``[V, E]`` output projection (or the tied embedding).
    batch_invariant: ``ROW_TILE`` rows at a time (`jaxengine.models.batch_invariant`).
    soft_cap: Gemma 2's ``final_logit_softcapping`` (`soft_cap_scores`), or None.

  Returns:
    ``[..., V] float32`` logits (float32 accumulation even for a bfloat16 model).
  """
  if batch_invariant:
    logits = row_tiled_dot(hidden, w, preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("...e,ve->...v", hidden, w, preferred_element_type=jnp.float32)
  return soft_cap_scores(logits, soft_cap)


class ConfiguredDecoder:
  """The `jaxengine.models.Model` properties a decoder reads off its ``config`` (with
  ``vocab_size``, ``eos_token_id``, ``max_position_embeddings`` and ``kv_cache_spec(dtype)``) and
  its ``dtype``; mixed into `jaxengine.models.Llama` and `jaxengine.models.Gemma`."""

  config: Any
  dtype: Any

  @property
  def vocab_size(self) -> int:
    """Width of the logits."""
    return self.config.vocab_size

  @property
  def eos_token_id(self) -> int | None:
    """The config's end-of-sequence id."""
    return self.config.eos_token_id

  @property
  def max_position_embeddings(self) -> int:
    """Context length the model was trained for."""
    return self.config.max_position_embeddings

  @property
  def kv_cache_spec(self) -> KVCacheSpec:
    """The cache the config's layers need (layers, key/value heads, head dim, windows, soft
    cap), in the model's dtype."""
    return self.config.kv_cache_spec(self.dtype)


def soft_cap_scores(scores: jax.Array, soft_cap: float | None) -> jax.Array:
  """``soft_cap * tanh(scores / soft_cap)`` (attention logit soft-capping, Gemma 2), or `scores`
  unchanged when `soft_cap` is None. Applied to scaled scores before masking."""
  if soft_cap is None:
    return scores
  return soft_cap * jnp.tanh(scores / soft_cap)
