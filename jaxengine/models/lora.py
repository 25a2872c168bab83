"""Unmerged LoRA adapters inside a model call: each token adds its own adapter's low-rank update.

The engine keeps up to ``N`` adapters in stacked device buffers (`LoRAInputs.layers`), one pair
per decoder layer and target projection: ``A [N + 1, in, R]`` and ``B [N + 1, R, out]``, slot 0
all zeros (no adapter), ranks zero-padded to ``R`` (``max_lora_rank``) and the adapter's scale
folded into ``B``. Each query token carries its slot (`LoRAInputs.slots`), and a projection
``y = W x`` becomes ``y + B[slot] (A[slot] x)`` (`add_lora`), computed as a trainer computes it,
without touching ``W``.

The update is written densely over the slots (``x`` against every slot's ``A``, a one-hot mask
of each token's slot, then every slot's ``B``): fixed shapes whatever adapters a step mixes, no
``[T, in, R]`` gather, and ``N`` times the flops of one rank-``R`` update (slot 0, all zeros, is
never multiplied; small next to the projection itself for a few slots). A model without LoRA
never calls any of this. In batch-invariant mode both products are row-tiled
(`jaxengine.models.batch_invariant.row_tiled_dot`); on a mesh the buffers are split as their
base projections (`jaxengine.parallel.lora_specs`).

Shape letters: ``T`` query tokens, ``N`` adapter slots (``max_loras``), ``R`` ``max_lora_rank``,
``L`` layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxengine.models.batch_invariant import row_tiled_dot

__all__ = ["EXPERT_LORA_TARGETS", "LORA_TARGETS", "LayerLoRA", "LoRAInputs", "add_lora"]

#: The routed experts' projections of a mixture of experts (`jaxengine.models.moe`), by the
#: per-expert module names of PEFT's earlier adapters (``mlp.experts.{e}.gate_proj``): one pair
#: per expert, ``(A [N + 1, X, in, R], B [N + 1, X, R, out])`` (`jaxengine.models.moe_lora`).
#: PEFT's adapters of transformers' fused experts (``target_parameters`` ``gate_up_proj``,
#: ``down_proj``) are read onto them (`jaxengine.lora.peft_experts`).
EXPERT_LORA_TARGETS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")

#: The projections an adapter may target, by their Hugging Face / PEFT module names.
#: (``in_proj_*`` and ``out_proj``: a Qwen3.5 Gated DeltaNet layer's, `jaxengine.models.qwen3_5`;
#: ``shared_expert.*``: the shared expert of a Qwen3.5 mixture of experts, PEFT's ``gate_proj``
#: ... under ``mlp.shared_expert``.)
LORA_TARGETS = (
  *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
  *("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
  *EXPERT_LORA_TARGETS,
  *("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerLoRA:
  """One layer's view of `LoRAInputs`.

  Attributes:
    slots: ``[T] int32`` each token's adapter slot (0: none).
    weights: target name -> ``(A [N + 1, in, R], B [N + 1, R, out])`` (targets of no adapter may
      be absent; an expert target's ``(A [N + 1, X, in, R], B [N + 1, X, R, out])``).
  """

  slots: jax.Array
  weights: dict[str, tuple[jax.Array, jax.Array]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAInputs:
  """The adapters of a step and each token's slot, handed to the model call.

  Attributes:
    slots: ``[T] int32`` each flat query token's adapter slot (0: the base model).
    layers: ``L`` dicts, target name -> ``(A [N + 1, in, R], B [N + 1, R, out])`` in the model
      dtype, the scale folded into ``B``.
  """

  slots: jax.Array
  layers: tuple[dict[str, tuple[jax.Array, jax.Array]], ...]

  def layer(self, index: int) -> LayerLoRA:
    """Layer `index`'s buffers with the token slots."""
    return LayerLoRA(self.slots, self.layers[index])


def add_lora(
  y: jax.Array,
  x: jax.Array,
  lora: LayerLoRA | None,
  target: str,
  batch_invariant: bool = False,
) -> jax.Array:
  """``y + B[slot] (A[slot] x)`` per token for projection `target`; `y` itself without LoRA.

  Args:
    y: ``[..., out]`` the base projection of `x` (its leading dimensions flatten to ``T``).
    x: ``[..., in]`` the projection's input. The buffers may be wider (``in`` and ``out`` the
      widest layer's, `jaxengine.lora.LoRAManager`'s ``layer_shapes``): the first ``in`` rows
      of ``A`` and ``out`` columns of ``B`` are this layer's.
    lora: this layer's `LayerLoRA`, or None (then nothing is traced).
    target: the projection's module name (`LORA_TARGETS`).
    batch_invariant: both products as `jaxengine.models.batch_invariant.row_tiled_dot`s over
      the slots side by side (``A`` as ``[N * R, in]``, ``B`` as ``[out, N * R]``), so that a
      token's update depends on its own input and slot only (the calling module's mode).

  Returns:
    ``[..., out]`` in `y`'s dtype.
  """
  if lora is None or target not in lora.weights:
    return y
  a, b = lora.weights[target]  # [N + 1, in, R], [N + 1, R, out]
  # Slot 0 (the base model) adds nothing: its tokens are masked below. Buffers wider than this
  # layer's projection (a model whose layers differ in width: Gemma 4) hold its pair first.
  a, b = a[1:, : x.shape[-1]], b[1:, :, : y.shape[-1]]
  n, n_in, r = a.shape
  flat = x.reshape(-1, n_in)  # [T, in]
  if batch_invariant:
    a_rows = jnp.transpose(a, (0, 2, 1)).reshape(n * r, n_in)  # [N * R, in]
    xa = row_tiled_dot(flat, a_rows, preferred_element_type=jnp.float32).reshape(-1, n, r)
  else:
    xa = jnp.einsum("ti,nir->tnr", flat, a, preferred_element_type=jnp.float32)
  adapters = jnp.arange(1, n + 1, dtype=lora.slots.dtype)  # [N] slots 1..N
  mine = lora.slots[:, None] == adapters  # [T, N]
  xa = jnp.where(mine[..., None], xa, 0.0).astype(b.dtype)
  if batch_invariant:
    b_rows = b.reshape(n * r, -1).T  # [out, N * R]
    delta = row_tiled_dot(xa.reshape(-1, n * r), b_rows, preferred_element_type=jnp.float32)
  else:
    delta = jnp.einsum("tnr,nro->to", xa, b, preferred_element_type=jnp.float32)
  return y + delta.astype(y.dtype).reshape(y.shape)
