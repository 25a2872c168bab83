"""Qwen3.5's layers under `jax.lax.scan`: a stack per kind, one scan over the repeating group.

A hybrid's layers are of two structures (a Gated DeltaNet mixer or a gated attention one), so
they cannot stack into one ``[L, ...]`` module as a Llama's do
(`jaxengine.models.layer_scan`). With ``scan_layers`` (`jaxengine.models.qwen3_5_checkpoints.
Qwen3_5Config.scan_layers`) a `Qwen3_5` keeps one stack per kind instead (`HybridStacks`):
``layers/linear`` whose every leaf is ``[Ll, ...]`` (the ``Ll`` linear layers in order) and
``layers/full`` of ``[La, ...]`` (the full-attention layers), and `scan_hybrid_layers` runs
them as one `jax.lax.scan` over the repeating group of `layer_types` (Qwen3.5's three linear
layers and one full layer: ``P = 4``, `Qwen3_5Config.layer_period`): iteration ``g`` runs the
group's ``P`` layers, each position its own traced body, reading its weights from row
``g Pl + j`` of its kind's stack (``Pl`` layers of that kind in a group, ``j`` its rank among
them); the layers after the last whole group run unrolled after the loop. XLA compiles ``P``
layer bodies whatever the depth.

What each layer keeps between steps is stacked too and carried through the loop, written in
place: the full layers' pages (`jaxengine.models.kv_pages.PagedKVCache` with stacked pages,
each layer reaching its own by offset) and the linear layers' recurrent state pool
(`jaxengine.models.gated_deltanet.RecurrentStateSpec.stacked`: one ``[Ll, S, ...]`` array per
part), seen in the loop as ``[Ll S, ...]`` slots of which linear layer ``l`` owns ``l S ..
l S + S - 1``: its step rows' slots (own, source, snapshot) are moved by ``l S``
(`jaxengine.models.gated_deltanet.StepRows.offset`), so the layer's gathers and scatters touch
its own slots only, never a copy of its part of the pool. Prefix caching's snapshot slots
are slots of the same pool and move with them.

Measured on a shared 2-core CPU VM with other jobs running, a fresh process each: a
Qwen3.5-0.8B-shaped config (24 layers, hidden 1,024, bfloat16) compiled deviceless for v6e:1x1
(``jaxengine compile``'s path, one ragged step of 8 rows and 8 tokens) in 167.9 / 144.7 / 62.6
s unrolled against 76.2 / 68.4 / 40.8 s scanned (load averages 6 / 8 / 4.5:
docs/performance.md); on XLA:CPU (``benchmarks/bench_layer_scan.py --model
qwen3_5``: 24 layers at width 256, a decode step) lowering and compiling took 25.9 / 24.7 / 20.5
s unrolled against 15.3 / 13.2 / 11.6 s scanned at 1 / 8 / 32 rows, while steps ran slower
(31.8 / 57.1 / 109.9 ms against 58.2 / 59.7 / 122.8 ms): CPU's default stays unrolled.

Checkpoint tensors keep their per-layer names (``model.layers.5.linear_attn...`` fills row 4
of ``layers/linear/mixer/w_qkv``: `Qwen3_5Config.layer_rows`); LoRA adapters, stacked per step
(``L`` per-layer dicts of the same targets), are read by the layer's own index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.gated_deltanet import RecurrentState, StepRows
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.layer_scan import stack_layers, stacked_lora
from jaxengine.models.lora import LayerLoRA, LoRAInputs
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.models.qwen3_5_checkpoints import LINEAR

__all__ = ["HybridStacks", "scan_hybrid_layers", "stack_hybrid_layers"]


class HybridStacks(nnx.Module):
  """A scanned hybrid's decoder layers: one stacked layer module per kind.

  Attributes:
    linear: the linear layers, every leaf ``[Ll, ...]``, or None when there are none.
    full: the full-attention layers, every leaf ``[La, ...]``, or None when there are none.
  """

  def __init__(self, linear: nnx.Module | None, full: nnx.Module | None):
    self.linear = linear
    self.full = full


def stack_hybrid_layers(layers: Sequence[Any], layer_types: Sequence[str]) -> HybridStacks:
  """The layers of each kind of `layer_types` stacked (`jaxengine.models.layer_scan.
  stack_layers`); each layer's own index among its kind (which makes two layers of a kind
  differ in structure) is dropped first, in place: the scan passes it."""
  for layer in layers:
    layer.kind_index = None
    if hasattr(layer.mixer, "cache_layer"):
      layer.mixer.cache_layer = None
  kinds = [[layer for layer, t in zip(layers, layer_types) if (t == LINEAR) == linear]
           for linear in (True, False)]  # fmt: skip
  linear, full = (stack_layers(kind) if kind else None for kind in kinds)
  return HybridStacks(linear, full)


def scan_hybrid_layers(
  stacks: HybridStacks,
  x: jax.Array,
  positions: jax.Array,
  kv_cache: PagedKVCache,
  metadata: PagedAttentionMetadata,
  rows: StepRows,
  pool: RecurrentState,
  *,
  layer_types: Sequence[str],
  period: int,
  lora: LoRAInputs | None = None,
  routed_experts: jax.Array | None = None,
) -> tuple[jax.Array, PagedKVCache, RecurrentState, jax.Array | None]:
  """``x``, the pages and the state pool after every layer of a scanned hybrid (module
  docstring): one `jax.lax.scan` over the ``G = L // P`` whole groups, then the ``L - G P``
  layers after the last whole group unrolled.

  Layer ``i`` (a `jaxengine.models.qwen3_5.Qwen3_5DecoderLayer`, its weights a row of its kind's
  stack) is called as ``layer(x, positions, kv_cache, metadata, rows, conv, delta, lora_i,
  replay_i, cache_layer=row)``.

  Args:
    stacks: the stacked layers (`stack_hybrid_layers`).
    x: ``[..., E]`` the residual stream.
    positions: ``[..., T] int32`` the tokens' positions.
    kv_cache: the full layers' `PagedKVCache`, its pages stacked.
    metadata: the step's attention metadata.
    rows: the step's `StepRows` (slots of one layer's pool).
    pool: the linear layers' stacked pool (one ``[Ll, S, ...]`` array per part).
    layer_types: the ``L`` layers' kinds.
    period: ``P``, the repeating group's length (between 1 and ``L``).
    lora: the step's LoRA adapters (``L`` per-layer dicts), or None.
    routed_experts: None, or ``[..., L, k]`` experts to replay at every layer (MoE).

  Returns:
    ``(x, kv_cache, pool, experts)``: the last layer's output, the cache, the pool, and each
    layer's ``[..., L, k] int32`` experts (an MoE model; else None).

  Raises:
    ValueError: a pool or cache that is not stacked, or a `period` outside ``[1, L]``.
  """
  num_layers = len(layer_types)
  if not 1 <= period <= num_layers:
    raise ValueError(f"period must be between 1 and num_layers={num_layers}, got {period}")
  if kv_cache.stacked_layers is None and stacks.full is not None:
    raise ValueError("a scanned Qwen3.5 needs stacked pages (its kv_cache_spec's stacked)")
  if pool.conv and not pool.is_stacked:
    raise ValueError("a scanned Qwen3.5 needs a stacked state pool (RecurrentStateSpec.stacked)")
  groups, rest = divmod(num_layers, period)
  group = layer_types[:period]
  # Per position of the group: its kind's stack, its rank among that kind, that kind's count.
  is_linear = [t == LINEAR for t in group]
  rank = [sum(is_linear[k] == is_linear[j] for k in range(j)) for j in range(period)]
  per_group = [sum(k == is_linear[j] for k in is_linear) for j in range(period)]
  slots = pool.num_slots
  parts = tuple(part.shape for part in (*pool.conv, *pool.delta))
  conv = pool.conv[0].reshape(-1, *parts[0][2:]) if pool.conv else None  # [Ll S, K - 1, C]
  delta = pool.delta[0].reshape(-1, *parts[1][2:]) if pool.delta else None  # [Ll S, Hv, Dk, Dv]
  graphdefs, weights = {}, {}
  for name in ("linear", "full"):
    stack = getattr(stacks, name)
    if stack is not None:
      graphdefs[name], weights[name] = nnx.split(stack)
  all_lora = stacked_lora(lora)
  replay = None if routed_experts is None else jnp.moveaxis(routed_experts, -2, 0)  # [L, ..., k]

  def run(carry, g, j):
    """Layer ``g P + j`` (``g`` traced in the loop, an int after it)."""
    x, pages, conv, delta = carry
    index = g * period + j
    row_of = lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)
    kind = "linear" if is_linear[j] else "full"
    row = g * per_group[j] + rank[j]
    layer_weights = jax.tree.map(
      lambda leaf: jax.lax.dynamic_index_in_dim(leaf, row, keepdims=False), weights[kind]
    )
    layer = nnx.merge(graphdefs[kind], layer_weights)
    view = None
    if lora is not None:
      layer_lora = lora.layers[index] if isinstance(index, int) else jax.tree.map(row_of, all_lora)
      view = LayerLoRA(lora.slots, layer_lora)
    cache = dataclasses.replace(kv_cache, pages=pages)
    layer_rows = rows.offset(row * slots) if is_linear[j] else rows
    x, cache, conv, delta, experts = layer(
      x, positions, cache, metadata, layer_rows, conv, delta, view,
      None if replay is None else row_of(replay), cache_layer=row,
    )  # fmt: skip
    return (x, cache.pages, conv, delta), experts

  def body(carry, g):
    routed = []
    for j in range(period):
      carry, experts = run(carry, g, j)
      routed.append(experts)
    return carry, (None if routed[0] is None else jnp.stack(routed))

  carry = (x, kv_cache.pages, conv, delta)
  carry, experts = jax.lax.scan(body, carry, jnp.arange(groups, dtype=jnp.int32))
  routed = [] if experts is None else [experts.reshape(-1, *experts.shape[2:])]  # [G P, ..., k]
  for j in range(rest):  # the layers after the last whole group
    carry, more = run(carry, groups, j)
    if more is not None:
      routed.append(more[None])
  x, pages, conv, delta = carry
  if conv is not None and delta is not None:
    pool = RecurrentState(conv=(conv.reshape(parts[0]),), delta=(delta.reshape(parts[1]),))
  layers_experts = jnp.moveaxis(jnp.concatenate(routed), 0, -2) if routed else None
  return x, dataclasses.replace(kv_cache, pages=pages), pool, layers_experts
