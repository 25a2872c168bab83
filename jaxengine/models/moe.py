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

LoRA adapters on the experts (`jaxengine.models.moe_lora`) add each row's update inside step 3,
as grouped matmuls over the same sorted rows.

Expert weights are stacked per block as ``[X, in, out]``: each expert's matrix is the
transpose of PyTorch's ``nn.Linear`` ``(out, in)`` layout the checkpoints store, transposed on
the host as it is loaded (`jaxengine.models.llama_checkpoints.hf_weight_specs`: a per-expert
checkpoint tensor fills one row of the stack). This is the layout XLA's TPU grouped matmul
reads in place.

On GPU and TPU `ragged_dot_general` lowers to XLA's ragged dot, a grouped matmul whose work is
the assignments' only (not measured in this repository: its tests and benchmarks run on CPU).
The platform is the one compiled for (`jaxengine.models.target_device.target_platform`), so a
TPU compiled for from a CPU host gets the ragged dot too. Compiled for TPU v5e (libtpu
0.0.42.1), the ragged dot takes Qwen3-30B-A3B's and Mixtral's experts in bfloat16 and int8 and
is partitioned by XLA over tensor-parallel experts; its TPU emitter reads the matrices as
``[X, in, out]``. Stored as ``[X, out, in]`` (this module's earlier layout) it copied each
expert stack transposed on every call: one MoE layer's decode step of 64 tokens, compiled for
v5e, held a 404 MB temporary for Qwen3-30B-A3B's bfloat16 experts (945 MB for Mixtral-8x7B's)
and accessed 3.7 GB (8.6 GB) for 1.2 GB (2.8 GB) of expert weights; over ``[X, in, out]`` it
holds no temporary of expert size (`tests/models/test_tpu_kernels.py` checks it). JAX's Mosaic
grouped matmul (``megablox.gmm``) takes only bfloat16 / float32 matrices and cannot be
partitioned automatically ("wrap the call in a shard_map"), so the engine keeps the ragged dot.
XLA:CPU has no such kernel: JAX lowers the ragged product there to one dense
product of the rows, masked per group, with every expert's matrix, and the product's operand
order makes XLA copy every expert's weights into a transposed buffer on each call. So on CPU the
block multiplies the sorted rows by every expert's matrix as a product batched over the experts
(weights read in place) and keeps each row's own expert's result: the lowering's FLOPs without
its copy. Measured on a 2-core CPU, 8 experts of 512 -> 512, weights passed as arguments, 2 / 16
/ 64 / 256 rows: 2.70 / 3.29 / 5.15 / 10.72 ms for the ragged product over ``[X, out, in]``,
1.17 / 1.71 / 3.45 / 8.89 ms over ``[X, in, out]``, 0.46 / 0.62 / 1.70 / 6.38 ms for the batched
product over ``[X, out, in]`` (a dense product as wide as all 8 experts: 0.60 / 0.99 / 2.24 /
6.35 ms); over ``[X, in, out]`` the block loops over the experts instead (`_pick`). The CPU step
thus costs about what a dense MLP as wide as all experts does (`benchmarks/bench_moe.py`); with
tensor parallelism on CPU the down projection's all-reduce carries every expert's partial
product (``[X, M, E]``, not ``[M, E]``).

Sharding (`jaxengine.models.registry`): the stacked matrices are `EXPERT_COLUMN_PARALLEL`
(gate, up: split on ``out``, their last axis, the expert's intermediate features) and
`EXPERT_ROW_PARALLEL` (down: split on ``in``, its middle axis); with ``enable_expert_parallel``
both are split on ``X`` instead (`jaxengine.parallel`). The router is replicated. Compiled for
two v5e chips (64 tokens' decode step), tensor parallelism reads each chip's half of the stacks
in place (no temporary of expert size); with expert parallelism XLA's partitioner does not keep
the ragged dot's groups local and gathers the stacks (a 1.4 GB temporary for Qwen3-30B-A3B's
bfloat16 experts): a ``shard_map`` over local groups would be needed, not done here. On four
chips Qwen3-30B-A3B's 192 intermediate features per chip would be padded to 256 lanes, so XLA:TPU
stores the gate and up stacks (``[128, 2048, 192]`` per chip) with the 2,048 input features minor
(layout ``{1,2,0}``) and its ragged dot kernel reads ``{2,1,0}``: every call copies both stacks
(100.7 MB each, read and written; 19.3 GB per one-token step per chip over 48 layers, measured with
`jaxengine.aot.hbm_bytes` in `benchmarks/README.md`). Storing the intermediate features padded per
shard to a lane multiple, with zero weights, would give the kernel its layout; not done here.

Quantized experts (``EngineConfig.quantization``, `jaxengine.models.quantization`): each
expert matrix holds int8 / float8_e4m3fn values and ``[X, out] float32`` scales (``QUANTIZABLE``,
``scales``); `grouped_linear` casts the values to the activations' dtype inside the grouped
product's input and multiplies each sorted row's ``[out]`` result by its own expert's scales (a
gather of ``[M, out]``, exact per output channel), the router staying in the model dtype. On
TPU the ragged dot takes int8 values as they are (the cast first made XLA write a bfloat16 copy
of the stack on every call); float8 values are cast first (TPU v5e has no float8 product: given
as they are, XLA's copy was twice the size). Compiled for v5e, one MoE layer's decode step of 64
tokens, weights ``[X, in, out]``: Qwen3-30B-A3B's int8 experts (0.60 GB) accessed 0.76 GB with no
temporary, its float8 ones 3.2 GB with a 404 MB temporary (the bfloat16 copy).
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

from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.grouped_matmul import grouped_linear
from jaxengine.models.layers import linear, normal_init, normal_out_in
from jaxengine.models.llama_config import LlamaConfig
from jaxengine.models.lora import LayerLoRA
from jaxengine.models.moe_lora import EXPERT_TARGET_OF, add_expert_lora
from jaxengine.reductions import fixed_sum

__all__ = ["Routing", "SparseMoeBlock", "route"]


class Routing(NamedTuple):
  """Each token's experts and their weights.

  Attributes:
    weights: ``[T, k] float32`` routing weights, largest first.
    experts: ``[T, k] int32`` expert indices.
  """

  weights: jax.Array
  experts: jax.Array


def route(
  logits: jax.Array,
  k: int,
  *,
  normalize: bool,
  batch_invariant: bool = False,
  experts: jax.Array | None = None,
) -> Routing:
  """Softmax over the experts in float32, the `k` largest, optionally renormalised.

  Args:
    logits: ``[T, X]`` router logits (any float dtype).
    k: experts per token (static).
    normalize: divide the `k` weights by their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``).
    batch_invariant: sums in a fixed order (`jaxengine.reductions.fixed_sum`).
    experts: None (the `k` largest), or ``[T, k]`` integer experts to use instead (routing
      replay: the ids an engine returned in ``CompletionOutput.routed_experts``); their
      weights are still this softmax's probabilities, renormalised as above.

  Returns:
    `Routing` with ``[T, k]`` weights and experts.
  """
  x = logits.astype(jnp.float32)
  if batch_invariant:
    shifted = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    probs = shifted / fixed_sum(shifted, keepdims=True)
  else:
    probs = jax.nn.softmax(x, axis=-1)
  if experts is None:
    weights, experts = jax.lax.top_k(probs, k)
  else:  # replayed: the given experts, weighted by the current router
    experts = experts.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
  if normalize:
    total = fixed_sum(weights, keepdims=True) if batch_invariant else weights.sum(-1, keepdims=True)
    weights = weights / total
  return Routing(weights=weights, experts=experts.astype(jnp.int32))


def _expert_init(rngs: nnx.Rngs, num_experts: int, num_in: int, num_out: int, dtype) -> jax.Array:
  """``[X, in, out]`` experts of `jaxengine.models.layers.normal_init` (fan-in ``in``), drawn in
  ``[in, X, out]`` order: a seed gives the same experts as under the earlier ``[X, out, in]``
  layout (`jaxengine.models.layers.normal_out_in`), transposed."""
  w = normal_init(rngs, (num_in, num_experts, num_out), num_in, dtype)
  return w.transpose(1, 0, 2)


class SparseMoeBlock(nnx.Module):
  """Top-``k`` routed SwiGLU experts (see the module docstring); maps ``[..., E]`` to itself.

  Attributes:
    router: ``[X, E]`` router (gate) projection.
    expert_gate: ``[X, E, F]`` each expert's gate projection (``[X, in, out]``).
    expert_up: ``[X, E, F]`` each expert's up projection.
    expert_down: ``[X, F, E]`` each expert's down projection.
    scales: ``{name: [X, out] float32}`` per-expert output-channel scales of the quantized expert
      matrices (empty unless `jaxengine.models.quantization.quantize_model` made int8 / float8
      values of them; the router stays in the model dtype).
    num_experts_per_tok: ``k`` (static).
    norm_topk_prob: renormalise the ``k`` routing weights to sum to one.
    batch_invariant: row-tiled products (`jaxengine.models.Llama`).
  """

  #: The matrices `quantize_model` may quantize, with their input axes (the middle one: one
  #: scale per expert and output feature).
  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = dict.fromkeys(
    ("expert_gate", "expert_up", "expert_down"), (1,)
  )

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    e, f, x = config.hidden_size, config.moe_intermediate_size, config.num_experts
    self.router = nnx.Param(normal_out_in(rngs, (x,), (e,), dtype))  # [X, E]
    self.expert_gate = nnx.Param(_expert_init(rngs, x, e, f, dtype))  # [X, E, F]
    self.expert_up = nnx.Param(_expert_init(rngs, x, e, f, dtype))  # [X, E, F]
    self.expert_down = nnx.Param(_expert_init(rngs, x, f, e, dtype))  # [X, F, E]
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.num_experts_per_tok = config.num_experts_per_tok
    self.norm_topk_prob = config.norm_topk_prob
    self.batch_invariant = False

  def __call__(
    self,
    x: jax.Array,
    routed_experts: jax.Array | None = None,
    lora: LayerLoRA | None = None,
  ) -> jax.Array:
    """Maps ``[..., E]`` to ``[..., E]`` in the model dtype (`routed`'s output alone)."""
    return self.routed(x, routed_experts, lora)[0]

  def routed(
    self,
    x: jax.Array,
    routed_experts: jax.Array | None = None,
    lora: LayerLoRA | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """The block's output and the experts each token went to.

    Args:
      x: ``[..., E]`` the block's input.
      routed_experts: None (the router's top ``k``), or ``[..., k]`` integer experts to route
        each token to instead (replay; `route`'s ``experts``).
      lora: this layer's LoRA adapters (its expert targets,
        `jaxengine.models.moe_lora.add_expert_lora`; ``slots`` one per token of `x`), or None.

    Returns:
      ``([..., E] output in the model dtype, [..., k] int32 experts)``: the experts largest
      weight first (the router's top ``k``, as `route` orders them), or the replayed ones.
    """
    lead, width = x.shape[:-1], x.shape[-1]
    k, fixed = self.num_experts_per_tok, self.batch_invariant
    tokens = x.reshape(-1, width)  # [T, E]
    logits = linear(tokens, self.router[...], batch_invariant=fixed)  # [T, X]
    forced = None if routed_experts is None else routed_experts.reshape(-1, k)
    routing = route(logits, k, normalize=self.norm_topk_prob, batch_invariant=fixed, experts=forced)
    num_experts = self.router.shape[0]
    assigned = routing.experts.reshape(-1)  # [M], token t's j-th expert at t * k + j
    order = jnp.argsort(assigned, stable=True)  # [M] assignment of each sorted row
    group_sizes = jnp.bincount(assigned, length=num_experts).astype(jnp.int32)  # [X]
    row_tokens = order // k  # [M] the token of each sorted row
    rows = tokens[row_tokens]  # [M, E]
    experts = lambda name, inputs: self._experts(name, inputs, group_sizes, lora, row_tokens)
    gate = experts("expert_gate", rows)  # [M, F]
    up = experts("expert_up", rows)  # [M, F]
    hidden = jax.nn.silu(gate) * up  # [M, F]
    out = experts("expert_down", hidden)  # [M, E]
    per_choice = out[jnp.argsort(order)].reshape(-1, k, width).astype(jnp.float32)  # [T, k, E]
    combined = per_choice[:, 0] * routing.weights[:, 0, None]
    for j in range(1, k):  # a fixed order of the k terms
      combined = combined + per_choice[:, j] * routing.weights[:, j, None]
    return combined.astype(x.dtype).reshape(*lead, width), routing.experts.reshape(*lead, k)

  def _experts(
    self,
    name: str,
    rows: jax.Array,
    group_sizes: jax.Array,
    lora: LayerLoRA | None,
    row_tokens: jax.Array,
  ) -> jax.Array:
    """`grouped_linear` of the sorted ``[M, in]`` `rows` by expert matrix `name`, with its
    ``[X, out]`` scales when quantized, plus its LoRA update (`add_expert_lora`)."""
    scale = self.scales[name][...] if name in self.scales else None
    w = getattr(self, name)[...]
    fixed = self.batch_invariant
    y = grouped_linear(rows, w, group_sizes, scale=scale, batch_invariant=fixed)
    target = EXPERT_TARGET_OF[name]
    return add_expert_lora(y, rows, lora, target, row_tokens, group_sizes, batch_invariant=fixed)
