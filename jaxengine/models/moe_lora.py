"""Unmerged LoRA adapters on a mixture of experts' routed experts, inside the grouped matmuls.

Each expert projection (`jaxengine.models.lora.EXPERT_LORA_TARGETS`) has one low-rank pair per
expert and adapter slot: ``A [N + 1, X, in, R]``, ``B [N + 1, X, R, out]`` (slot 0 all zeros,
ranks zero-padded to ``R``, the scale folded into ``B``, as `jaxengine.models.lora`). A sorted
row of `jaxengine.models.moe.SparseMoeBlock` (one token's assignment to expert ``e``) adds
``B[slot, e] (A[slot, e] x)`` to the expert's projection of it, ``slot`` its token's adapter:
what PEFT computes for the fused experts of transformers (``target_parameters``), where each
expert's matrix becomes ``W_e + scale * B_e A_e``.

Both products are grouped matmuls over the same sorted rows and group sizes as the experts
themselves (`jaxengine.models.grouped_matmul.grouped_linear`: one ragged dot on GPU and TPU), with the
slots side by side: ``A`` as ``[X, in, N * R]`` (each row against its expert's ``A`` of every
slot), a mask keeping the row's own slot, then ``B`` as ``[X, N * R, out]``. The products run in
the rows' dtype (the model's), as the experts do.

Shape letters: ``M`` sorted rows (tokens times ``k``), ``X`` experts, ``N`` adapter slots,
``R`` ``max_lora_rank``, ``T`` tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxengine.models.grouped_matmul import grouped_linear
from jaxengine.models.lora import LayerLoRA

__all__ = ["EXPERT_TARGET_OF", "add_expert_lora", "expert_lora_shapes"]

#: The LoRA target of each expert matrix of `jaxengine.models.moe.SparseMoeBlock`.
EXPERT_TARGET_OF = {
  "expert_gate": "experts.gate_proj",
  "expert_up": "experts.up_proj",
  "expert_down": "experts.down_proj",
}


def expert_lora_shapes(num_experts: int, hidden: int, intermediate: int) -> dict[str, tuple]:
  """``(X, in, out)`` of each expert target (a model's `lora_target_shapes` entries) for
  `num_experts` experts of `hidden` -> `intermediate` -> `hidden` features."""
  x, e, f = num_experts, hidden, intermediate
  return {
    "experts.gate_proj": (x, e, f),
    "experts.up_proj": (x, e, f),
    "experts.down_proj": (x, f, e),
  }


def add_expert_lora(
  y: jax.Array,
  rows: jax.Array,
  lora: LayerLoRA | None,
  target: str,
  row_tokens: jax.Array,
  group_sizes: jax.Array,
  *,
  batch_invariant: bool = False,
) -> jax.Array:
  """``y + B[slot, e] (A[slot, e] x)`` for every sorted row; `y` itself without this target.

  Args:
    y: ``[M, out]`` the experts' projection of `rows`.
    rows: ``[M, in]`` the projection's input, sorted by expert (`group_sizes`).
    lora: this layer's `LayerLoRA` (``slots [T]``), or None (then nothing is traced).
    target: the expert target (`jaxengine.models.lora.EXPERT_LORA_TARGETS`).
    row_tokens: ``[M] int`` the token of each sorted row (its index into ``lora.slots``).
    group_sizes: ``[X] int32`` rows per expert.
    batch_invariant: row-tiled grouped products (`jaxengine.models.grouped_matmul.grouped_linear`).

  Returns:
    ``[M, out]`` in `y`'s dtype.
  """
  if lora is None or target not in lora.weights:
    return y
  a, b = lora.weights[target]  # [N + 1, X, in, R], [N + 1, X, R, out]
  a, b = a[1:], b[1:]  # slot 0 (the base model) adds nothing: its rows are masked below
  n, num_experts, n_in, r = a.shape
  a_grouped = jnp.transpose(a, (1, 2, 0, 3)).reshape(num_experts, n_in, n * r)  # [X, in, N R]
  b_grouped = jnp.transpose(b, (1, 0, 2, 3)).reshape(num_experts, n * r, -1)  # [X, N R, out]
  fixed = batch_invariant
  xa = grouped_linear(rows, a_grouped.astype(rows.dtype), group_sizes, batch_invariant=fixed)
  adapters = jnp.arange(1, n + 1, dtype=lora.slots.dtype)  # [N] slots 1..N
  mine = lora.slots[row_tokens][:, None] == adapters  # [M, N]
  xa = jnp.where(mine[..., None], xa.reshape(-1, n, r), 0).reshape(-1, n * r)  # [M, N R]
  delta = grouped_linear(xa, b_grouped.astype(xa.dtype), group_sizes, batch_invariant=fixed)
  return y + delta.astype(y.dtype)
