"""Weight-only quantization of a decoder's projection matrices (``EngineConfig.quantization``).

Each ``[out, in]`` projection (a Llama or Gemma layer's query, key, value and output projections
and its gate, up and down matrices; a Qwen3.5 Gated DeltaNet layer's five; a mixture of
experts' ``[X, in, out]`` gate, up and down experts, one ``[out]`` row of scales per expert) is
stored as narrow values with one float32 scale per output channel, symmetric around 0:

- ``"int8"``: ``scale = max|w| / 127`` over the channel's inputs, ``values = round(w / scale)`` in int8;
- ``"fp8"``: ``scale = max|w| / 448`` (float8_e4m3fn's largest finite value), ``values = w /
  scale`` rounded to float8_e4m3fn.

A channel of zeros gets scale 0 and values 0. The activations stay in the model dtype: the matmul
multiplies them with the values cast to that dtype, then the ``[out]`` result by the channel's scale
(`jaxengine.models.layers.linear`): exact per output channel, ``x @ (s * q).T == (x @ q.T) * s``.
The experts' grouped product does the same with each sorted row's own expert's ``[out]`` scales
(`jaxengine.models.grouped_matmul.grouped_linear`). The token embedding, the output head, the norms, the
biases and a mixture of experts' router stay in the model dtype.

On a mesh `ModelRunner` places the float weights first (`jaxengine.worker.placement.placed_copy`)
and quantizes them where they are: each device quantizes its shard, the values keep the float
weight's sharding, and the scales are split like the weight's output axes, or replicated where
the weight is split on its input axis (`jaxengine.parallel`): either way each scaled matmul stays
local. `load_weights` puts new float weights in the same place before quantizing them, so the
jitted `quantize_rows` sees the argument placement it was compiled for (quantizing the float
model on one device and then placing the result made a load compile 5 executables on a
2-device tensor-parallel mesh, 10 with 2 data-parallel groups).

A module offers its matrices by declaring ``QUANTIZABLE`` (attribute name -> its input axes, the
ones a scale reduces over: ``wq`` is ``[H, D, E]``, ``(2,)``; ``wo`` is ``[E, H, D]``, ``(1, 2)``;
a mixture of experts' ``[X, in, out]`` stack ``(1,)``) and an empty
``scales`` `nnx.Dict`, and by passing ``layers.row_scale(self.scales, name)`` to `linear`;
`quantize_model` fills them. The quantization is one jitted function (`quantize_rows`), compiled
once per matrix shape, dtype and format and reused when `ModelRunner.load_weights` re-quantizes
new float weights. In a model whose layers are stacked (``stacked_paths``, a scanned model:
`jaxengine.models.layer_scan`) every matrix under those paths has a leading layer axis: its
input axes move one place right and its scales keep the layer axis (``[L, *out]``), each layer
quantized as it would be alone.

Speed, measured on the 210 projections of SmolLM2-135M (30 layers x 7 matrices) for one decode
step, float32 activations, XLA:CPU on a shared 2-core machine (noisy: best of 9), in ms at 1 / 8
rows: float32 weights 27 / 114; this module's int8 dot with the scale after it 348 / 79; the
same with the cast int8 -> float32 kept out of the dot's fusion 375 / 67; the scale folded into
the weight before the dot 216 / 76 (an earlier run); qwix's ``dot_general`` over a channelwise
int8 ``QArray`` 356 / 73. No variant beats another clearly, and at 1 row every one is far slower
than float32 on XLA:CPU (the cast fuses into a slow matrix-vector loop): on CPU the option saves
memory, not time. This module's form was kept: no faster, and it keeps each weight one array
of the model's own layout (the state paths `load_weights` and sleep use), where qwix wraps it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
  "FORMATS",
  "QUANTIZATIONS",
  "QuantFormat",
  "QuantizedLeaf",
  "QuantizedModel",
  "QuantizedRows",
  "check_quantization",
  "dequantize_rows",
  "quantize_model",
  "quantize_rows",
]

#: Path of a leaf in an `nnx.State` (as `jaxengine.models.weights.LeafPath`).
LeafPath = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class QuantFormat:
  """One storage format of quantized values.

  Attributes:
    name: the `EngineConfig.quantization` value (``"int8"``, ``"fp8"``).
    dtype: the values' dtype (``jnp.int8``, ``jnp.float8_e4m3fn``).
    max_value: the largest magnitude stored: a row's ``max|w|`` maps onto it.
  """

  name: str
  dtype: Any
  max_value: float

  @property
  def is_integer(self) -> bool:
    """Whether the values are integers (rounded to the nearest, not cast)."""
    return bool(jnp.issubdtype(self.dtype, jnp.integer))


#: The formats by `EngineConfig.quantization` name.
FORMATS: Mapping[str, QuantFormat] = {
  "int8": QuantFormat("int8", jnp.int8, 127.0),
  "fp8": QuantFormat("fp8", jnp.float8_e4m3fn, 448.0),
}

#: The accepted `EngineConfig.quantization` values besides None.
QUANTIZATIONS = tuple(FORMATS)


def check_quantization(value: Any) -> str | None:
  """`value` if it is None or a name of `FORMATS`.

  Raises:
    ValueError: any other value, named with the accepted ones.
  """
  if value is None or (isinstance(value, str) and value in FORMATS):
    return value
  raise ValueError(f"quantization must be None or one of {list(QUANTIZATIONS)}, got {value!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedRows:
  """A matrix quantized per output channel.

  Attributes:
    values: the matrix's shape (``[*out, *in]``, or ``[X, in, out]``), int8 or float8_e4m3fn.
    scale: ``float32``, the values' shape without `in_axes` (``[*out]``, ``[X, out]``):
      ``w ~= values * scale``, broadcast over the input axes.
    in_axes: the input axes of `values` (static).
  """

  values: jax.Array
  scale: jax.Array
  in_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


@functools.partial(jax.jit, static_argnames=("quantization", "in_axes"))
def quantize_rows(w: jax.Array, *, quantization: str, in_axes: tuple[int, ...]) -> QuantizedRows:
  """Symmetric per-output-channel quantization of one matrix (jitted: one compile per shape,
  dtype, format and layout).

  Args:
    w: float weight (any float dtype), e.g. ``[H, D, E]`` or an ``[X, in, out]`` expert stack.
    quantization: a name of `FORMATS`.
    in_axes: the axes of `w` reduced over (its input features, e.g. ``(2,)`` for ``[H, D, E]``,
      ``(1,)`` for ``[X, in, out]``); one scale per index of the others.

  Returns:
    `QuantizedRows`: values of `w`'s shape and float32 scales of its shape without `in_axes`.
  """
  fmt = FORMATS[quantization]
  w32 = w.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(w32), axis=in_axes, keepdims=True)  # 1 on the input axes
  scale = absmax / fmt.max_value
  divisor = jnp.where(scale > 0, scale, 1.0)
  scaled = jnp.clip(w32 / divisor, -fmt.max_value, fmt.max_value)
  if fmt.is_integer:
    scaled = jnp.round(scaled)
  return QuantizedRows(scaled.astype(fmt.dtype), jnp.squeeze(scale, in_axes), in_axes)


def dequantize_rows(rows: QuantizedRows) -> jax.Array:
  """``values * scale`` in the values' shape, float32 (what the matmul computes with)."""
  scale = jnp.expand_dims(rows.scale, rows.in_axes)
  return rows.values.astype(jnp.float32) * scale


@dataclasses.dataclass(frozen=True)
class QuantizedLeaf:
  """One quantized matrix of a model's state.

  Attributes:
    scale_path: the leaf of its ``[*out] float32`` scales (``(..., "scales", "wq")``).
    float_shape: the matrix's shape (the values' shape too).
    float_dtype: the dtype it had, the model dtype: new float weights are cast to it, then
      quantized, as at build time.
    in_axes: its input axes (`quantize_rows`).
    quantization: the format's name.
  """

  scale_path: LeafPath
  float_shape: tuple[int, ...]
  float_dtype: Any
  in_axes: tuple[int, ...]
  quantization: str

  def quantize(self, w: jax.Array) -> QuantizedRows:
    """`w` (``float_shape``, in ``float_dtype``) quantized as this leaf is."""
    return quantize_rows(w, quantization=self.quantization, in_axes=self.in_axes)


@dataclasses.dataclass(frozen=True)
class QuantizedModel:
  """A quantized copy of a model and where its quantized matrices are.

  Attributes:
    model: the copy (shares every unquantized array with the original).
    leaves: by the path of each quantized matrix (``("layers", 0, "attn", "wq")``).
  """

  model: Any
  leaves: Mapping[LeafPath, QuantizedLeaf]

  @property
  def scale_paths(self) -> frozenset[LeafPath]:
    """The paths of every scale leaf."""
    return frozenset(leaf.scale_path for leaf in self.leaves.values())


def _quantizable(module: Any) -> Mapping[str, tuple[int, ...]]:
  return cast(Mapping[str, tuple[int, ...]], getattr(type(module), "QUANTIZABLE", {}))


def quantize_model(model: Any, quantization: str) -> QuantizedModel:
  """A copy of `model` whose declared projections (``QUANTIZABLE``) are quantized per output
  channel.

  `model` is unchanged; the copy shares its other arrays. Each matrix goes through
  `quantize_rows` on the device where it is.

  Args:
    model: an NNX module, e.g. `jaxengine.models.Llama` or `jaxengine.models.Gemma`.
    quantization: a name of `FORMATS`.

  Returns:
    The `QuantizedModel`.

  Raises:
    ValueError: an unknown `quantization`, or a model none of whose modules declares
      ``QUANTIZABLE`` matrices (naming its type).
  """
  check_quantization(quantization)
  modules = list(nnx.iter_modules(cast(nnx.Module, model)))
  if not any(_quantizable(module) for _, module in modules):
    raise ValueError(
      f"quantization={quantization!r} needs a model whose modules declare QUANTIZABLE "
      f"projections (jaxengine.models.Llama and Gemma do); {type(model).__name__} has none"
    )
  graphdef, state = nnx.split(cast(nnx.Module, model))
  copy = nnx.merge(graphdef, state)
  stacked = tuple(getattr(model, "stacked_paths", ()))
  leaves: dict[LeafPath, QuantizedLeaf] = {}
  for key_path, module in nnx.iter_modules(copy):
    path = cast(LeafPath, tuple(key_path))
    lead = int(bool(path) and path[0] in stacked)  # a leading layer axis (a scanned model)
    for name, axes in _quantizable(module).items():
      if getattr(module, name) is None:  # a projection this layer lacks (Gemma 4's shared K/V)
        continue
      in_axes = tuple(axis + lead for axis in axes)
      w = getattr(module, name)[...]
      leaf = QuantizedLeaf((*path, "scales", name), tuple(w.shape), w.dtype, in_axes, quantization)
      rows = leaf.quantize(w)
      setattr(module, name, nnx.Param(rows.values))
      cast(Any, module).scales[name] = nnx.Param(rows.scale)
      leaves[(*path, name)] = leaf
  return QuantizedModel(copy, leaves)
