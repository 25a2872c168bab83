"""Tensor and data parallelism: the engine's `jax.sharding.Mesh` and its partition specs.

The mesh has two named axes, ``("data", "model")`` (`DATA`, `MODEL`), of sizes
``data_parallel_size`` (`d`) and ``tensor_parallel_size`` (`t`). Everything is placed once at
start-up (`ModelRunner`) and the jitted steps declare the same shardings for their inputs and
outputs, so warm-up and serving compile the same executables.

Weights are placed by the *role* each parameter plays, from the model's sharding rules
(`jaxengine.models.registry.sharding_rules`: the registry entry of its class, or its own
``sharding_rules``), never by parameter names here. Megatron-style (Shoeybi et al. 2019); a
dimension that `t` does not divide is replicated instead:

========================  ==============================  =========================================
role                      Llama parameters                spec
========================  ==============================  =========================================
column-parallel           ``wq`` ``[H, D, E]``, ``wk``,   first dimension over ``model``
                          ``wv`` ``[K, D, E]``, their     (``P("model", None, ...)``: output
                          biases, ``w_gate``, ``w_up``    heads / features; ``P()`` for ``wk``,
                          ``[F, E]``                      ``wv`` when ``t`` does not divide ``K``)
row-parallel              ``wo`` ``[E, H, D]``,           second dimension over ``model``
                          ``w_down`` ``[E, F]``           (``P(None, "model", ...)``: its input)
vocab-parallel            ``embed``, ``lm_head``          ``P("model", None)`` (vocabulary)
                          ``[V, E]``
expert-column-parallel    ``expert_gate``, ``expert_up``  ``P(None, None, "model")`` (each
                          ``[X, E, F]``                   expert's intermediate features)
expert-row-parallel       ``expert_down`` ``[X, F, E]``   ``P(None, "model", None)``
(expert parallelism)      the three expert stacks         ``P("model", None, None)``: whole
                                                          experts per device
replicated                norms, ``bo``, anything         ``P()``
                          without a rule
========================  ==============================  =========================================

Quantized matrices (`EngineConfig.quantization`, `jaxengine.models.quantization`): the int8 /
float8 values have the float weight's shape and role, hence its spec. Their ``[*out] float32``
scales (``scales/wq``, named by the matrix: the matrix's shape without its input axes) take the
matrix's role too, and `weight_spec` (``scale=True``) splits the scales' axis that the role
splits in the matrix: where the role splits an output axis (column-parallel ``[H, D]`` ->
``P("model", None)``, expert-column-parallel ``[X, F]`` -> ``P(None, "model")``, expert
parallelism ``[X, out]`` -> ``P("model", None)``) the scales are split alike, so each device
scales its own output columns; where it splits an input axis (row-parallel ``wo``, ``w_down``,
``expert_down``) the scales have no such axis and are replicated: the whole ``[out]`` row is on
every device, to scale the partial sums before the all-reduce or their sum after it (the same
result: the scale is per output channel). Either way the scaling adds no collective to the
matmul's.

LoRA adapters' device slots (`jaxengine.lora.LoRAManager`, ``A [N + 1, in, R]``, ``B [N + 1, R,
out]``) split as the projection each adds to (`lora_specs`): a column-parallel target's ``B`` on
``out``, a row-parallel target's ``A`` on ``in``, the other half replicated.

The KV cache's pages (`jaxengine.models.sharded_attention`): the backend's key/value head axis
over ``model`` (``[N, B, K, D]`` as ``P(None, None, "model", None)``; replicated when ``t`` does
not divide ``K``, as vLLM does for ``t > K``), the ragged step's block tables, positions and
slot mapping replicated. `BatchState` and metadata rows ``[R, ...]``: ``P("data")``; scalars
``P()``.

Batch-invariant mode (``LLM(..., batch_invariant=True)``, `jaxengine.models.batch_invariant`):
a sum split over devices is reduced by a collective whose order is the implementation's (on
GPU and TPU a ring's chunks, which move with the buffer's size, i.e. the step's tokens). So in
this mode no matrix's input axis is split: the row-parallel roles (``wo``, ``w_down``,
``expert_down``; their scales) split their output axis instead, as the column-parallel ones do,
and the LoRA slots follow (`lora_specs`). The partitioner then gathers a product's input
(copies, no arithmetic) and each output feature of each token is summed whole on one device, in
the row-tiled product's fixed order; everything else the decoder reduces across devices is a
maximum, an elementwise add of the fixed-order sums (`jaxengine.reductions`; the partitioner
moves the partial sums, it does not reorder them) or a sum of one value and zeros (the
vocabulary-parallel embedding's lookup, a value computed on one device and broadcast), all exact
in any order: the compiled ragged step of a tiny Llama on 2 host devices holds all-gathers and
no all-reduce of anything but such one-device values (looked at in XLA's dump, jax 0.10). The
attention runs each key/value head on one device. So a token's bits do not depend on the rest of
the step, and `jaxengine.models.token_logprobs` over weights placed the same way (the engine's
own, ``llm.llm_engine.runner.model``) gives them too.

With these specs XLA's SPMD partitioner inserts the collectives: one all-reduce over ``model``
after ``wo`` and after ``w_down`` per layer, and the logits come out sharded over the vocabulary,
where the decode step samples them without gathering them (`jaxengine.sample.sharded`: only
per-row summaries cross devices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxengine.models.lora import EXPERT_LORA_TARGETS
from jaxengine.models.registry import (
  COLUMN_PARALLEL,
  EXPERT_COLUMN_PARALLEL,
  EXPERT_ROW_PARALLEL,
  REPLICATED,
  ROW_PARALLEL,
  VOCAB_PARALLEL,
)

#: Name of the mesh axis over batch rows (data parallelism).
DATA = "data"
#: Name of the mesh axis over heads, intermediate size and vocabulary (tensor parallelism).
MODEL = "model"

# The dimension each role splits over MODEL (a role not listed is replicated).
_ROLE_DIM = {
  COLUMN_PARALLEL: 0,
  ROW_PARALLEL: 1,
  VOCAB_PARALLEL: 0,
  EXPERT_COLUMN_PARALLEL: 2,  # [X, in, out]: out
  EXPERT_ROW_PARALLEL: 1,  # [X, in, out]: in
}
# Batch-invariant mode (`weight_spec`'s `batch_invariant`): the roles that split a matrix's
# input (its contraction) split its output instead, so every product's sums stay on one device.
_WHOLE_CONTRACTION = {ROW_PARALLEL: COLUMN_PARALLEL, EXPERT_ROW_PARALLEL: EXPERT_COLUMN_PARALLEL}
# The dimension of a matrix's scales (its shape without the input axes) each role splits: the
# output axis the role splits in the matrix; a role splitting an input axis is replicated.
_SCALE_DIM = {COLUMN_PARALLEL: 0, VOCAB_PARALLEL: 0, EXPERT_COLUMN_PARALLEL: 1}


#: The role of the base projection each LoRA target adds to (`jaxengine.models.lora`).
#: Qwen3.5's ``in_proj_qkv`` is `REPLICATED`: its ``B``'s outputs are in the checkpoint's
#: ``[q | k | v]`` order, the base weight's rows grouped by key head, so every device computes
#: the whole update and reorders it (`jaxengine.models.gated_deltanet.GatedDeltaNet`).
LORA_TARGET_ROLES = {
  **dict.fromkeys(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), COLUMN_PARALLEL),
  **dict.fromkeys(("in_proj_z", "in_proj_b", "in_proj_a"), COLUMN_PARALLEL),
  **dict.fromkeys(("o_proj", "down_proj", "out_proj"), ROW_PARALLEL),
  "in_proj_qkv": REPLICATED,
  # The experts' pairs ``[N + 1, X, in, R]`` and the shared expert's: whole on every device.
  **dict.fromkeys(EXPERT_LORA_TARGETS, REPLICATED),
  **dict.fromkeys(
    ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"), REPLICATED
  ),
}


def lora_specs(
  target_shapes: Mapping[str, tuple[int, ...]],
  tensor_parallel_size: int,
  *,
  batch_invariant: bool = False,
) -> dict[str, tuple[P, P]]:
  """The partition specs of each LoRA target's slot buffers ``(A [N + 1, in, R], B [N + 1, R,
  out])`` (`jaxengine.lora.LoRAManager`), split as the target's base projection is:

  - column-parallel (``q/k/v/gate/up_proj``): ``A`` replicated, ``B`` split on ``out``
    (``P(None, None, "model")``): each device adds the update to its own output features, from
    the whole ``A x`` it computes itself; no collective;
  - row-parallel (``o/down_proj``): ``A`` split on ``in`` (``P(None, "model", None)``), the
    input features the device holds, ``B`` replicated: the ``[T, N, R]`` partial products
    ``x A`` are summed over the model axis (one small all-reduce), then every device applies
    the whole ``B``, whose output the base projection's all-reduce leaves replicated too.

  A `REPLICATED` target (`LORA_TARGET_ROLES`) is whole on every device. A dimension that
  `tensor_parallel_size` does not divide stays whole (as `weight_spec`).
  Either way the partitioner computes the same sums as one device, up to the order of the
  row-parallel partial sums (as for the base weights). With `batch_invariant` every target is
  split as a column-parallel one (its base weight's input axis is whole too: `weight_spec`), so
  no sum crosses devices.
  """
  t = tensor_parallel_size
  specs = {}
  for target, (*_, n_in, n_out) in target_shapes.items():
    if t == 1 or LORA_TARGET_ROLES.get(target) == REPLICATED:
      specs[target] = (P(), P())
    elif LORA_TARGET_ROLES.get(target) == ROW_PARALLEL and not batch_invariant:
      specs[target] = (_split((1, n_in, 1), 1, MODEL, t), P())
    else:
      specs[target] = (P(), _split((1, 1, n_out), 2, MODEL, t))
  return specs


def check_sizes(tensor_parallel_size: Any, data_parallel_size: Any) -> tuple[int, int]:
  """Both sizes as ints.

  Raises:
    ValueError: naming the field and value, for a size that is not a positive int.
  """
  sizes = []
  for name, value in (
    ("tensor_parallel_size", tensor_parallel_size),
    ("data_parallel_size", data_parallel_size),
  ):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
    sizes.append(int(value))
  return sizes[0], sizes[1]


def check_experts(num_experts: int, tensor_parallel_size: int) -> None:
  """Raises ValueError unless `tensor_parallel_size` divides `num_experts` (expert parallelism)."""
  if num_experts % tensor_parallel_size:
    raise ValueError(
      f"enable_expert_parallel=True: tensor_parallel_size={tensor_parallel_size} must divide "
      f"the model's num_experts={num_experts}"
    )


def check_heads(num_attention_heads: int, tensor_parallel_size: int) -> None:
  """Raises ValueError unless `tensor_parallel_size` divides `num_attention_heads`."""
  if num_attention_heads % tensor_parallel_size:
    raise ValueError(
      f"tensor_parallel_size={tensor_parallel_size} must divide the model's "
      f"num_attention_heads={num_attention_heads}"
    )


def make_mesh(
  tensor_parallel_size: int = 1,
  data_parallel_size: int = 1,
  devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """A ``(data, model)`` mesh of ``data_parallel_size x tensor_parallel_size`` devices.

  Args:
    tensor_parallel_size: devices along `MODEL` (consecutive devices: the fastest links).
    data_parallel_size: devices along `DATA`.
    devices: devices to use (default `jax.devices()`, every process's devices under
      `jax.distributed`); the first ``d * t`` are taken.

  Raises:
    ValueError: a size that is not a positive int, or more devices asked than there are.
  """
  t, d = check_sizes(tensor_parallel_size, data_parallel_size)
  devices = list(jax.devices() if devices is None else devices)
  if d * t > len(devices):
    raise ValueError(
      f"tensor_parallel_size={t} x data_parallel_size={d} needs {d * t} devices, "
      f"only {len(devices)} available"
    )
  return Mesh(np.array(devices[: d * t]).reshape(d, t), (DATA, MODEL))


def check_mesh(mesh: Any) -> Mesh:
  """`mesh` if it is a `Mesh` with the `DATA` and `MODEL` axes (either may have size 1).

  Raises:
    ValueError: naming the mesh's axes otherwise.
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if set(mesh.axis_names) != {DATA, MODEL}:
    raise ValueError(
      f"mesh must have exactly the axes ({DATA!r}, {MODEL!r}), got {tuple(mesh.axis_names)}"
    )
  return mesh


def axis_size(mesh: Mesh, axis: str) -> int:
  """Devices along `axis` of `mesh`."""
  return int(mesh.shape[axis])


def _split(shape: tuple[int, ...], dim: int, axis: str, size: int) -> P:
  """A spec splitting `dim` over `axis` when `size` divides it, else replicated."""
  if dim >= len(shape) or shape[dim] % size:
    return P()
  return P(*(axis if i == dim else None for i in range(len(shape))))


def weight_spec(
  role: str,
  shape: tuple[int, ...],
  tensor_parallel_size: int,
  *,
  expert_parallel: bool = False,
  scale: bool = False,
  batch_invariant: bool = False,
) -> P:
  """The partition spec of one parameter from its sharding role (see the module's table).

  Args:
    role: one of `jaxengine.models.registry.ROLES`; `REPLICATED` (or any other) is replicated.
    shape: its shape (``[out, in]`` layout: column-parallel splits dimension 0, row-parallel
      dimension 1, vocab-parallel dimension 0; ``[X, in, out]`` stacked experts: dimension 2,
      expert-column-parallel, or 1, expert-row-parallel).
    tensor_parallel_size: `t`.
    expert_parallel: the expert roles split dimension 0, the experts, instead (vLLM's
      ``enable_expert_parallel``).
    scale: the parameter is the float32 scales of a quantized matrix of this role (its shape
      without the input axes): split on the output axis the role splits, else replicated.
    batch_invariant: keep every matrix's input (contraction) axis whole: the row-parallel
      roles split their output axis as the column-parallel ones do (`_WHOLE_CONTRACTION`), so
      that no product is summed across devices (``LLM(..., batch_invariant=True)``: the module
      docstring's "Batch-invariant mode").
  """
  dims = _SCALE_DIM if scale else _ROLE_DIM
  if batch_invariant:
    role = _WHOLE_CONTRACTION.get(role, role)
  if role not in _ROLE_DIM or tensor_parallel_size == 1:
    return P()
  if expert_parallel and role in (EXPERT_COLUMN_PARALLEL, EXPERT_ROW_PARALLEL):
    return _split(shape, 0, MODEL, tensor_parallel_size)
  if role not in dims:
    return P()
  return _split(shape, dims[role], MODEL, tensor_parallel_size)


def weight_shardings(
  weights: Any,
  mesh: Mesh,
  rules: Mapping[str, str],
  *,
  expert_parallel: bool = False,
  stacked_paths: tuple[str, ...] = (),
  batch_invariant: bool = False,
) -> Any:
  """`NamedSharding`s for a model's weights (an `nnx.State` or any pytree of arrays).

  Args:
    weights: the tree.
    mesh: the mesh.
    rules: parameter name -> role (`jaxengine.models.registry.sharding_rules` of the model);
      each leaf is looked up by the last name of its path, and one without a rule replicated.
    expert_parallel: stacked experts split over the experts axis (see `weight_spec`).
    stacked_paths: the top-level names whose leaves have a leading layer axis (a model's
      ``stacked_paths``, `jaxengine.models.layer_scan`): that axis stays unsplit and the role
      applies to the rest of the shape.
    batch_invariant: every matrix's input axis whole (see `weight_spec`).
  """
  t = axis_size(mesh, MODEL)

  def one(path, leaf):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [n for n in keys if isinstance(n, str) and n != "value"]
    role = rules.get(names[-1], REPLICATED) if names else REPLICATED
    scale = len(names) > 1 and names[-2] == "scales"  # a quantized matrix's scales
    stacked = bool(names) and names[0] in stacked_paths
    shape = tuple(leaf.shape)[int(stacked) :]
    spec = weight_spec(
      role, shape, t, expert_parallel=expert_parallel, scale=scale, batch_invariant=batch_invariant
    )
    return NamedSharding(mesh, P(None, *spec) if stacked else spec)

  return jax.tree_util.tree_map_with_path(one, weights)


def data_groups(mesh: Mesh) -> list[Mesh]:
  """The data-parallel groups of `mesh`: for each index of its `DATA` axis, a mesh of the same
  axes over that index's devices (`DATA` of size 1, `MODEL` as in `mesh`)."""
  axis = mesh.axis_names.index(DATA)
  return [
    Mesh(np.take(mesh.devices, [g], axis=axis), mesh.axis_names)
    for g in range(mesh.devices.shape[axis])
  ]


def row_shardings(tree: Any, num_rows: int, mesh: Mesh) -> Any:
  """`NamedSharding`s for batch state or metadata: leaves of leading dimension `num_rows` over
  `DATA`, every other leaf (scalars, batch-wide flags) replicated."""
  d = axis_size(mesh, DATA)

  def one(leaf):
    shape: tuple[int, ...] = tuple(getattr(leaf, "shape", ()))
    by_row = len(shape) >= 1 and shape[0] == num_rows and num_rows % d == 0 and d > 1
    return NamedSharding(mesh, P(DATA) if by_row else P())

  return jax.tree.map(one, tree)


def replicated(tree: Any, mesh: Mesh) -> Any:
  """A replicated `NamedSharding` for every leaf of `tree`."""
  return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)
