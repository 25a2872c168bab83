"""Gemma 4's mixture-of-experts block, added to a layer's dense MLP (``enable_moe_block``).

It differs from `jaxengine.models.moe.SparseMoeBlock` (Qwen3-MoE, Mixtral) in its router and its
experts, and reuses that module's routing (`jaxengine.models.moe.route`) and grouped matmuls
(`jaxengine.models.grouped_matmul.grouped_linear`):

- router: the block's input ``x`` (the layer's residual stream before its MLP) normalised
  without a scale, times a learned ``[E]`` scale and ``E ** -0.5``, projected to ``[X]`` logits;
  softmax, the ``k`` largest renormalised to sum to one, each then multiplied by its expert's
  learned ``per_expert_scale``;
- experts: GeGLU (the config's GELU) over ``pre_feedforward_layernorm_2(x)``, the gate and up
  projections fused in one ``[X, E, 2F]`` stack (the checkpoint's ``gate_up_proj``, ``(X, 2F, E)``,
  transposed on loading) whose output's first ``F`` columns are the gate. LoRA adapters on the
  experts (`jaxengine.models.moe_lora`) are added to the gate and up halves and the down
  projection.

Shape letters as `jaxengine.models.moe`: ``T`` tokens, ``E`` hidden size, ``X`` experts, ``k``
experts per token, ``F`` ``moe_intermediate_size``, ``M = T * k``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.gemma4_config import Gemma4Config
from jaxengine.models.gemma_config import ACTIVATIONS
from jaxengine.models.grouped_matmul import grouped_linear
from jaxengine.models.layers import linear, normal_init, normal_out_in
from jaxengine.models.lora import LayerLoRA
from jaxengine.models.moe import route
from jaxengine.models.moe_lora import add_expert_lora
from jaxengine.reductions import fixed_sum


class UnscaledRMSNorm(nnx.Module):
  """``x / sqrt(mean(x ** 2) + eps)`` in float32, no learned scale (Gemma 4's value norm and
  router norm); ``[..., dim]`` to the same shape and dtype."""

  def __init__(self, eps: float):
    self.eps = eps
    #: Sum the squares in a fixed order (batch-invariant mode, as `RMSNorm`).
    self.batch_invariant = False

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    if self.batch_invariant:
      mean_square = fixed_sum(jnp.square(x32), keepdims=True) / x32.shape[-1]
    else:
      mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(mean_square + self.eps)).astype(x.dtype)


class Gemma4MoeBlock(nnx.Module):
  """Top-``k`` routed GeGLU experts (module docstring).

  Attributes:
    router_norm: the router's unscaled RMSNorm.
    router_scale: ``[E]`` the router input's learned scale.
    router: ``[X, E]`` router projection.
    per_expert_scale: ``[X]`` each expert's routing-weight multiplier.
    expert_gate_up: ``[X, E, 2F]`` each expert's fused gate and up projections.
    expert_down: ``[X, F, E]`` each expert's down projection.
    batch_invariant: row-tiled products (`jaxengine.models.moe`).
  """

  def __init__(self, config: Gemma4Config, *, dtype, rngs: nnx.Rngs):
    e, f, x = config.hidden_size, config.moe_intermediate_size, config.num_experts
    self.router_norm = UnscaledRMSNorm(config.rms_norm_eps)
    self.router_scale = nnx.Param(jnp.ones((e,), dtype))
    self.router = nnx.Param(normal_out_in(rngs, (x,), (e,), dtype))  # [X, E]
    self.per_expert_scale = nnx.Param(jnp.ones((x,), dtype))
    self.expert_gate_up = nnx.Param(normal_init(rngs, (x, e, 2 * f), e, dtype))  # [X, E, 2F]
    self.expert_down = nnx.Param(normal_init(rngs, (x, f, e), f, dtype))  # [X, F, E]
    self.top_k = config.top_k_experts
    self.approximate = ACTIVATIONS[config.hidden_activation]
    self.batch_invariant = False

  def __call__(self, residual: jax.Array, x: jax.Array, lora: LayerLoRA | None = None) -> jax.Array:
    """The experts' weighted sum.

    Args:
      residual: ``[..., E]`` the router's input (the layer's residual stream before its MLP).
      x: ``[..., E]`` the experts' input (``pre_feedforward_layernorm_2(residual)``).
      lora: this layer's adapters (the expert targets, added to the gate and up halves and the
        down projection: `jaxengine.models.moe_lora.add_expert_lora`), or None.

    Returns:
      ``[..., E]`` in ``x.dtype``.
    """
    lead, width = x.shape[:-1], x.shape[-1]
    k, fixed = self.top_k, self.batch_invariant
    tokens = x.reshape(-1, width)  # [T, E]
    routed_in = self.router_norm(residual.reshape(-1, width))
    routed_in = routed_in * self.router_scale[...] * jnp.asarray(width**-0.5, x.dtype)
    logits = linear(routed_in, self.router[...], batch_invariant=fixed)  # [T, X]
    routing = route(logits, k, normalize=True, batch_invariant=fixed)
    weights = routing.weights * self.per_expert_scale[...].astype(jnp.float32)[routing.experts]
    num_experts = self.router.shape[0]
    assigned = routing.experts.reshape(-1)  # [M], token t's j-th expert at t * k + j
    order = jnp.argsort(assigned, stable=True)  # [M] assignment of each sorted row
    group_sizes = jnp.bincount(assigned, length=num_experts).astype(jnp.int32)  # [X]
    row_tokens = order // k  # [M] the token of each sorted row
    rows = tokens[row_tokens]  # [M, E]
    adapt = lambda y, inputs, target: add_expert_lora(
      y, inputs, lora, target, row_tokens, group_sizes, batch_invariant=fixed
    )
    gate_up = self._experts(self.expert_gate_up[...], rows, group_sizes)  # [M, 2F]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate, up = adapt(gate, rows, "experts.gate_proj"), adapt(up, rows, "experts.up_proj")
    hidden = jax.nn.gelu(gate, approximate=self.approximate) * up  # [M, F]
    out = self._experts(self.expert_down[...], hidden, group_sizes)  # [M, E]
    out = adapt(out, hidden, "experts.down_proj")
    per_choice = out[jnp.argsort(order)].reshape(-1, k, width).astype(jnp.float32)  # [T, k, E]
    combined = per_choice[:, 0] * weights[:, 0, None]
    for j in range(1, k):  # a fixed order of the k terms
      combined = combined + per_choice[:, j] * weights[:, j, None]
    return combined.astype(x.dtype).reshape(*lead, width)

  def _experts(self, w: jax.Array, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`grouped_linear` of the sorted ``[M, in]`` rows by the ``[X, in, out]`` stack `w`."""
    return grouped_linear(rows, w, group_sizes, batch_invariant=self.batch_invariant)
