"""The Qwen3.5 text decoder in Flax NNX: Gated DeltaNet layers mixed with gated attention.

``layer_types`` says, per layer, which token mixer it has:

- ``"linear_attention"``: a Gated DeltaNet layer (`jaxengine.models.gated_deltanet`), which keeps
  a fixed-size recurrent state per request instead of keys and values per position;
- ``"full_attention"``: grouped-query attention through the paged seam
  (`jaxengine.models.attention.attention`) with an output gate: ``q_proj`` gives each head its
  query and a gate of the same width (``[H, 2D]``, query first), the output is
  ``o_proj(attn * sigmoid(gate))``; ``(1 + w)`` RMSNorms on the query and key heads; the rotary
  embedding turns only the first ``partial_rotary_factor * D`` features of a head (text positions
  are the same on Qwen3.5's three multimodal rotary sections, so they rotate as one).

Per layer ``x += mixer(input_norm(x)); x += mlp(post_attention_norm(x))``, every decoder norm
``x / rms(x) * (1 + w)`` in float32, the MLP ``down(silu(gate(x)) * up(x))`` (the MoE variants:
routed experts plus a gated shared expert, `Qwen3_5SparseMoe`); logits
``lm_head(final_norm(x))`` (or the tied embedding).

The paged cache holds only the full-attention layers (`Qwen3_5Config.kv_cache_spec`); the linear
layers' states are a pool of slots in the cache's ``recurrent`` field, one slot per running
request (`PagedAttentionMetadata.state_slots`), that the engine sizes from
`Qwen3_5.recurrent_state_spec`. Called without a pool (a whole-sequence forward over scratch
pages, `jaxengine.models.token_logprobs`, every sequence starting at position 0) the model uses a
zero pool of its own, one slot per request.

With ``scan_layers`` the layers are a stack per kind (``layers/linear``, ``layers/full``) run as
one `jax.lax.scan` over the repeating group of `layer_types`, the pool stacked per linear layer
(`jaxengine.models.qwen3_5_scan`).

Shape letters as in `jaxengine.models.llama`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.attention import PagedAttentionMetadata, PagedKVCache, attention
from jaxengine.models.gated_deltanet import (
  GatedDeltaNet,
  RecurrentState,
  RecurrentStateSpec,
  StepRows,
  state_spec,
)
from jaxengine.models.layers import (
  ConfiguredDecoder,
  RMSNorm,
  linear,
  normal_init,
  normal_out_in,
  project,
  rotary_embedding,
  vocab_logits,
)
from jaxengine.models.lora import LayerLoRA, LoRAInputs, add_lora
from jaxengine.models.moe import SparseMoeBlock
from jaxengine.models.moe_lora import expert_lora_shapes
from jaxengine.models.qwen3_5_checkpoints import LINEAR, Qwen3_5Config, hf_weight_specs
from jaxengine.models.qwen3_5_scan import HybridStacks, scan_hybrid_layers, stack_hybrid_layers
from jaxengine.models.weights import WeightSpec

__all__ = ["Qwen3_5", "Qwen3_5Attention", "Qwen3_5Config", "Qwen3_5DecoderLayer"]


def _norm(config: Qwen3_5Config, dim: int) -> RMSNorm:
  return RMSNorm(dim, eps=config.rms_norm_eps, unit_offset=True)


class Qwen3_5Attention(nnx.Module):
  """Gated grouped-query attention of one full-attention layer.

  Attributes:
    wq: ``[2 H D, E]`` each head's query then its gate; wk, wv: ``[K D, E]``; wo: ``[E, H D]``.
    q_norm, k_norm: per-head ``(1 + w)`` RMSNorms over ``D``.
    cache_layer: this layer's index among the full-attention layers (its pages).
  """

  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = dict.fromkeys(("wq", "wk", "wv", "wo"), (1,))

  def __init__(self, config: Qwen3_5Config, cache_layer: int, *, dtype, rngs: nnx.Rngs):
    e, h, k, d = (
      config.hidden_size,
      config.num_attention_heads,
      config.num_key_value_heads,
      config.head_dim,
    )
    self.config = config
    self.cache_layer = cache_layer
    self.wq = nnx.Param(normal_out_in(rngs, (2 * h * d,), (e,), dtype))
    self.wk = nnx.Param(normal_out_in(rngs, (k * d,), (e,), dtype))
    self.wv = nnx.Param(normal_out_in(rngs, (k * d,), (e,), dtype))
    self.wo = nnx.Param(normal_out_in(rngs, (e,), (h * d,), dtype))
    self.q_norm = _norm(config, d)
    self.k_norm = _norm(config, d)
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """The rotary embedding on the first `rotary_dim` features of ``[..., N, D]`` heads."""
    rot = self.config.rotary_dim
    turned = rotary_embedding(x[..., :rot], positions, self.config.inv_freq())
    return jnp.concatenate([turned, x[..., rot:]], axis=-1)

  def __call__(
    self, x, positions, kv_cache, metadata, lora: LayerLoRA | None = None, cache_layer=None
  ):
    """``[..., E]`` normalised hidden states -> ``([..., E] output, updated cache)``; `lora`
    this layer's adapters (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) or None;
    `cache_layer` the pages' layer (``[] int32`` in a scan), None for `cache_layer`'s own."""
    cfg = self.config
    cache_layer = self.cache_layer if cache_layer is None else cache_layer
    lead = x.shape[:-1]
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fixed = self.batch_invariant
    query_gate = add_lora(project(self, "wq", x), x, lora, "q_proj", fixed)
    query_gate = query_gate.reshape(*lead, h, 2 * d)
    q, gate = query_gate[..., :d], query_gate[..., d:]
    k = add_lora(project(self, "wk", x), x, lora, "k_proj", fixed).reshape(*lead, kv, d)
    v = add_lora(project(self, "wv", x), x, lora, "v_proj", fixed).reshape(*lead, kv, d)
    q = self._rotate(self.q_norm(q), positions)
    k = self._rotate(self.k_norm(k), positions)
    out, kv_cache = attention(q, k, v, kv_cache, cache_layer, metadata, scale=d**-0.5)
    out = out.reshape(*lead, h * d) * jax.nn.sigmoid(gate.reshape(*lead, h * d))
    return add_lora(project(self, "wo", out), out, lora, "o_proj", fixed), kv_cache


class Qwen3_5MLP(nnx.Module):
  """``down(silu(gate(x)) * up(x))``; w_gate, w_up ``[F, E]``, w_down ``[E, F]`` (``F`` the
  config's ``intermediate_size`` unless given)."""

  QUANTIZABLE: ClassVar[dict[str, tuple[int, ...]]] = dict.fromkeys(
    ("w_gate", "w_up", "w_down"), (1,)
  )

  def __init__(
    self,
    config: Qwen3_5Config,
    *,
    dtype,
    rngs: nnx.Rngs,
    intermediate_size: int | None = None,
    lora_prefix: str = "",
  ):
    e, f = config.hidden_size, intermediate_size or config.intermediate_size
    #: Before its LoRA targets' names (``"shared_expert."``: an MoE block's shared expert).
    self.lora_prefix = lora_prefix
    self.w_gate = nnx.Param(normal_out_in(rngs, (f,), (e,), dtype))
    self.w_up = nnx.Param(normal_out_in(rngs, (f,), (e,), dtype))
    self.w_down = nnx.Param(normal_out_in(rngs, (e,), (f,), dtype))
    self.scales: nnx.Dict[nnx.Param] = nnx.Dict()
    self.batch_invariant = False

  def __call__(self, x: jax.Array, lora: LayerLoRA | None = None) -> jax.Array:
    """`lora`: this layer's adapters (``gate_proj``, ``up_proj``, ``down_proj`` after
    `lora_prefix`) or None."""
    fixed, pre = self.batch_invariant, self.lora_prefix
    gate = add_lora(project(self, "w_gate", x), x, lora, f"{pre}gate_proj", fixed)
    up = add_lora(project(self, "w_up", x), x, lora, f"{pre}up_proj", fixed)
    hidden = jax.nn.silu(gate) * up
    return add_lora(project(self, "w_down", hidden), hidden, lora, f"{pre}down_proj", fixed)


class Qwen3_5SparseMoe(nnx.Module):
  """The MoE variants' feed-forward block: ``experts(x) + sigmoid(shared_gate x) * shared(x)``,
  the routed experts `jaxengine.models.moe.SparseMoeBlock` (softmax, top ``k``, renormalised).

  Attributes:
    experts: the routed experts; shared: the shared expert (`Qwen3_5MLP`);
    shared_gate: ``[1, E]`` its gate.
  """

  def __init__(self, config: Qwen3_5Config, *, dtype, rngs: nnx.Rngs):
    self.experts = SparseMoeBlock(cast(Any, config), dtype=dtype, rngs=rngs)
    width = config.shared_expert_intermediate_size
    self.shared = Qwen3_5MLP(
      config, dtype=dtype, rngs=rngs, intermediate_size=width, lora_prefix="shared_expert."
    )
    self.shared_gate = nnx.Param(normal_out_in(rngs, (1,), (config.hidden_size,), dtype))
    self.batch_invariant = False

  def __call__(self, x: jax.Array, lora: LayerLoRA | None = None) -> jax.Array:
    """`routed`'s output alone."""
    return self.routed(x, None, lora)[0]

  def routed(
    self,
    x: jax.Array,
    routed_experts: jax.Array | None = None,
    lora: LayerLoRA | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """``([..., E] output, [..., k] int32 experts)``: the routed experts' choice (or the
    replayed `routed_experts`, `jaxengine.models.moe.SparseMoeBlock.routed`) and the output;
    `lora`: this layer's adapters (the routed experts' ``experts.*`` targets, the shared
    expert's ``shared_expert.*``) or None."""
    routed, experts = self.experts.routed(x, routed_experts, lora)
    shared_gate = linear(x, self.shared_gate[...], batch_invariant=self.batch_invariant)
    gate = jax.nn.sigmoid(shared_gate)  # [..., 1]
    return routed + gate * self.shared(x, lora), experts


class Qwen3_5DecoderLayer(nnx.Module):
  """``x += mixer(input_norm(x)); x += mlp(post_attention_norm(x))``; the mixer a
  `GatedDeltaNet` (``is_linear``) or a `Qwen3_5Attention`."""

  def __init__(self, config: Qwen3_5Config, layer: int, *, dtype, rngs: nnx.Rngs):
    e = config.hidden_size
    self.is_linear = config.layer_types[layer] == LINEAR
    #: The layer's index among the layers of its kind (its state slot pool or its pages).
    kind_layers = config.linear_layers if self.is_linear else config.attention_layers
    self.kind_index = kind_layers.index(layer)
    self.input_norm = _norm(config, e)
    self.mixer: GatedDeltaNet | Qwen3_5Attention
    if self.is_linear:
      self.mixer = GatedDeltaNet(config, dtype=dtype, rngs=rngs)
    else:
      self.mixer = Qwen3_5Attention(config, self.kind_index, dtype=dtype, rngs=rngs)
    self.post_attention_norm = _norm(config, e)
    self.mlp: Qwen3_5MLP | Qwen3_5SparseMoe
    if config.num_experts:
      self.mlp = Qwen3_5SparseMoe(config, dtype=dtype, rngs=rngs)
    else:
      self.mlp = Qwen3_5MLP(config, dtype=dtype, rngs=rngs)

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    kv_cache: PagedKVCache,
    metadata: PagedAttentionMetadata,
    rows: StepRows,
    conv: jax.Array | None,
    delta: jax.Array | None,
    lora: LayerLoRA | None = None,
    replay: jax.Array | None = None,
    *,
    cache_layer: Any = None,
  ) -> tuple[jax.Array, PagedKVCache, Any, Any, jax.Array | None]:
    """The residual stream ``[..., E]`` after this layer: ``(x, kv_cache, conv, delta,
    experts)``, `conv` and `delta` the linear mixer's state slots (`GatedDeltaNet.__call__`,
    passed through by a full layer), `experts` the MoE block's ``[..., k]`` choice (None for a
    dense MLP); `replay` the experts to route to instead, `cache_layer` as
    `Qwen3_5Attention.__call__`."""
    h = self.input_norm(x)
    if isinstance(self.mixer, GatedDeltaNet):
      assert conv is not None and delta is not None  # a linear layer's state slots
      h, conv, delta = self.mixer(h, conv, delta, rows, lora)
    else:
      h, kv_cache = self.mixer(h, positions, kv_cache, metadata, lora, cache_layer)
    x = x + h
    experts = None
    if isinstance(self.mlp, Qwen3_5SparseMoe):
      h, experts = self.mlp.routed(self.post_attention_norm(x), replay, lora)
    else:
      h = self.mlp(self.post_attention_norm(x), lora)
    return x + h, kv_cache, conv, delta, experts


class Qwen3_5(ConfiguredDecoder, nnx.Module):
  """Qwen3.5 text decoder over a `PagedKVCache` with a recurrent state pool; implements
  `jaxengine.models.Model` (attributes as `jaxengine.models.Llama`: ``config``, ``dtype``,
  ``embed``, ``layers``, ``final_norm``, ``lm_head``) and declares `recurrent_state_spec`.
  """

  def __init__(self, config: Qwen3_5Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    """Builds a model with random weights (Gaussian, std ``fan_in ** -0.5``; norm offsets 0).

    Args:
      config: hyper-parameters.
      dtype: parameter and compute dtype (norms, the recurrence, softmax and logits in float32).
      rngs: random streams for initialisation.
    """
    self.config = config
    self.dtype = dtype
    e, v = config.hidden_size, config.vocab_size
    self.embed = nnx.Param(normal_init(rngs, (v, e), e, dtype))
    layers = [
      Qwen3_5DecoderLayer(config, i, dtype=dtype, rngs=rngs)
      for i in range(config.num_hidden_layers)
    ]
    self.layers: nnx.List | HybridStacks = (
      self.stack_decoder_layers(layers) if config.scan_layers else nnx.List(layers)
    )
    self.final_norm = _norm(config, e)
    self.lm_head = (
      None if config.tie_word_embeddings else nnx.Param(normal_init(rngs, (v, e), e, dtype))
    )
    self.batch_invariant = False
    #: Return each token's experts too (``enable_return_routed_experts``; an MoE model).
    self.return_routed_experts = False

  @property
  def recurrent_state_spec(self) -> RecurrentStateSpec:
    """What each request keeps per linear layer (the engine's state pool is sized by it)."""
    return state_spec(self.config, self.dtype)

  def __call__(
    self,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_cache: PagedKVCache,
    attn_metadata: PagedAttentionMetadata,
    *,
    lora: LoRAInputs | None = None,
    routed_experts: jax.Array | None = None,
  ) -> tuple[jax.Array, PagedKVCache] | tuple[jax.Array, PagedKVCache, jax.Array]:
    """Runs the decoder over the step's flat tokens, updating the pages and the state slots.

    Args:
      token_ids: ``[1, T] int32``.
      positions: ``[1, T] int32``; a token at position 0 starts its sequence's state afresh.
      kv_cache: the `PagedKVCache`, its ``recurrent`` the engine's `RecurrentState` pool (then
        `attn_metadata` carries ``state_slots``), or None (a scratch forward: module docstring).
      attn_metadata: the step's `PagedAttentionMetadata`.
      lora: the step's LoRA adapters with each flat token's slot (`lora_target_shapes`), or
        None.
      routed_experts: None, or (an MoE model) ``[1, T, M, k]`` integer experts to route each
        token to at each layer instead of the router's choice (replay).

    Returns:
      ``(hidden [1, T, E] after the final norm, updated cache)``; with
      ``return_routed_experts`` (an MoE model), third, the ``[1, T, M, k] int32`` experts of
      each token at each layer (largest router weight first, or the replayed ones).
    """
    x = jnp.take(self.embed[...], token_ids, axis=0, mode="clip")
    pool = kv_cache.recurrent
    metadata = attn_metadata
    if pool is None:  # a scratch forward: a zero slot per request, after the null slot
      num_reqs = attn_metadata.seq_lens.shape[0]
      pool = self.recurrent_state_spec.create(num_reqs + 1)
      slots = jnp.arange(1, num_reqs + 1, dtype=jnp.int32)
      metadata = dataclasses.replace(attn_metadata, state_slots=slots)
    rows = StepRows.of(metadata, positions)
    cfg = self.config
    if cfg.scan_layers:
      x, kv_cache, pool, experts = scan_hybrid_layers(
        cast(HybridStacks, self.layers), x, positions, kv_cache, attn_metadata, rows, pool,
        layer_types=cfg.layer_types, period=cfg.layer_period, lora=lora,
        routed_experts=routed_experts,
      )  # fmt: skip
    else:
      x, kv_cache, pool, experts = self._unrolled(
        x, positions, kv_cache, attn_metadata, rows, pool, lora, routed_experts
      )
    if kv_cache.recurrent is not None:
      kv_cache = dataclasses.replace(kv_cache, recurrent=pool)
    if self.return_routed_experts:
      return self.final_norm(x), kv_cache, cast(jax.Array, experts)  # [..., M, k]
    return self.final_norm(x), kv_cache

  def _unrolled(self, x, positions, kv_cache, metadata, rows, pool, lora, routed_experts):
    """The layers one by one (`__call__`'s loop without ``scan_layers``): ``(x, kv_cache,
    pool, experts [..., M, k] or None)``."""
    conv, delta = list(pool.conv), list(pool.delta)
    routed: list[jax.Array] = []
    for i, layer in enumerate(cast(nnx.List, self.layers)):
      adapters = None if lora is None else lora.layer(i)
      replay = None if routed_experts is None else routed_experts[..., i, :]
      j = layer.kind_index
      if layer.is_linear:
        x, kv_cache, conv[j], delta[j], experts = layer(
          x, positions, kv_cache, metadata, rows, conv[j], delta[j], adapters, replay
        )
      else:
        x, kv_cache, _, _, experts = layer(
          x, positions, kv_cache, metadata, rows, None, None, adapters, replay
        )
      if experts is not None:
        routed.append(experts)
    state = RecurrentState(conv=tuple(conv), delta=tuple(delta))
    return x, kv_cache, state, (jnp.stack(routed, axis=-2) if routed else None)

  def stack_decoder_layers(self, layers: Sequence[Qwen3_5DecoderLayer]) -> HybridStacks:
    """The layers as one stack per kind (`jaxengine.models.qwen3_5_scan.stack_hybrid_layers`;
    each layer's own index among its kind dropped, in place)."""
    return stack_hybrid_layers(layers, self.config.layer_types)

  @property
  def num_layers(self) -> int:
    """``L``, the decoder layers."""
    return self.config.num_hidden_layers

  @property
  def stacked_paths(self) -> tuple[str, ...]:
    """The state paths whose leaves have a leading layer axis (``("layers",)`` with
    ``scan_layers``: both kinds' stacks; quantization and the mesh shardings skip that axis)."""
    return ("layers",) if self.config.scan_layers else ()

  @property
  def num_moe_layers(self) -> int:
    """``M``: the layers with routed experts (every layer of an MoE model, else none)."""
    return len(self.config.moe_layers)

  def lora_target_shapes(self) -> dict[str, tuple[int, ...]]:
    """The ``(in, out)`` features of each projection a LoRA adapter may target, by its PEFT
    module name: the gated attention's ``q_proj`` (its output each head's query and gate),
    ``k_proj``, ``v_proj``, ``o_proj``; the Gated DeltaNet's ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, ``out_proj``; a dense MLP's ``gate_proj``, ``up_proj``,
    ``down_proj``; a mixture of experts' routed experts as ``(X, in, out)``
    (`jaxengine.models.lora.EXPERT_LORA_TARGETS`) and its shared expert's ``gate_proj``,
    ``up_proj``, ``down_proj`` as ``shared_expert.*``. Every layer has slots for every target;
    a layer uses those of its own kind."""
    cfg = self.config
    e, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    hv = cfg.linear_num_value_heads
    value = hv * cfg.linear_value_head_dim
    targets: dict[str, tuple[int, ...]] = {
      "q_proj": (e, 2 * q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e),
      "in_proj_qkv": (e, cfg.conv_dim), "in_proj_z": (e, value), "in_proj_b": (e, hv),
      "in_proj_a": (e, hv), "out_proj": (value, e),
    }  # fmt: skip
    if not cfg.num_experts:
      targets.update(gate_proj=(e, f), up_proj=(e, f), down_proj=(f, e))
      return targets
    shared = cfg.shared_expert_intermediate_size
    targets.update(expert_lora_shapes(cfg.num_experts, e, cfg.moe_intermediate_size))
    targets.update({
      "shared_expert.gate_proj": (e, shared), "shared_expert.up_proj": (e, shared),
      "shared_expert.down_proj": (shared, e),
    })  # fmt: skip
    return targets

  def lora_target_layers(self) -> dict[str, tuple[int, ...]]:
    """The layers of each LoRA target (`jaxengine.lora.LoRAManager`'s ``target_layers``): the
    gated attention's on the full-attention layers, the Gated DeltaNet's on the linear ones."""
    cfg = self.config
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    linear = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    return {
      **dict.fromkeys(attention, tuple(cfg.attention_layers)),
      **dict.fromkeys(linear, tuple(cfg.linear_layers)),
    }

  def weight_specs(self) -> list[WeightSpec]:
    """Every parameter under its Hugging Face checkpoint name
    (`jaxengine.models.qwen3_5_checkpoints.hf_weight_specs`)."""
    return hf_weight_specs(self.config)

  def compute_logits(self, hidden: jax.Array) -> jax.Array:
    """``[..., E]`` hidden states -> ``[..., V] float32`` logits."""
    w = self.embed[...] if self.lm_head is None else self.lm_head[...]
    return vocab_logits(hidden, w, batch_invariant=self.batch_invariant)
