"""A sparse mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral) in Flax NNX.

`SparseMoeBlock` replaces the dense SwiGLU MLP of `jaxengine.models.llama` on the layers of a
config's ``moe_layers``. Each token picks ``k = num_experts_per_tok`` of ``X = num_experts``
SwiGLU experts and sums their outputs weighted by the router:

1. route (`route`): ``router(x)`` logits ``[T, X]``, a softmax over the experts in float32, the
   ``k`` largest probabilities, renormalised to sum to one when the model says so (Mixtral
   always, Qwen3-MoE with ``norm_topk_prob``);
2. group: the ``T * k`` (token, expert) assignments sorted by expert (a stable sort, so tokens
   keep their order inside a group), with each expert's count, ``group_sizes [X]``;
3. compute: gate, up and down projections as grouped matmuls over the sorted rows
   (`grouped_linear`, `jax.lax.ragged_dot_general` on GPU and TPU): row ``r`` is multiplied by
   the matrix of the expert its group belongs to;
4. combine: the rows put back in assignment order and each token's ``k`` outputs summed,
   weighted by its routing weights (in float32, then cast to the model dtype).

Expert weights are stacked per block, ``[X, out, in]`` (each expert's matrix in PyTorch's
``nn.Linear`` layout, as the checkpoints store it, so a per-expert checkpoint tensor fills one
row of the stack: `jaxengine.models.llama_checkpoints.hf_weight_specs`).

On GPU and TPU `ragged_dot_general` lowers to XLA's ragged dot, a grouped matmul whose work is
the assignments' only (not measured in this repository: its tests and benchmarks run on CPU).
XLA:CPU has no such kernel: JAX lowers the ragged product there to one dense
product of the rows, masked per group, with every expert's matrix, and the product's operand
order makes XLA copy every expert's weights into a transposed buffer on each call. So on CPU the
block multiplies the sorted rows by every expert's matrix as a product batched over the experts
(weights read in place) and keeps each row's own expert's result: the lowering's FLOPs without
its copy. Measured on a 2-core CPU, 8 experts of 512 -> 512, weights passed as arguments, 2 / 16
/ 64 / 256 rows: 2.70 / 3.29 / 5.15 / 10.72 ms for the ragged product over ``[X, out, in]``,
1.17 / 1.71 / 3.45 / 8.89 ms over ``[X, in, out]``, 0.46 / 0.62 / 1.70 / 6.38 ms for the batched
product (a dense product as wide as all 8 experts: 0.60 / 0.99 / 2.24 / 6.35 ms). The CPU step
thus costs about what a dense MLP as wide as all experts does (`benchmarks/bench_moe.py`); with
tensor parallelism on CPU the down projection's all-reduce carries every expert's partial
product (``[X, M, E]``, not ``[M, E]``).

Sharding (`jaxengine.models.registry`): the stacked matrices are `EXPERT_COLUMN_PARALLEL`
(gate, up: split on ``out``, the expert's intermediate features) and `EXPERT_ROW_PARALLEL`
(down: split on ``in``); with ``enable_expert_parallel`` both are split on ``X`` instead
(`jaxengine.parallel`). The router is replicated.

Quantized experts (``EngineConfig.quantization``, `jaxengine.models.quantization`): each
expert matrix holds int8 / float8_e4m3fn values and ``[X, out] float32`` scales (``QUANTIZABLE``,
``scales``); `grouped_linear` casts the values to the activations' dtype inside the grouped
product's input and multiplies each sorted row's ``[out]`` result by its own expert's scales (a
gather of ``[M, out]``, exact per output channel), the router staying in the model dtype.
Measured on a 2-core CPU (`benchmarks/bench_moe_quant.py`, 8 experts of 512 -> 512, 2 / 16 / 64
/ 256 rows, ms): the CPU form float32 1.08 / 1.62 / 3.51 / 15.9, int8 1.11 / 1.86 / 4.05 / 14.5,
fp8 1.46 / 2.09 / 4.27 / 15.2, int8 with the scales folded into a dequantized copy first 1.27 /
1.96 / 4.00 / 14.9; the ragged-dot lowering float32 6.15 / 6.44 / 8.36 / 16.0, int8 4.09 / 4.82
/ 5.64 / 14.6 (GPU and TPU kernels not measured). On CPU the cast in the product's input
costs about what float32 weights do, and folding the scales in first is no faster: the engine
keeps the cast.

Batch-invariant mode (``batch_invariant=True``, `jaxengine.models.batch_invariant`): the router
is a row-tiled product and each grouped matmul runs ``ROW_TILE`` sorted rows at a time, every
tile the same ``[ROW_TILE, in]`` grouped product with the tile's own group sizes, so a row's bits
depend on its values and its expert only, not on the other tokens of the call.

Shape letters: ``T`` tokens of the call (all leading dimensions flattened), ``E`` hidden size,
``X`` experts, ``k`` experts per token, ``F`` ``moe_intermediate_size``, ``M = T * k``.

References:
  Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
  Layer", 2017.
  Jiang et al., "Mixtral of Experts", 2024.
  Qwen Team, "Qwen3 Technical Report", 2025.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.batch_invariant import ROW_TILE
from jaxengine.models.layers import linear, normal_out_in
from jaxengine.models.llama_config import LlamaConfig
from jaxengine.reductions import fixed_sum

__all__ = ["Routing", "SparseMoeBlock", "grouped_linear", "route"]

# lhs [M, in] ragged along M; rhs [X, out, in] grouped along X, contracting `in` with `in`.
_RAGGED = jax.lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((1,), (2,)), ((), ())),
  lhs_ragged_dimensions=[0],
  rhs_group_dimensions=[0],
)


class Routing(NamedTuple):
  """Each token's experts and their weights.

  Attributes:
    weights: ``[T, k] float32`` routing weights, largest first.
    experts: ``[T, k] int32`` expert indices.
  """

  weights: jax.Array
  experts: jax.Array


def route(logits: jax.Array, k: int, *, normalize: bool, batch_invariant: bool = False) -> Routing:
  """Softmax over the experts in float32, the `k` largest, optionally renormalised.

  Args:
    logits: ``[T, X]`` router logits (any float dtype).
    k: experts per token (static).
    normalize: divide the `k` weights by their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``).
    batch_invariant: sums in a fixed order (`jaxengine.reductions.fixed_sum`).

  Returns:
    `Routing` with ``[T, k]`` weights and experts.
  """
  x = logits.astype(jnp.float32)
  if batch_invariant:
    shifted = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    probs = shifted / fixed_sum(shifted, keepdims=True)
  else:
    probs = jax.nn.softmax(x, axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if normalize:
    total = fixed_sum(weights, keepdims=True) if batch_invariant else weights.sum(-1, keepdims=True)
    weights = weights / total
  return Routing(weights=weights, experts=experts.astype(jnp.int32))


def grouped_linear(
  x: jax.Array,
  w: jax.Array,
  group_sizes: jax.Array,
  *,
  scale: jax.Array | None = None,
  batch_invariant: bool = False,
) -> jax.Array:
  """Row ``r`` of `x` times the ``[out, in]`` matrix of the group it lies in (a grouped matmul).

  On GPU and TPU one `jax.lax.ragged_dot_general` (a grouped-matmul kernel); on CPU
  `_every_group_then_pick` (see the module docstring for why).

  With `scale` (experts quantized per output row, `jaxengine.models.quantization`) the values
  are cast to the activations' dtype, the grouped product runs in it, and row ``r``'s ``[out]``
  result is multiplied by its own group's scales, ``scale[group(r)]``: exact per output
  channel, ``x @ (s * q).T == (x @ q.T) * s``, as `jaxengine.models.layers.linear` does for one
  matrix.

  Args:
    x: ``[M, in]`` rows sorted by group: the first ``group_sizes[0]`` rows belong to group 0,
      the next ``group_sizes[1]`` to group 1, and so on.
    w: ``[X, out, in]`` one matrix per group (PyTorch ``nn.Linear`` layout): float, or int8 /
      float8_e4m3fn with `scale`.
    group_sizes: ``[X] int32`` rows per group, summing to at most ``M`` (rows past the sum
      give zeros).
    scale: None, or ``[X, out] float32`` per-row scales of a quantized `w`.
    batch_invariant: multiply ``ROW_TILE`` rows at a time (see the module docstring).

  Returns:
    ``[M, out]`` in the promoted dtype of `x` and `w`; with `scale`, in ``x.dtype``.
  """
  if scale is not None:
    out = grouped_linear(x, w.astype(x.dtype), group_sizes, batch_invariant=batch_invariant)
    group = jnp.minimum(_row_groups(group_sizes, x.shape[0]), w.shape[0] - 1)  # [M]
    return (out * scale[group]).astype(x.dtype)  # rows past the groups stay 0
  dtype = jnp.result_type(x, w)
  x, w = x.astype(dtype), w.astype(dtype)
  product = _every_group_then_pick if _traced_platform() == "cpu" else _ragged
  if not batch_invariant:
    return product(x, w, group_sizes)
  rows = x.shape[0]
  num_tiles = max(1, math.ceil(rows / ROW_TILE))
  tiles = jnp.pad(x, ((0, num_tiles * ROW_TILE - rows), (0, 0))).reshape(num_tiles, ROW_TILE, -1)
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  tile_start = (jnp.arange(num_tiles, dtype=ends.dtype) * ROW_TILE)[:, None]  # [tiles, 1]
  clip = lambda bound: jnp.clip(bound[None, :], tile_start, tile_start + ROW_TILE)
  tile_sizes = (clip(ends) - clip(starts)).astype(group_sizes.dtype)  # [tiles, X]

  def tile_product(args):
    tile, sizes = args
    tile, weight = jax.lax.optimization_barrier((tile, w))
    return jax.lax.optimization_barrier(product(tile, weight, sizes))

  out = jax.lax.map(tile_product, (tiles, tile_sizes))  # [tiles, ROW_TILE, out]
  return out.reshape(num_tiles * ROW_TILE, -1)[:rows]


def _traced_platform() -> str:
  """The platform the block is traced for: JAX's default device's when one is set (an
  ahead-of-time compile for a TPU topology sets it, `jaxengine.aot`), else the default backend."""
  device = getattr(jax.config, "jax_default_device", None)  # set by `jax.default_device`
  platform = device if isinstance(device, str) else getattr(device, "platform", None)
  return platform or jax.default_backend()


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`grouped_linear` as one ragged product (a grouped-matmul kernel on GPU and TPU)."""
  return jax.lax.ragged_dot_general(x, w, group_sizes, _RAGGED)


#: Bytes of the ``[X, rows, out]`` products `_every_group_then_pick` computes at once; more rows
#: are taken a chunk at a time (a prefill chunk of a large model would otherwise hold gigabytes).
CPU_PRODUCT_BYTES = 64 << 20


def _every_group_then_pick(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`grouped_linear` as XLA:CPU runs it best: every row times every group's matrix, batched
  over the groups (``[X, M, out]``, each matrix read in place), then each row's own group's
  result (exact: a selection, no sum); rows past the groups give zeros. At most
  `CPU_PRODUCT_BYTES` of products at once: more rows go a chunk at a time (a row's result does
  not depend on its chunk's other rows: the rows of one product are computed alike)."""
  num_groups, rows = w.shape[0], x.shape[0]
  group = _row_groups(group_sizes, rows)  # [M]
  per_row = num_groups * w.shape[1] * jnp.dtype(x.dtype).itemsize
  chunk = max(8, CPU_PRODUCT_BYTES // per_row // 8 * 8)
  if rows <= chunk:
    return _pick(x, w, group)
  num_chunks = math.ceil(rows / chunk)
  pad = num_chunks * chunk - rows
  xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(num_chunks, chunk, -1)
  groups = jnp.pad(group, (0, pad), constant_values=num_groups).reshape(num_chunks, chunk)
  out = jax.lax.map(lambda args: _pick(args[0], w, args[1]), (xs, groups))
  return out.reshape(num_chunks * chunk, -1)[:rows]


def _row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
  """``[rows] int32`` the group each sorted row lies in (``X`` for rows past the groups)."""
  return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def _pick(x: jax.Array, w: jax.Array, group: jax.Array) -> jax.Array:
  """Rows ``[C, in]`` times every ``[X, out, in]`` matrix, each row's ``group`` kept (zeros for
  ``group >= X``)."""
  num_groups = w.shape[0]
  # Batched over X with the groups leading ([X, C, out]): XLA:CPU reads each [out, in] matrix
  # in place (a [C, X, out] result made it copy the weights first, 5x slower).
  every = jnp.einsum("mi,xoi->xmo", x, w)
  picked = jnp.take_along_axis(every, jnp.minimum(group, num_groups - 1)[None, :, None], axis=0)
  return jnp.where((group < num_groups)[:, None], picked[0], 0)


class SparseMoeBlock(nnx.Module):
  """Top-``k`` routed SwiGLU experts (see the module docstring); maps ``[..., E]`` to itself.

  Attributes:
    router: ``[X, E]`` router (gate) projection.
    expert_gate: ``[X, F, E]`` each expert's gate projection.
    expert_up: ``[X, F, E]`` each expert's up projection.
    expert_down: ``[X, E, F]`` each expert's down projection.
    scales: ``{name: [X, out] float32}`` per-expert row scales of the quantized expert
      matrices (empty unless `jaxengine.models.quantization.quantize_model` made int8 / float8
      values of them; the router stays in the model dtype).
    num_experts_per_tok: ``k`` (static).
    norm_topk_prob: renormalise the ``k`` routing weights to sum to one.
    batch_invariant: row-tiled products (`jaxengine.models.Llama`).
  """

  #: The matrices `quantize_model` may quantize, with their leading output axes (the expert
  #: and its output features: one scale per expert and output row).
  QUANTIZABLE: ClassVar[dict[str, int]] = {"expert_gate": 2, "expert_up": 2, "expert_down": 2}

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    e, f, x = config.hidden_size, config.moe_intermediate_size, config.num_experts
    self.router = nnx.Param(normal_out_in(rngs, (x,), (e,), dtype))  # [X, E]
    self.expert_gate = nnx.Param(normal_out_in(rngs, (x, f), (e,), dtype))  # [X, F, E]
    self.expert_up = nnx.Param(normal_out_in(rngs, (x, f), (e,), dtype))  # [X, F, E]
    self.expert_down = nnx.Param(normal_out_in(rngs, (x, e), (f,), dtype))  # [X, E, F]
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.num_experts_per_tok = config.num_experts_per_tok
    self.norm_topk_prob = config.norm_topk_prob
    self.batch_invariant = False

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps ``[..., E]`` to ``[..., E]`` in the model dtype."""
    lead, width = x.shape[:-1], x.shape[-1]
    k, fixed = self.num_experts_per_tok, self.batch_invariant
    tokens = x.reshape(-1, width)  # [T, E]
    logits = linear(tokens, self.router[...], batch_invariant=fixed)  # [T, X]
    routing = route(logits, k, normalize=self.norm_topk_prob, batch_invariant=fixed)
    num_experts = self.router.shape[0]
    assigned = routing.experts.reshape(-1)  # [M], token t's j-th expert at t * k + j
    order = jnp.argsort(assigned, stable=True)  # [M] assignment of each sorted row
    group_sizes = jnp.bincount(assigned, length=num_experts).astype(jnp.int32)  # [X]
    rows = tokens[order // k]  # [M, E]
    gate = self._experts("expert_gate", rows, group_sizes)  # [M, F]
    up = self._experts("expert_up", rows, group_sizes)  # [M, F]
    hidden = jax.nn.silu(gate) * up  # [M, F]
    out = self._experts("expert_down", hidden, group_sizes)  # [M, E]
    per_choice = out[jnp.argsort(order)].reshape(-1, k, width).astype(jnp.float32)  # [T, k, E]
    combined = per_choice[:, 0] * routing.weights[:, 0, None]
    for j in range(1, k):  # a fixed order of the k terms
      combined = combined + per_choice[:, j] * routing.weights[:, j, None]
    return combined.astype(x.dtype).reshape(*lead, width)

  def _experts(self, name: str, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`grouped_linear` of the sorted ``[M, in]`` `rows` by expert matrix `name`, with its
    ``[X, out]`` scales when quantized."""
    scale = self.scales[name][...] if name in self.scales else None
    w = getattr(self, name)[...]
    return grouped_linear(rows, w, group_sizes, scale=scale, batch_invariant=self.batch_invariant)
