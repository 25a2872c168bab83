"""The engine's copy of a model's weights: prepared once, replaced by `load_weights` in place.

`prepare_model` makes the module the runner serves (the batch-invariant copy, the quantized copy
of `EngineConfig.quantization`, placed on a mesh first) and `WeightLoader` turns what a caller
gives `ModelRunner.load_weights` (named checkpoint tensors, or a whole NNX state of the float
model) into the engine's new weight tree: checked on the host before any conversion, cast to the
engine's dtypes, quantized again where the engine is quantized, placed as the old leaves were (so
nothing recompiles). The runner only swaps the tree in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine import parallel
from jaxengine.batch import InputBatch
from jaxengine.engine_config import EngineConfig
from jaxengine.models.batch_invariant import batch_invariant_model
from jaxengine.models.interface import Model, check_model
from jaxengine.models.layer_scan import (
  LayerRows,
  is_unrolled_state,
  layer_rows,
  restacked,
  scanned_model,
  unrolled_leaves,
)
from jaxengine.models.quantization import QuantizedLeaf, quantize_model
from jaxengine.models.weights import (
  LeafPath,
  WeightSpec,
  assemble_leaf,
  check_finite,
  collect_named_weights,
  collect_state,
  dotted,
  model_weight_specs,
  put,
  replace_leaves,
  state_leaves,
)
from jaxengine.worker import sleep_mode
from jaxengine.worker.placement import MeshPlacement, placed_copy
from jaxengine.worker.routed_experts import routed_experts_model

#: What `load_weights` takes: named tensors, or a whole state (or module) of the float model.
Weights = Mapping[str, Any] | Iterable[tuple[str, Any]] | nnx.State | nnx.Module


@dataclasses.dataclass(frozen=True)
class PreparedModel:
  """The module a runner serves and what `WeightLoader` needs to refill it.

  Attributes:
    model: the module (the caller's own unless batch invariance or quantization copied it).
    weight_specs: the float model's checkpoint tensors by name (`load_weights` takes float
      tensors of the quantized matrices too).
    quantized: the quantized matrices by leaf path; empty without `EngineConfig.quantization`.
    layer_rows: where a scanned hybrid keeps each layer (`jaxengine.models.layer_scan.
      layer_rows`), None for one stack or unrolled layers.
  """

  model: Model
  weight_specs: dict[str, WeightSpec]
  quantized: Mapping[LeafPath, QuantizedLeaf]
  layer_rows: LayerRows | None = None


def prepare_model(model: Model, input_batch: InputBatch, config: EngineConfig) -> PreparedModel:
  """The module the runner serves for `config`, checked against the batch and the mesh: a
  batch-invariant copy with `batch_invariant`, a copy returning its routing with
  `enable_return_routed_experts` (`worker/routed_experts.py`), then (placed on `config.mesh` first, so the
  quantized matrices are made where they live) the quantized copy with `quantization`; the
  caller's module keeps its mode and values.

  Raises:
    ValueError: a model that does not implement `Model`, a vocabulary or sizes that differ from
      the batch's, a `max_model_len` above the model's `max_position_embeddings`, a batch
      without a block table of the right width; on a mesh, a model or batch it cannot split;
      `enable_return_routed_experts` with a model without mixture-of-experts layers.
  """
  check_model(model)
  _check_sizes(model, input_batch, config)
  if config.mesh is not None:
    mesh = parallel.check_mesh(config.mesh)
    MeshPlacement.check(model, input_batch, mesh, expert_parallel=config.enable_expert_parallel)
  if config.batch_invariant:
    model = batch_invariant_model(model)  # a copy: the caller's module keeps its mode
  if config.enable_return_routed_experts:
    model = routed_experts_model(model)  # a copy, as above
  model = scanned_model(model, config.scan_layers)  # a copy when it stacks the layers
  # Named by the float model: `load_weights` takes float tensors of the quantized matrices too.
  specs = {spec.name: spec for spec in model_weight_specs(model, nnx.state(model))}
  quantized: Mapping[LeafPath, QuantizedLeaf] = {}
  if config.quantization is not None:
    if config.mesh is not None:
      mesh = parallel.check_mesh(config.mesh)
      model = placed_copy(
        model,
        mesh,
        expert_parallel=config.enable_expert_parallel,
        batch_invariant=config.batch_invariant,
      )
    done = quantize_model(model, config.quantization)  # a copy, as above
    model, quantized = done.model, done.leaves
  return PreparedModel(model, specs, quantized, layer_rows(model))


class WeightLoader:
  """Builds the engine's new weights from what `ModelRunner.load_weights` is given.

  Args:
    weight_specs: the float model's checkpoint tensors by name (`PreparedModel.weight_specs`).
    quantized: the quantized matrices by leaf path (`PreparedModel.quantized`).
    rows: where each layer of a scanned hybrid is (`PreparedModel.layer_rows`), or None.
  """

  def __init__(
    self,
    weight_specs: Mapping[str, WeightSpec],
    quantized: Mapping[LeafPath, QuantizedLeaf],
    rows: LayerRows | None = None,
  ) -> None:
    self.weight_specs = weight_specs
    self.quantized = quantized
    self.rows = rows

  def load(self, engine_weights: nnx.State, weights: Weights, *, complete: bool) -> nnx.State:
    """`engine_weights` with the leaves `weights` gives replaced; `engine_weights` is not
    changed (`ModelRunner.load_weights` swaps the result in, so the compiled steps are reused).

    Two forms:

    - named tensors, ``{name: array}`` or ``(name, array)`` pairs, names and layouts as in the
      checkpoint (for `jaxengine.models.Llama` the Hugging Face names, vLLM's `load_weights`
      convention; for a model without `weight_specs`, its dotted NNX paths such as
      ``"layers.0.attn.wq"``). Tensors may be a subset: the rest stay as they are.
    - a whole `nnx.State` (``nnx.state(module)``), its nested pure dict
      (``nnx.to_pure_dict``) or the module itself, of the same structure as the engine's model:
      for trainers that hold the same NNX module.

    Arrays may be NumPy (converted on the host, then put on the device) or JAX arrays (converted
    on their devices, then placed as the engine's weights are: no round trip through the host).
    Any floating dtype is cast to the parameter's dtype. A JAX array that already has the
    parameter's layout, dtype and placement is used as it is, not copied: do not delete or donate
    it afterwards (copy it first if your training step donates its parameters). Nothing
    recompiles as long as the arrays are placed as the engine's weights are (on one device:
    uncommitted, as arrays made by `jnp` and by jitted functions of such arrays are; see
    `jaxengine.models.weights.put`).

    With `complete` (after `sleep(level=2)` and `wake_up`) every weight must be given (named
    tensors covering every leaf, or a whole state): the old ones were discarded.

    Args:
      engine_weights: the engine's weight tree (its leaves, or `sleep_mode.Slot`s after sleep
        level 2).
      weights: named tensors or a whole state of the float model (above).
      complete: every leaf must be given (after sleep level 2: no old values to keep).

    Raises:
      ValueError: naming the first unknown or repeated name, missing or extra state leaf, or
        tensor of the wrong type, shape or dtype, or holding a NaN or an infinity (by its
        checkpoint name; see `jaxengine.models.weights.nonfinite_tensors` for what that check
        reads and costs). Everything is checked before any conversion, and the weights change
        all at once at the end: after an error the model is exactly as it was. With
        `complete`, a weight missing (named).
    """
    engine_leaves = state_leaves(engine_weights)
    leaves = self._float_leaves(engine_leaves)
    is_pure_dict = isinstance(weights, Mapping) and any(
      isinstance(v, Mapping) for v in weights.values()
    )
    partial: dict[LeafPath, np.ndarray] = {}
    if isinstance(weights, (nnx.State, nnx.Module)) or is_pure_dict:
      self._refuse_quantized_state(weights)
      unrolled = is_unrolled_state(weights, leaves)  # a trainer's unrolled module, say
      given = collect_state(weights, unrolled_leaves(leaves, self.rows) if unrolled else leaves)
      check_finite(given.items(), self._leaf_name)
      if unrolled:  # every layer checked: stacked now, for the scanned engine
        given = restacked(given, leaves, self.rows)
      new = {path: put(given[path], leaves[path]) for path in leaves}
      narrowed = [path for path in new if _narrows(given[path], leaves[path])]
    else:
      grouped = collect_named_weights(weights, self.weight_specs, leaves)
      if complete:
        self._check_complete(grouped, leaves)
      check_finite((spec.name, t) for parts in grouped.values() for spec, t in parts.values())
      partial = self._partial_stacks(grouped)
      # A quantized stack given in part: its other experts are kept from the engine's values
      # (`_requantized`); here they are zeros (rows are quantized one by one).
      base = {path: sleep_mode.zeros(leaves[path]) for path in partial}
      with np.errstate(over="ignore"):  # an overflow to inf is refused just below, by name
        new = {
          path: assemble_leaf(base.get(path, leaves[path]), parts)
          for path, parts in grouped.items()
        }
      narrowed = [
        path
        for path, parts in grouped.items()
        if any(_narrows(t, leaves[path]) for _, t in parts.values())
      ]
    # A finite value can overflow the engine's narrower dtype (1e5 in float16): checked again
    # after the cast, where that can happen, before anything is replaced.
    check_finite(((path, new[path]) for path in narrowed), self._leaf_name, after_cast=True)
    return replace_leaves(engine_weights, self._requantized(new, engine_leaves, partial))

  def _float_leaves(self, leaves: Mapping[LeafPath, Any]) -> dict[LeafPath, Any]:
    """The leaves `load_weights` takes: the engine's, with each quantized matrix as the float
    weight it was (a `sleep_mode.Slot` of its shape and model dtype, placed as its values are)
    and without the scales (`requantized` derives them)."""
    scale_paths = {q.scale_path for q in self.quantized.values()}
    floats = {}
    for path, leaf in leaves.items():
      q = self.quantized.get(path)
      if q is not None:
        leaf = sleep_mode.Slot(q.float_shape, q.float_dtype, leaf.sharding, bool(leaf.committed))
      if path not in scale_paths:
        floats[path] = leaf
    return floats

  def _partial_stacks(self, grouped: Mapping[LeafPath, Any]) -> dict[LeafPath, np.ndarray]:
    """The quantized stacked leaves (a mixture of experts' ``[X, in, out]``) that named tensors
    fill only in part: the indices given, by leaf path."""
    partial = {}
    for path, parts in grouped.items():
      q = self.quantized.get(path)
      if q is not None and None not in parts and len(parts) < q.float_shape[0]:
        partial[path] = np.asarray(sorted(parts))
    return partial

  def _requantized(
    self,
    new: Mapping[LeafPath, Any],
    leaves: Mapping[LeafPath, Any],
    partial: Mapping[LeafPath, np.ndarray],
  ) -> dict[LeafPath, Any]:
    """`new` leaves with each float quantized matrix replaced by its values and scales (the
    jitted `quantize_rows`, compiled when the engine was built), placed as `leaves` are. A
    stack in `partial` takes the new values and scales of its given indices only, the others
    kept bit for bit (that update compiles, as a partial update of a float stack does)."""
    out = dict(new)
    for path, value in new.items():
      q = self.quantized.get(path)
      if q is None:
        continue
      rows = q.quantize(value)
      values, scale = rows.values, rows.scale
      if path in partial:
        given = partial[path]
        values = leaves[path].at[given].set(values[given])
        scale = leaves[q.scale_path].at[given].set(scale[given])
      out[path] = put(values, leaves[path])
      out[q.scale_path] = put(scale, leaves[q.scale_path])
    return out

  def _refuse_quantized_state(self, weights) -> None:
    """A quantized engine takes the float model's state (it quantizes it); a state holding the
    quantized layout (values and their ``scales``, e.g. the engine's own) is refused by name."""
    if not self.quantized:
      return
    state = nnx.state(weights) if isinstance(weights, nnx.Module) else weights
    scales = {q.scale_path for q in self.quantized.values()}
    found = next((path for path in state_leaves(state) if path in scales), None)
    if found is not None:
      raise ValueError(
        f"load_weights takes the float model's weights (the engine quantizes them), got a "
        f"quantized state: its leaf {dotted(found)!r} is a quantization scale"
      )

  def _check_complete(
    self, grouped: Mapping[LeafPath, Any], leaves: Mapping[LeafPath, Any]
  ) -> None:
    """After sleep level 2 every leaf must be given whole (ValueError naming the first missing
    checkpoint tensor): there are no old values to keep."""
    for path in leaves:
      parts = grouped.get(path, {})
      if None in parts:
        continue
      specs = [s for s in self.weight_specs.values() if s.path == path]
      layers = {s.layer for s in specs}
      if specs and None not in layers and layers <= set(parts):
        continue
      missing = [s.name for s in specs if s.layer not in parts] or [dotted(path)]
      raise ValueError(
        f"load_weights after sleep(level=2) needs every weight (the old ones were discarded), "
        f"missing {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
      )

  def _leaf_name(self, path: LeafPath) -> str:
    """A leaf by its checkpoint name and NNX path (``"model.norm.weight" (final_norm.scale)``),
    or by its path alone when no single checkpoint tensor fills it."""
    names = [s.name for s in self.weight_specs.values() if s.path == path and s.layer is None]
    return f"{names[0]} ({dotted(path)})" if names else dotted(path)


def _narrows(tensor, leaf: jax.Array) -> bool:
  """Whether casting floating `tensor` to `leaf`'s dtype can overflow (a narrower float)."""
  dtype = np.dtype(getattr(tensor, "dtype", np.float64))
  if not jnp.issubdtype(dtype, jnp.floating):
    return False
  return float(jnp.finfo(dtype).max) > float(jnp.finfo(leaf.dtype).max)


def _check_sizes(model: Model, input_batch: InputBatch, config: EngineConfig) -> None:
  """Refuses a batch, config and model that do not go together (ValueError, naming both)."""
  sizes = (config.max_num_reqs, config.max_model_len)
  if sizes != (input_batch.max_num_reqs, input_batch.max_model_len):
    raise ValueError(
      f"the config's max_num_reqs, max_model_len={sizes} differ from the batch's "
      f"{(input_batch.max_num_reqs, input_batch.max_model_len)}"
    )
  if model.vocab_size != input_batch.vocab_size:
    raise ValueError(
      f"the model's vocab_size={model.vocab_size} differs from the batch's "
      f"vocab_size={input_batch.vocab_size}"
    )
  if input_batch.max_model_len > model.max_position_embeddings:
    raise ValueError(
      f"max_model_len={input_batch.max_model_len} exceeds the model's "
      f"max_position_embeddings={model.max_position_embeddings}"
    )
  table = input_batch.block_table
  if table is None or table.max_num_blocks_per_req != config.max_num_blocks_per_req:
    raise ValueError(
      f"the runner needs a batch built with max_num_blocks_per_req="
      f"{config.max_num_blocks_per_req} (ceil(max_model_len / block_size))"
    )
