"""Named checkpoint tensors <-> the parameter leaves of an NNX model.

A checkpoint names its tensors (``model.layers.3.self_attn.q_proj.weight``) and stores them in
its own layout (a PyTorch ``nn.Linear`` weight is ``(out, in)``); an NNX model holds differently
shaped leaves (an ``[H, D, E]`` query matrix; a model that scans over layers stacks them as
``[L, ...]``; a mixture-of-experts block stacks its experts as ``[X, ...]``). A `WeightSpec` links
one named tensor to the leaf, or the row of a stacked leaf (a layer, an expert), it fills. A
model lists its specs with an optional `weight_specs()` method (`jaxengine.models.Llama` names
its parameters as Hugging Face checkpoints do); any other model gets `default_weight_specs`: one
spec per leaf, named by its dotted NNX path (``"layers.0.attn.wq"``), taken whole.

The same specs serve the safetensors loader and `ModelRunner.load_weights`, so a name means the
same thing in both places. This module also holds the host-side checks and the assembly of new
leaves that `load_weights` runs; it imports nothing from the rest of jaxengine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

#: Path of a leaf in an `nnx.State`, e.g. ``("layers", 0, "attn", "wq")``.
LeafPath = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  """One named checkpoint tensor and the parameter leaf it fills.

  Attributes:
    name: the tensor's name in the checkpoint (``"model.layers.0.mlp.up_proj.weight"``).
    path: the leaf in ``nnx.state(model)`` (``("layers", 0, "mlp", "w_up")``), or None for a tensor
      that is accepted and ignored (the output projection of a model with tied embeddings).
    layer: index along the leaf's leading stacked axis the tensor fills (a layer of a model that
      stacks its layers, an expert of a mixture-of-experts block's ``[X, in, out]`` stack), a
      tuple of indices along its leading axes (an expert of a stacked layer, ``(layer,
      expert)`` of an ``[L, X, in, out]`` leaf), or None when the tensor is the whole leaf.
    shape: the tensor's shape in the checkpoint.
    transpose: the checkpoint stores the transpose of the (reshaped) parameter: a 2-D
      ``(out, in)`` tensor becomes an ``(in, out)`` kernel, then takes the leaf's shape (for a
      model whose kernels are ``(in, out)``; `jaxengine.models.Llama` keeps PyTorch's
      ``(out, in)`` layout and transposes nothing). A tensor of more dimensions has its last
      two swapped (a whole ``(X, out, in)`` expert stack becomes ``[X, in, out]``).
    rotary_heads: the checkpoint's rows form this many heads whose rotary feature pairs are
      interleaved, ``(2i, 2i+1)`` (GGUF query and key projections); they are put back into the
      model's half-split order ``(i, i + D/2)`` (`unpermute_rotary_rows`). None: rows as stored.
  """

  name: str
  path: LeafPath | None
  layer: int | tuple[int, ...] | None
  shape: tuple[int, ...]
  transpose: bool = False
  rotary_heads: int | None = None

  @property
  def index(self) -> tuple[int, ...]:
    """`layer` as a tuple of leading indices (empty for a whole leaf)."""
    if self.layer is None:
      return ()
    return self.layer if isinstance(self.layer, tuple) else (self.layer,)

  def row_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the part of a leaf of `leaf_shape` this tensor fills (its leading indexed
    axes dropped)."""
    return tuple(leaf_shape)[len(self.index) :]

  def to_param(self, tensor, param_shape: tuple[int, ...]):
    """The checkpoint tensor in the parameter's layout (NumPy stays NumPy, JAX stays JAX).

    Args:
      tensor: NumPy or JAX array of shape `shape`.
      param_shape: shape of the leaf (without its layer axis when `layer` is set).

    Returns:
      The same values, shape `param_shape`, in the input's dtype.
    """
    if self.rotary_heads is not None:
      tensor = unpermute_rotary_rows(tensor, self.rotary_heads)
    if self.transpose:
      tensor = tensor.swapaxes(-1, -2)
    return tensor.reshape(param_shape)

  def from_param(self, value):
    """The inverse of `to_param`: a parameter (one layer's slice) in the checkpoint's layout."""
    if self.transpose:
      swapped = (*self.shape[:-2], self.shape[-1], self.shape[-2])
      value = value.reshape(swapped).swapaxes(-1, -2)
    value = value.reshape(self.shape)
    if self.rotary_heads is not None:
      rows, cols = value.shape
      half = rows // self.rotary_heads // 2
      value = value.reshape(self.rotary_heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)
    return value


def unpermute_rotary_rows(w, num_heads: int):
  """Undoes the GGUF converter's per-head row permutation of a query/key projection.

  Within each head of ``D`` rows, GGUF row ``2i + j`` (``j`` in {0, 1}) holds the Hugging Face
  row ``i + j * D/2``: the two halves that rotate together are interleaved. This restores the
  half-split order.

  Args:
    w: ``(num_heads * D, in_features)`` weight as stored in the GGUF file (NumPy or JAX).
    num_heads: heads in this projection (query heads for ``attn_q``, key/value heads for
      ``attn_k``).

  Returns:
    ``(num_heads * D, in_features)`` weight with half-split rows.
  """
  rows, cols = w.shape
  d = rows // num_heads
  # GGUF order per head is (i, j) with j fastest; Hugging Face order is (j, i).
  return w.reshape(num_heads, d // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class _ShapeOnlyRngs:
  """Stands in for `nnx.Rngs` while a model is built only for its shapes (`abstract_module`):
  every parameter gets the same key, since its values are never computed."""

  def params(self) -> jax.Array:
    return jax.random.key(0)


def abstract_module(module: Callable[..., nnx.Module], config: Any, dtype) -> nnx.Module:
  """``module(config, dtype=dtype, rngs=...)`` with `jax.ShapeDtypeStruct` leaves (`nnx.eval_shape`):
  the structure a loader fills, with no weights drawn.

  The module's initialisers draw from one fixed key instead of an `nnx.Rngs` stream: under
  tracing, each draw from a stream updates its counter, which costs about 5 ms a parameter in
  flax's checks (1.7 s of SmolLM2-135M's 3 s load), for shapes that do not depend on the key.
  The module must use its `rngs` argument only as ``rngs.params()``.
  """
  return nnx.eval_shape(lambda: module(config, dtype=dtype, rngs=_ShapeOnlyRngs()))


def leaf_path(key_path) -> LeafPath:
  """A JAX key path into an `nnx.State` as a plain tuple (the trailing ``.value`` dropped)."""
  parts = []
  for key in key_path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(key.key)
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(key.idx)
    elif isinstance(key, jax.tree_util.GetAttrKey):
      if key.name != "value":
        parts.append(key.name)
    else:  # FlattenedIndexKey and friends
      parts.append(str(key))
  return tuple(parts)


def state_leaves(state: nnx.State) -> dict[LeafPath, Any]:
  """Every leaf of `state` (arrays, or shape structs of an abstract state) by `leaf_path`."""
  return {leaf_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def replace_leaves(state: nnx.State, new: Mapping[LeafPath, Any]) -> nnx.State:
  """A new `nnx.State` like `state` with the leaves at the paths of `new` replaced.

  `state` itself is left as it was (its variables are not mutated).
  """
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  leaves = [new.get(leaf_path(p), leaf) for p, leaf in paths_and_leaves]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def dotted(path: LeafPath) -> str:
  """``("layers", 0, "attn", "wq")`` -> ``"layers.0.attn.wq"``."""
  return ".".join(str(p) for p in path)


def default_weight_specs(state: nnx.State) -> list[WeightSpec]:
  """One spec per leaf of `state`, named by its dotted path and taken whole, unchanged."""
  return [
    WeightSpec(dotted(path), path, None, tuple(leaf.shape))
    for path, leaf in state_leaves(state).items()
  ]


def model_weight_specs(model: Any, state: nnx.State) -> list[WeightSpec]:
  """The model's own `weight_specs()` when it has one, else `default_weight_specs(state)`.

  Every spec is checked against `state`: its leaf exists, its layer index lies inside the leaf's
  leading axis, and its tensor holds as many numbers as the leaf (or layer slice) it fills.

  Raises:
    ValueError: a duplicate name or a spec that does not fit `state` (a bug in the model's
      `weight_specs`), naming the spec.
  """
  if not hasattr(model, "weight_specs"):
    return default_weight_specs(state)
  return check_weight_specs(model.weight_specs(), state)


def check_weight_specs(specs: Iterable[WeightSpec], state: nnx.State) -> list[WeightSpec]:
  """`specs` as a list, each checked against `state` (see `model_weight_specs`).

  Raises:
    ValueError: a duplicate name or a spec that does not fit `state`, naming the spec.
  """
  specs = list(specs)
  leaves = state_leaves(state)
  seen = set()
  for spec in specs:
    if spec.name in seen:
      raise ValueError(f"weight_specs names {spec.name!r} twice")
    seen.add(spec.name)
    if spec.path is None:
      continue
    if spec.path not in leaves:
      raise ValueError(f"weight spec {spec.name!r}: the model has no leaf {dotted(spec.path)!r}")
    shape = _param_shape(leaves[spec.path], spec)
    if shape is None or math.prod(shape) != math.prod(spec.shape):
      raise ValueError(
        f"weight spec {spec.name!r} ({spec.shape}) does not fit leaf {dotted(spec.path)!r} "
        f"{tuple(leaves[spec.path].shape)} at layer {spec.layer}"
      )
  return specs


def _param_shape(leaf, spec: WeightSpec) -> tuple[int, ...] | None:
  """Shape the spec's tensor takes in the leaf (None if the layer index is out of range)."""
  shape = tuple(leaf.shape)
  index = spec.index
  if len(shape) < len(index) or not all(0 <= i < n for i, n in zip(index, shape)):
    return None
  return spec.row_shape(shape)


def _is_array(x) -> bool:
  return isinstance(x, (np.ndarray, jax.Array))


def _check_tensor(name: str, tensor, shape: tuple[int, ...], leaf_dtype) -> None:
  """ValueError naming `name` unless `tensor` is an array of `shape` with an acceptable dtype."""
  if not _is_array(tensor):
    raise ValueError(f"{name}: expected a NumPy or JAX array, got {type(tensor).__name__}")
  if tuple(tensor.shape) != tuple(shape):
    raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
  if jnp.issubdtype(leaf_dtype, jnp.floating):
    if not jnp.issubdtype(tensor.dtype, jnp.floating):
      raise ValueError(f"{name}: expected a floating-point array, got dtype {tensor.dtype}")
  elif tensor.dtype != leaf_dtype:
    raise ValueError(f"{name}: expected dtype {leaf_dtype}, got {tensor.dtype}")


#: Tensors of one leaf to write: `{layer or layer tuple (None: the whole leaf): (spec, tensor)}`.
LeafParts = dict[int | tuple[int, ...] | None, tuple[WeightSpec, Any]]


def collect_named_weights(
  weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
  specs: Mapping[str, WeightSpec],
  leaves: Mapping[LeafPath, Any],
) -> dict[LeafPath, LeafParts]:
  """Checks named tensors against the specs and groups them by the leaf they fill (host only).

  Args:
    weights: ``{name: array}`` or ``(name, array)`` pairs; NumPy or JAX arrays in the
      checkpoint's layout, any floating dtype for floating leaves.
    specs: the model's specs by name.
    leaves: the model's current leaves by path (for dtypes and stacked shapes).

  Returns:
    ``{leaf path: {layer or None: (spec, array)}}``; ignored names (spec path None) dropped.

  Raises:
    ValueError: naming the first unknown or repeated name, or the first tensor whose type,
      shape or dtype is wrong. Nothing is converted or moved before every tensor is checked.
  """
  if not isinstance(weights, Mapping) and (
    isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable)
  ):
    raise ValueError(
      "weights must be a mapping or an iterable of (name, tensor) pairs, an nnx.State or an "
      f"nnx.Module, got {type(weights).__name__}"
    )
  items = weights.items() if isinstance(weights, Mapping) else weights
  grouped: dict[LeafPath, LeafParts] = {}
  seen: set[str] = set()
  for item in items:
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
      raise ValueError(f"weights must be (name, array) pairs or a mapping, got an item {item!r}")
    name: str = item[0]
    tensor = item[1]
    spec = specs.get(name)
    if spec is None:
      close = [n for n in specs if n.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]][:3]
      hint = f" (names look like {close})" if close else ""
      raise ValueError(f"unknown weight name {name!r}{hint}")
    if name in seen:
      raise ValueError(f"weight {name!r} is given twice")
    seen.add(name)
    leaf = None if spec.path is None else leaves[spec.path]
    _check_tensor(name, tensor, spec.shape, jnp.float32 if leaf is None else leaf.dtype)
    if spec.path is not None:
      grouped.setdefault(spec.path, {})[spec.layer] = (spec, tensor)
  return grouped


def collect_state(state: Any, leaves: Mapping[LeafPath, Any]) -> dict[LeafPath, Any]:
  """Checks a whole state of the model's own structure leaf by leaf (host only).

  Args:
    state: an `nnx.State` (``nnx.state(module)``), an NNX module, or its pure dict
      (``nnx.to_pure_dict``), with exactly the leaves of the model.
    leaves: the model's current leaves by path.

  Returns:
    ``{leaf path: array}`` for every leaf.

  Raises:
    ValueError: naming the first missing or extra leaf, or one whose type, shape or dtype is
      wrong.
  """
  if isinstance(state, nnx.Module):
    state = nnx.state(state)
  given = state_leaves(state)
  for path in leaves:
    if path not in given:
      raise ValueError(
        f"the given weights are missing leaf {dotted(path)!r} (a whole state must hold every "
        "leaf of the model; pass named tensors for a subset)"
      )
  for path, tensor in given.items():
    if path not in leaves:
      raise ValueError(f"the given weights have a leaf {dotted(path)!r} the model does not")
    _check_tensor(dotted(path), tensor, tuple(leaves[path].shape), leaves[path].dtype)
  return given


@jax.jit
def _all_finite(tensor: jax.Array) -> jax.Array:
  """`[] bool`: whether every element of `tensor` is finite, computed where `tensor` is."""
  return jnp.all(jnp.isfinite(tensor))


def _on_host(tensor) -> bool:
  """NumPy, or a JAX array on CPU devices (whose buffers NumPy can view without a copy)."""
  return isinstance(tensor, np.ndarray) or all(
    device.platform == "cpu" for device in tensor.sharding.device_set
  )


def _host_finite(tensor) -> bool:
  """Whether a NumPy array, or each shard of a JAX array on CPU, holds only finite values."""
  if isinstance(tensor, np.ndarray):
    return bool(np.isfinite(tensor).all())
  shards = [s for s in tensor.addressable_shards if s.replica_id == 0]
  return all(bool(np.isfinite(np.asarray(s.data)).all()) for s in shards)


def nonfinite_tensors(named: Iterable[tuple[Any, Any]]) -> list:
  """The keys of the floating-point tensors of `named` holding a NaN or an infinity, in order.

  NumPy arrays and JAX arrays on CPU devices are read on the host (a CPU array's shards are
  viewed in place, not copied): nothing compiles, and SmolLM2-135M's 134.5M float32 parameters
  take about 0.1 s on a 2-core CPU. JAX arrays on accelerators are reduced where they are, one
  jitted reduction per tensor (compiled once per shape, dtype and placement, then reused), and
  only the resulting bools come to the host, together (a transfer guard is lifted for them).

  Args:
    named: ``(key, array)`` pairs of NumPy or JAX arrays (other dtypes than floating skipped).

  Returns:
    The keys of the non-finite tensors (empty when every tensor is finite).
  """
  named = [(k, t) for k, t in named if jnp.issubdtype(t.dtype, jnp.floating)]
  finite = {i: _host_finite(t) for i, (_, t) in enumerate(named) if _on_host(t)}
  on_device = [i for i in range(len(named)) if i not in finite]
  if on_device:
    flags = [_all_finite(named[i][1]) for i in on_device]
    with jax.transfer_guard_device_to_host("allow"):  # one bool per tensor, not the weights
      finite.update(zip(on_device, (bool(f) for f in jax.device_get(flags))))
  return [key for i, (key, _) in enumerate(named) if not finite[i]]


def check_finite(
  named: Iterable[tuple[Any, Any]], describe: Callable[[Any], str] = str, *, after_cast=False
) -> None:
  """Raises ValueError naming (`describe(key)`) the first tensor of `named`, ``(key, array)``
  pairs, that holds a NaN or an infinity, and counting the others; see `nonfinite_tensors`.
  `after_cast`: the tensors are already in the engine's dtype, where finite values given in a
  wider one overflowed (the message says so)."""
  bad = nonfinite_tensors(named)
  if bad:
    others = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    why = (
      "overflows the engine's weight dtype (values beyond its largest finite number)"
      if after_cast
      else "holds NaN or infinite values"
    )
    raise ValueError(
      f"weight {describe(bad[0])} {why}{others}, as after a diverged optimizer step; no weight "
      "was loaded"
    )


def assemble_leaf(old: jax.Array, parts: LeafParts) -> jax.Array:
  """The new value of one leaf from checked checkpoint tensors (see `collect_named_weights`).

  NumPy tensors are converted on the host (so a full set of them compiles nothing); JAX arrays
  stay on their devices. The result has `old`'s shape, dtype and sharding. Layers not in `parts`
  keep `old`'s values.

  Args:
    old: the leaf now, ``[L, ...]`` when stacked.
    parts: ``{layer or None: (spec, tensor)}`` for this leaf.

  Returns:
    The new leaf, placed as `old` is (see `put`).
  """
  dtype = old.dtype
  if None in parts:
    spec, tensor = parts[None]
    return put(spec.to_param(tensor, old.shape).astype(dtype), old)
  layers = sorted((i for i in parts if i is not None), key=lambda i: parts[i][0].index)
  values = [
    parts[i][0].to_param(parts[i][1], parts[i][0].row_shape(old.shape)).astype(dtype)
    for i in layers
  ]
  depth = len(parts[layers[0]][0].index)
  rows = [parts[i][0].index for i in layers]
  if rows == list(np.ndindex(*old.shape[:depth])):  # every row, in order
    on_host = all(isinstance(v, np.ndarray) for v in values)
    stacked = np.stack(values) if on_host else jnp.stack(values)
    return put(stacked.reshape(old.shape), old)
  where = tuple(np.asarray(axis) for axis in zip(*rows))  # one index array per indexed axis
  return put(old.at[where].set(jnp.stack(values)), old)


def put(value, like: jax.Array) -> jax.Array:
  """`value` in `like`'s dtype, placed as `like` is (no copy when it already is).

  A leaf committed to a sharding (an engine on a mesh) gets `value` moved to that sharding. An
  uncommitted leaf (one device, the default) gets an uncommitted array: NumPy is copied to the
  default device (`jax.device_put`, a plain transfer: `jnp.asarray` would compile a small
  staging executable per new shape) and an uncommitted JAX array is used as it is, so the
  executables see the same argument signature as before (JAX caches committed and uncommitted
  arguments apart). A JAX
  array committed to a device (`jax.device_put(x, device)`) stays committed and makes the steps
  compile once more, as any jitted function does when its arguments' placement changes.
  """
  if value.dtype != like.dtype:
    value = value.astype(like.dtype)
  if like.committed or (isinstance(value, jax.Array) and value.committed):
    return jax.device_put(value, like.sharding)
  return value if isinstance(value, jax.Array) else jax.device_put(value)


def named_weights(model: nnx.Module) -> Iterator[tuple[str, jax.Array]]:
  """The model's parameters as ``(checkpoint name, array)`` pairs in the checkpoint layout.

  The inverse of loading: `LLM.load_weights(named_weights(module))` puts a module's weights into
  an engine serving the same architecture (names from the module's `weight_specs`, or its dotted
  NNX paths). Arrays stay on their devices; transposed tensors are new arrays.

  Args:
    model: an NNX module (e.g. `jaxengine.models.Llama`).

  Yields:
    ``(name, array)`` with ``array.shape == spec.shape`` in the parameter's dtype.
  """
  state = nnx.state(model)
  leaves = state_leaves(state)
  for spec in model_weight_specs(model, state):
    if spec.path is None:
      continue
    leaf = leaves[spec.path]
    yield spec.name, spec.from_param(leaf[spec.index] if spec.index else leaf)
